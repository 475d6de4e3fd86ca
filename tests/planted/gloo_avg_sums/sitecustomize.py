"""A gloo whose reduce-scatter with ReduceOp.AVG sums, as torch 2.7's and 2.8's does (pytorch/pytorch#162338),
in every Python process started with this folder on PYTHONPATH: the ranks, and the fork server they come
from, as on an affected torch. Planted by tests/test_backend_defects.py; not a test module."""

import torch.distributed as dist


def _summing(real):
    def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return real(output, input, op=dist.ReduceOp.SUM if op == dist.ReduceOp.AVG else op, group=group,
                    async_op=async_op)

    return reduce_scatter


for _name in ("reduce_scatter_tensor", "reduce_scatter_single"):
    if hasattr(dist, _name):
        setattr(dist, _name, _summing(getattr(dist, _name)))
