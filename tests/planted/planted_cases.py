"""Planted faults in real rank processes; run only by the harness's own tests (not a test module)."""

import os
import signal
import time

import torch
import torch.distributed as dist

from harness import Diagnosis, Variant, case
from harness.rank.models import derive_seed, rank_batch, regression_loss

# the planted situations are about ranks and the protocol, not about wrappers
DDP_ONLY = ["ddp"]
RANK_FAULTS = ("raise", "exit", "kill", "hang_in_collective", "hang_outside")


def sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def prepared_regressor(ctx):
    accelerator = ctx.accelerator()
    model = ctx.model("regressor")
    oracle = ctx.oracle({"model": model}, optimizer=sgd)
    model, optimizer = accelerator.prepare(model, sgd(model.parameters()))
    return accelerator, model, optimizer, oracle


def synced_steps(ctx, accelerator, model, optimizer, oracle, steps, *, batch_of=None, contract_steps=True):
    """One synced backward and an optimizer step each, checked against the oracle, which is told the
    optimizer steps (``contract_steps``) and gets ``batch_of(step)`` (the rank's own batch by default)."""
    models = {"model": model}
    for step in steps:
        batch = (batch_of or ctx.batch)(step)
        accelerator.backward(regression_loss(model, batch))
        oracle.backward(lambda m: regression_loss(m["model"], batch), sync=True)
        oracle.check_grads(step, models)
        optimizer.step()
        optimizer.zero_grad()
        oracle.step(contract_steps)
        oracle.check_params(step, models, {"model": optimizer})


def plant(fault, rank):
    """The fault, on rank 1 only; the other ranks go on to their next collective."""
    if rank != 1:
        return
    if fault == "raise":
        raise ZeroDivisionError("planted on rank 1")
    if fault == "exit":
        os._exit(7)
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "hang_in_collective":
        dist.all_reduce(torch.ones(1))  # no other rank joins this one
    if fault == "hang_outside":
        time.sleep(3600)


def _variants():
    out = []
    for fault in RANK_FAULTS:
        out += [Variant(fault, {"fault": fault}), Variant(f"after_{fault}", {"fault": None})]
    return out


@case("planted_rank_fault", wrappers=DDP_ONLY, variants=_variants())
def test_planted_rank_fault(ctx):
    """One correct step, then rank 1 fails in the variant's way; each faulty variant is followed
    by a healthy one, which must pass on the rebuilt pool."""
    fault = ctx.variant["fault"]
    accelerator, model, optimizer, oracle = prepared_regressor(ctx)
    synced_steps(ctx, accelerator, model, optimizer, oracle, [1])
    if fault is None:
        synced_steps(ctx, accelerator, model, optimizer, oracle, [2, 3])
        return
    plant(fault, ctx.rank)
    if fault == "hang_in_collective":
        return  # the others finish: only rank 1 is left waiting
    if fault == "hang_outside":
        dist.barrier()  # blocked, waiting for rank 1
    synced_steps(ctx, accelerator, model, optimizer, oracle, [2])


@case("planted_left_out_of_no_sync", wrappers=DDP_ONLY, variants=[Variant("fp32", {"precision": "fp32"})])
def test_planted_left_out_of_no_sync(ctx):
    """A user's bug: two models trained together, only ``gen`` put under ``no_sync``. ``disc``
    syncs on every backward, where the pattern promises local gradients. With $PLANTED_RELEASE (a
    FIFO) set, rank 0 of a two-rank cell first waits until something opens it for writing (rank 1
    waits in the first collective): a long cell for as long as a test wants, at any machine's speed."""
    release = os.environ.get("PLANTED_RELEASE")
    if release and ctx.rank == 0 and ctx.world_size == 2:
        os.close(os.open(release, os.O_RDONLY))  # blocks until a writer opens the FIFO
    accelerator = ctx.accelerator()
    gen, disc = ctx.model("generator", name="gen"), ctx.model("discriminator", name="disc")
    oracle = ctx.oracle({"gen": gen, "disc": disc}, optimizer=sgd)
    gen, disc = accelerator.prepare(gen, disc)
    models = {"gen": gen, "disc": disc}

    def loss(m, noise):
        return m["disc"](m["gen"](noise)).pow(2).mean()

    for step in (1, 2):
        noise = ctx.batch(step, features=3)[0]
        with accelerator.no_sync(gen):
            accelerator.backward(loss(models, noise))
        oracle.backward(lambda m: loss(m, noise), sync=False)
        oracle.check_grads(step, models)


@case("planted_blocks_half_way", wrappers=DDP_ONLY,
      variants=[Variant("finishes1", {"blocks": False}), Variant("finishes2", {"blocks": False}),
                Variant("blocks", {"blocks": True})])
def test_planted_blocks_half_way(ctx):
    """Two correct cells, then one that blocks until the run is ended: lets a test interrupt a run
    half-way whatever the machine's speed. Rank 0 leaves a file named after the variant in
    $PLANTED_PROGRESS_DIR as each cell starts: the file ``blocks`` says the two cells before it have
    finished (and, in a run without xdist, are in the reports) and that the run cannot finish."""
    progress = os.environ.get("PLANTED_PROGRESS_DIR")
    if progress and ctx.rank == 0:
        open(os.path.join(progress, ctx.variant_name), "w").close()
    if ctx.variant["blocks"]:
        time.sleep(3600)  # the ranks ignore Ctrl-C: the controller ends them when it is interrupted
    accelerator, model, optimizer, oracle = prepared_regressor(ctx)
    synced_steps(ctx, accelerator, model, optimizer, oracle, [1])


FP32 = [Variant("fp32", {"precision": "fp32"})]


@case("planted_canary_misdeclared", wrappers=DDP_ONLY, variants=FP32, canary=Diagnosis("not_synced", model="model"))
def test_planted_canary_misdeclared(ctx):
    """A canary whose pattern breaks the optimizer steps (it steps where its contract has none),
    declared as breaking sync: the harness finds stepped_early, not the declared not_synced, so the
    cell is missed. Finding some failure is not enough."""
    accelerator, model, optimizer, oracle = prepared_regressor(ctx)
    synced_steps(ctx, accelerator, model, optimizer, oracle, [1, 2], contract_steps=False)


@case("planted_alike", wrappers=DDP_ONLY, variants=FP32)
def test_planted_alike(ctx):
    """Every rank gets the same data, so synced and local gradients are equal and no check can tell
    whether the sync happened: from two ranks on the cell is an error (a harness defect), not a pass."""
    accelerator, model, optimizer, oracle = prepared_regressor(ctx)
    synced_steps(ctx, accelerator, model, optimizer, oracle, [1, 2],
                 batch_of=lambda step: rank_batch(derive_seed(ctx.seed, "alike", step), 0, rows=6, features=4))


# A declared raise (harness/rank/process/raises.py): torch's own ValueError, declared on one variant; the
# same words raised by the case, or another of torch's errors, or the declaration not applying, are
# the cell's error as ever
DECLARED_RAISE = Diagnosis("raised", when={"declared": True}, match="batch_size should be a positive integer",
                           upstream="planted")


def _raise(raiser):
    if raiser == "case":
        raise ValueError("batch_size should be a positive integer value, but got batch_size=0")
    if raiser == "torch":
        torch.utils.data.BatchSampler(range(4), batch_size=0, drop_last=False)
    torch.utils.data.DataLoader(range(4), batch_size=2, shuffle=True, sampler=range(4))


@case("planted_library_error", wrappers=DDP_ONLY, defects={"ddp": DECLARED_RAISE},
      variants=[Variant("declared", {"declared": True, "raiser": "torch"}),
                Variant("undeclared", {"declared": False, "raiser": "torch"}),
                Variant("from_the_case", {"declared": True, "raiser": "case"}),
                Variant("another_error", {"declared": True, "raiser": "torch_other"})])
def test_planted_library_error(ctx):
    """One correct step, then torch (or the case) raises on every rank at step 2."""
    accelerator, model, optimizer, oracle = prepared_regressor(ctx)
    synced_steps(ctx, accelerator, model, optimizer, oracle, [1])
    ctx.at_step = 2
    _raise(ctx.variant["raiser"])


# A compiled variant whose model is torch.nn's own modules alone: under DDP dynamo compiles none of
# their frames, so the cell would check eager code under a compiled name (harness/rank/process/cell.py).
@case("planted_compiled_nothing", wrappers=DDP_ONLY,
      variants=[Variant("sequential-compile=aot_eager", {"model": "sequential", "compile": "aot_eager"}),
                Variant("own_module-compile=aot_eager", {"model": "regressor", "compile": "aot_eager"})])
def test_planted_compiled_nothing(ctx):
    """Two synced steps of a model accelerate compiles (``dynamo_backend``): a bare ``nn.Sequential``,
    or the harness's own regressor."""
    accelerator = ctx.accelerator()
    if ctx.variant["model"] == "sequential":
        model = ctx.model(lambda: torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)),
                          name="sequential")
    else:
        model = ctx.model("regressor")
    oracle = ctx.oracle({"model": model}, optimizer=sgd)
    model, optimizer = accelerator.prepare(model, sgd(model.parameters()))
    synced_steps(ctx, accelerator, model, optimizer, oracle, [1, 2])
