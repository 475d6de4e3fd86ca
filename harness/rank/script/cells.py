"""The cells of ``python -m harness watch SCRIPT`` (docs/script.md): one case, named after the script,
with one variant per precision the command asked for (``as-written``: the script's own), run on every
rank by the harness's pytest plugin like any case. The command passes what to run in the environment
(``WATCH_ENVIRONMENT``, JSON), so that every process of the run, the ranks too, defines the same case."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from harness.decorator import Variant, case
from harness.messages import WATCH_ENVIRONMENT, watched

if TYPE_CHECKING:
    from harness.rank.context import RankContext

# the variant of a cell that keeps the script's own mixed precision
AS_WRITTEN = "as-written"


def configuration() -> dict[str, Any]:
    """What the command asked for: ``path``, ``argv``, ``name``, ``precisions``, ``loss``,
    ``num_steps``, ``contract``."""
    asked = watched()
    if asked is None:
        raise RuntimeError(f"{__name__} holds the cells of `python -m harness watch SCRIPT`, which sets "
                           f"{WATCH_ENVIRONMENT}; run that command rather than collecting this file")
    return asked


def variants(precisions: list[str]) -> tuple[Variant, ...]:
    if not precisions:
        return (Variant(AS_WRITTEN, {}),)
    return tuple(Variant(p, {"precision": p}) for p in precisions)


WATCHED = configuration()


@case(WATCHED["name"], variants=variants(WATCHED["precisions"]), wrappers=["ddp"])
def test_script(ctx: RankContext) -> None:
    """The script run unedited on every rank, its first Accelerator the cell's, every step checked."""
    from harness.rank.script.run import run_script  # here: the run's controller never imports torch

    run_script(ctx, WATCHED["path"], WATCHED["argv"], loss=WATCHED["loss"], num_steps=WATCHED["num_steps"],
               contract=WATCHED["contract"], precision=ctx.variant.get("precision"),
               settings=WATCHED.get("accelerate_settings") or {}, tiny_model=bool(WATCHED.get("tiny_model")))
