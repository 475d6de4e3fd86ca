"""The rank side of a pool: join the process group once, then run cells until told to stop."""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import gc
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, ContextManager

from harness.messages import (
    CellSpec,
    RankResult,
    Ready,
    RunCell,
    Shutdown,
    StartupFailed,
    expect,
)
from harness.records import RankOutcome

# Signal that makes a rank dump every thread's stack (faulthandler) into its stack file.
DUMP_SIGNAL = signal.SIGUSR1
_PR_SET_PDEATHSIG = 1


def _die_with_parent(controller_pid: int) -> None:
    """A rank must never outlive the process that owns its pool, however that process ends.

    A spawned rank's parent is that process, and the kernel kills the rank when it goes (a
    parent-death signal). A forked rank's parent is the pools' fork server, which exits when the
    controller does, if no rank holds the end of the pipe it watches for that: the rank lets go of
    it (multiprocessing hands each forked child that end, for starting children of its own), and
    also polls for the controller, so that the rank goes even where the server would stay."""
    parent_pid = os.getppid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        armed = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) == 0
    except (OSError, AttributeError):
        armed = False
    if os.getppid() != parent_pid or not process_alive(controller_pid):
        os._exit(70)  # the parent, or the controller, went before the signal was armed
    if parent_pid != controller_pid:
        _release_fork_server()
    elif armed:
        return

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid or not process_alive(controller_pid):
                os._exit(70)

    threading.Thread(target=watch, name="harness-parent-watch", daemon=True).start()


def _release_fork_server() -> None:
    """Close this forked rank's copy of the pipe whose end tells the fork server that its
    controller is gone: while a rank held it, the server (and so the rank) would outlive the run."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None


def process_alive(pid: int) -> bool:
    """Whether the process is there and not a zombie. A controller killed outright stays a zombie
    until whoever started it reaps it, who may first wait for the end of the run's output, which
    the run's resource tracker holds for as long as a rank holds the tracker's pipe."""
    try:
        os.kill(pid, 0)  # PermissionError: it is there, as another user's
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


# accelerate reads its launcher's settings from ACCELERATE_* variables (`accelerate launch` sets
# mixed precision, accumulation steps, FSDP, DeepSpeed, dynamo, debug mode): a cell's setup is its
# variant's alone, so ranks drop them all but these.
KEPT_ACCELERATE_VARIABLES = ("ACCELERATE_DISABLE_RICH", "ACCELERATE_LOG_LEVEL")


def launcher_settings() -> list[str]:
    """The names of the ACCELERATE_* settings a launcher or the user's shell left, which ranks drop."""
    return sorted(n for n in os.environ if n.startswith("ACCELERATE_") and n not in KEPT_ACCELERATE_VARIABLES)


def drop_launcher_settings() -> list[str]:
    """Remove the ACCELERATE_* settings a launcher or the user's shell left; return their names."""
    dropped = launcher_settings()
    for name in dropped:
        del os.environ[name]
    os.environ.setdefault("ACCELERATE_DISABLE_RICH", "1")
    return dropped


def limit_threads() -> None:
    """One thread a rank on CPU: ranks share the machine's cores with each other and with other pools
    (and the same thread count everywhere keeps the arithmetic, and so the differences, alike)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"


# glibc's mallopt parameters, and how large an allocation the rank's heap keeps (see below)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
HEAP_KEEPS_BYTES = 32 << 20
HEAP_TRIMS_BYTES = 1 << 30
# torch's switch for transparent huge pages under its CPU tensors of 2 MiB and more (c10's alloc_cpu),
# read once, at a process's first tensor
TORCH_HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"


def keep_large_allocations() -> None:
    """Let the rank's heap keep allocations of up to 32 MiB instead of mapping fresh pages for each,
    and map the larger ones on huge pages.

    glibc serves an allocation above its mmap threshold (at most 32 MiB by default) with pages
    straight from the kernel, zeroed, and unmaps them on free; and it gives the top of the heap back
    beyond its trim threshold. A check of a model of 1e7 parameters makes tensors of 40 MB, which
    paid their page faults again at each (a loop of 80 MB temporaries here: 500 -> 105 ms an iteration
    with them kept in the heap). But a heap that kept the 400 MB tensors of a model of 1e8 parameters
    (the threshold at 1 GiB, as it was) fragmented: a rank held 12 GB after a few cells of that size
    and faulted in gigabytes a cell all the same. So the mmap threshold is pinned at 32 MiB (glibc
    would move it with the blocks freed), the heap's top is given back beyond 1 GiB, and the larger
    tensors are mapped on huge pages (torch's THP_MEM_ALLOC_ENABLE, set here before any tensor where
    this runs first): what a rank holds follows what it uses, and a fresh 400 MB costs 200 faults, not
    100,000 (bench/README.md, "Against model size"). Elsewhere than glibc the thresholds are not set."""
    os.environ.setdefault(TORCH_HUGE_PAGES, "1")
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, HEAP_KEEPS_BYTES)
        libc.mallopt(_M_TRIM_THRESHOLD, HEAP_TRIMS_BYTES)
    except (OSError, AttributeError):
        pass


def record_collectives() -> None:
    """Have torch's flight recorder keep each collective this rank issues (before its process group
    is made), for the collective accounting (harness/rank/numerics/accounting.py)."""
    from harness.rank.numerics.accounting import enable

    enable()


def _set_environment(rank: int, world_size: int, backend: str) -> None:
    # accelerate reads these to learn that it runs distributed; the process group itself is
    # created here, through a FileStore, so no port is ever opened. World size 1 is a plain
    # single process (``python train.py``): accelerate sees no launcher and wraps nothing in DDP.
    # A local pool runs on one host: its local rank is its rank (and its GPU is that one).
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    if world_size > 1:
        os.environ["RANK"] = str(rank)
        os.environ["WORLD_SIZE"] = str(world_size)
        os.environ["LOCAL_RANK"] = str(rank)
        os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    limit_threads()
    keep_large_allocations()
    drop_launcher_settings()
    record_collectives()
    if backend == "nccl":
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")


def rank_device(backend: str) -> Any:
    """The device of this rank: with nccl, the GPU of its LOCAL_RANK (never its global rank: on the
    second node of a launch, global rank 8 is local rank 0), made current; else the CPU."""
    import torch

    if backend != "nccl":
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def collectives_issued() -> int | None:
    """How many collectives this rank's default process group has issued (torch's per-group sequence
    number; DDP's own all-reduces count): the progress that says who the others wait for
    (harness/controller/blame.py). None when there is no group or the backend cannot say."""
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return None
        return int(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group())
    except Exception:
        return None


def _answer_progress(conn: Any) -> None:
    """A thread that tells the pool's controller this rank's progress whenever asked: it answers
    while the main thread is stuck in a case or a collective."""
    while True:
        try:
            conn.recv()
            conn.send(collectives_issued())
        except (EOFError, OSError):
            return


def _declared_raise(info: Any, spec: CellSpec, ctx: Any, exc: Exception) -> Any:
    """The ``raised`` failure when the cell declares this exception (harness/rank/raises.py), else None."""
    from harness.decorator import Variant
    from harness.rank.raises import declared_raise

    declared = info.detects_for(Variant(spec.variant, dict(spec.variant_params)))
    return declared_raise(declared, exc, rank=ctx.rank, step=ctx.at_step)


def _forget_deepspeed_config() -> None:
    """transformers' process-wide DeepSpeed config (a weak reference that accelerate's DeepSpeed
    plugin and ``TrainingArguments(deepspeed=...)`` set, alive while anything holds the config) goes
    with the cell: under ZeRO-3 it makes every later ``from_config`` build its model inside
    ``deepspeed.zero.Init``, a sequence-classification head's base model included."""
    deepspeed = sys.modules.get("transformers.integrations.deepspeed")
    if deepspeed is not None and hasattr(deepspeed, "unset_hf_deepspeed_config"):
        deepspeed.unset_hf_deepspeed_config()


def run_cell(spec: CellSpec, rank: int, device: Any) -> RankResult:
    import torch

    from harness.catalogue import find_case, locate
    from harness.decorator import SkipCell, Unsupported
    from harness.rank.context import RankContext
    from harness.rank.models import seed_rng
    from harness.wrappers.prepare import refusal
    from harness.wrappers.probe import reset_accelerate

    started = time.perf_counter()
    ctx = None
    environment = dict(os.environ)
    # DeepSpeed's ZeRO-3 engine replaces torch.nn.functional.linear for the whole process ("This will
    # persist unless manually reset"): put torch's own back after the cell, as the environment
    linear = torch.nn.functional.linear
    try:
        reset_accelerate()
        info = find_case(locate(spec.case_anchor, spec.case_relpath, spec.case_file), spec.case_attr)
        body = info.body
        ctx = RankContext(
            case=spec.case, variant=spec.variant, params=spec.variant_params, rank=rank,
            world_size=spec.world_size, seed=spec.seed, device=device,
        )
        seed_rng(ctx.seed + rank, device)
        graphs = _compiled_graphs()
        with _planted_fault(spec.fault, rank):
            body(ctx)
            ctx.finish()
        if ctx.compile is not None and _compiled_graphs() == graphs:
            raise AssertionError(f"the cell's variant compiles with {ctx.compile}, but torch.compile compiled no graph "
                                 "on this rank (dynamo compiles no frame of torch.nn's own modules, a bare "
                                 "nn.Sequential, say): the cell would check eager code under a compiled name")
        outcome, detail = RankOutcome.OK, ""
    except Unsupported as exc:
        outcome, detail = RankOutcome.UNSUPPORTED, str(exc)
    except SkipCell as exc:
        outcome, detail = RankOutcome.SKIPPED, str(exc)
    except Exception as exc:
        refused = refusal(ctx.wrapper, exc) if ctx is not None else None
        declared = _declared_raise(info, spec, ctx, exc) if ctx is not None and refused is None else None
        if refused is not None:
            outcome, detail = RankOutcome.UNSUPPORTED, str(refused)
        elif declared is not None:  # the library raised as the case declares: a failure, judged as declared
            ctx.recorder.add(declared)
            outcome, detail = RankOutcome.OK, ""
        else:
            outcome, detail = RankOutcome.RAISED, traceback.format_exc()
    finally:
        _restore_environment(environment)
        torch.nn.functional.linear = linear
        _forget_deepspeed_config()
        try:
            reset_accelerate()
            if ctx is not None and ctx.compile is not None:
                torch._dynamo.reset()  # the next cell compiles its own models afresh
        except Exception:
            pass
        _freeze_imports()
    recorder = ctx.recorder if ctx is not None else None
    return RankResult(
        rank=rank,
        outcome=outcome,
        cell_id=spec.cell_id,
        detail=detail,
        failures=list(recorder.failures) if recorder else [],
        omitted_failures=recorder.omitted if recorder else 0,
        checks=recorder.checks if recorder else 0,
        grad_checks=recorder.grad_checks if recorder else 0,
        vacuous_checks=recorder.vacuous_checks if recorder else 0,
        comm_checks=recorder.comm_checks if recorder else 0,
        max_abs_diff=recorder.max_abs_diff if recorder else 0.0,
        timeline=recorder.timeline if recorder else None,
        unchecked=dict(recorder.unchecked) if recorder else {},
        forced=dict(recorder.forced) if recorder else {},
        said=dict(recorder.said) if recorder else {},
        wrapper=recorder.wrapper if recorder else "",
        defects=sorted(recorder.defects) if recorder else [],
        duration_s=time.perf_counter() - started,
    )


def _compiled_graphs() -> int:
    """The graphs torch.compile has handed to AOT autograd in this process so far (aot_eager and
    inductor both go through it)."""
    from torch._dynamo.utils import counters

    return counters["aot_autograd"]["total"]


def _restore_environment(saved: dict[str, str]) -> None:
    """Put the process environment back as it was before the cell: what a cell's libraries set
    for the process (accelerate's ACCELERATE_USE_DEEPSPEED/_FSDP when given a plugin, LOCAL_RANK for
    a DeepSpeed cell of one process) must not reach the next cell of the pool."""
    for name in [n for n in os.environ if n not in saved]:
        del os.environ[name]
    for name, value in saved.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


def _planted_fault(name: str | None, rank: int) -> ContextManager[None]:
    """The self-check's planted fault, patched in for the cell; fault injection is imported only
    for a cell that has one, never on the path of a real run."""
    if name is None:
        return contextlib.nullcontext()
    from harness.selfcheck.faults import apply_fault

    return apply_fault(name, rank=rank)


def _warm_up(device: Any) -> None:
    """Pay the one-time costs at start-up, not in the first cell: importing accelerate, torch's
    lazy import of torch._dynamo on the first optimizer (seconds), and a first collective."""
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator  # noqa: F401

    torch.optim.SGD([torch.zeros(1, device=device, requires_grad=True)], lr=0.1)
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe)
    if int(probe.item()) != dist.get_world_size():
        raise RuntimeError(f"all_reduce of ones gave {probe.item()}, expected the world size {dist.get_world_size()}")
    from harness.rank.numerics import accounting, backend_defects

    accounting.probe(str(dist.get_backend()))  # does the flight recorder hold that all-reduce?
    backend_defects.probe()  # does gloo's AVG reduce-scatter sum? (harness/decorator.py)
    _freeze_imports()


# The modules imported when the garbage collector last froze what was alive (``_freeze_imports``).
_frozen_at_modules = 0


def _freeze_imports() -> None:
    """Keep the garbage collector off what torch, accelerate (and later DeepSpeed, transformers)
    leave alive for the life of the process: about 300,000 objects, which every full collection
    walks (0.2 to 0.5 s here; DeepSpeed's ZeRO-3 asks for one each time it builds an engine, and
    Python's own come every so often). ``gc.freeze`` moves them out of its reach; everything made
    later is collected as before. At start-up there is little garbage to freeze with them; after a
    cell that imported more, the cell's garbage is collected first, so that nothing of it is kept."""
    global _frozen_at_modules
    if _frozen_at_modules and len(sys.modules) < _frozen_at_modules + 50:
        return
    if _frozen_at_modules:
        gc.collect()
    gc.freeze()
    _frozen_at_modules = len(sys.modules)


def main(rank: int, world_size: int, backend: str, store_path: str, log_path: str, stack_path: str,
         conn: Any, watch_conn: Any, controller_pid: int, pg_timeout_s: float, environ: dict[str, str]) -> None:
    """Entry point of a rank process (the target of a forked or spawned process). ``environ`` is
    the controller's environment when the pool started: a forked rank would otherwise keep its fork
    server's, from the server's start."""
    _die_with_parent(controller_pid)
    os.environ.clear()
    os.environ.update(environ)
    log = open(log_path, "a", buffering=1, encoding="utf-8")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    stacks = open(stack_path, "a", encoding="utf-8")  # O_APPEND: the controller truncates it before each dump
    faulthandler.enable(file=stacks, all_threads=True)
    faulthandler.register(DUMP_SIGNAL, file=stacks, all_threads=True, chain=False)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the controller's to handle
    _set_environment(rank, world_size, backend)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        device = rank_device(backend)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s)
        )
        _warm_up(device)
    except BaseException:
        conn.send(StartupFailed(rank=rank, traceback=traceback.format_exc()))
        raise SystemExit(3)
    threading.Thread(target=_answer_progress, args=(watch_conn,), name="harness-progress", daemon=True).start()
    conn.send(Ready(rank=rank, pid=os.getpid()))
    while True:
        try:
            message = expect(conn.recv(), RunCell, Shutdown)
        except EOFError:
            break
        if isinstance(message, Shutdown):
            break
        conn.send(run_cell(message.spec, rank, device))
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    conn.close()
