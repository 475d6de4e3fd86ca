"""A training script whose Accelerator asks for a wrapper through its own plugin, written as a user
writes one: ``Accelerator(fsdp_plugin=...)`` or ``Accelerator(deepspeed_plugin=...)``, accumulation
with ``accelerator.accumulate``, AdamW and a linear schedule. tests/test_script.py runs it unedited
under ``python -m harness watch``.

``--plugin``: fsdp2, fsdp1, deepspeed-z1, deepspeed-z2 or deepspeed-z3 (none: no plugin);
``--reduce-fp32``: FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32);
``--clip X``: DeepSpeed's gradient_clipping (accelerate's default is 1.0); ``--offload``: a setting
the harness does not model (FSDP's cpu_offload, DeepSpeed's offload_optimizer_device="cpu");
``--reshard-after-forward false``: an FSDP setting that changes no gradient; ``--sgd``: plain SGD
(an update in proportion to the gradient, so a clip left out shows at full size); ``--mistake
loss_times_steps``: each micro-batch's loss multiplied by the accumulation steps (a window's gradient
is k times the contract's).
"""

import argparse

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, features, targets=None):
        out = self.body(features.to(self.body[0].weight.dtype)).squeeze(-1).float()
        loss = None if targets is None else nn.functional.mse_loss(out, targets)
        return {"loss": loss, "out": out}


def plugin(args):
    if args.plugin.startswith("fsdp"):
        options = {"fsdp_version": int(args.plugin[-1])}
        if args.reduce_fp32:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            options["mixed_precision_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                     reduce_dtype=torch.float32)
        if args.offload:
            from torch.distributed.fsdp import CPUOffloadPolicy

            options["cpu_offload"] = CPUOffloadPolicy()
        if args.reshard_after_forward is not None:
            options["reshard_after_forward"] = args.reshard_after_forward == "true"
        return {"fsdp_plugin": FullyShardedDataParallelPlugin(**options)}
    if args.plugin.startswith("deepspeed"):
        options = {"zero_stage": int(args.plugin[-1])}
        if args.clip is not None:
            options["gradient_clipping"] = args.clip
        if args.offload:
            options["offload_optimizer_device"] = "cpu"
        return {"deepspeed_plugin": DeepSpeedPlugin(**options)}
    return {}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--plugin", default="none")
    parser.add_argument("--mixed-precision", default="no")
    parser.add_argument("--reduce-fp32", action="store_true")
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--sgd", action="store_true")
    parser.add_argument("--reshard-after-forward", choices=("true", "false"), default=None)
    parser.add_argument("--mistake", choices=("loss_times_steps",), default=None)
    args = parser.parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=2, mixed_precision=args.mixed_precision, **plugin(args))
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(48, 6, generator=generator)
    data = TensorDataset(features, 3 * features.sum(dim=1) + torch.randn(48, generator=generator))
    loader = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(2),
                        collate_fn=lambda rows: {"features": torch.stack([r[0] for r in rows]),
                                                 "targets": torch.stack([r[1] for r in rows])})
    model = Regressor()
    optimizer = (torch.optim.SGD if args.sgd else torch.optim.AdamW)(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.5, total_iters=6)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    model.train()
    for epoch in range(2):
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch)["loss"]
                if args.mistake == "loss_times_steps":
                    loss = loss * accelerator.gradient_accumulation_steps
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        accelerator.print(f"epoch {epoch}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
