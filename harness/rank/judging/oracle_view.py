"""The oracle as its checks read it (harness/rank/judging/checks.py): what a check of the rank's state may
ask of ``Oracle`` (harness/rank/oracle/core.py), the checks' own view of it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from harness.rank.oracle.anchoring import Anchoring
    from harness.rank.oracle.averaging import Averaging
    from harness.rank.oracle.state import Notes, OracleState
    from harness.rank.oracle.weighting import TokenWeighting
    from harness.wrappers.cell import CellConfig


class JudgedOracle(Protocol):
    """The oracle as its checks read it (harness/rank/judging/checks.py; ``Oracle``, harness/rank/oracle/core.py):
    the cell it stands for (``config``: harness/wrappers/cell.py), where it notes what it could not
    check (``recorder``), its replicas' parameters and optimizers, what it holds now (``state``: each
    parameter's, harness/rank/oracle/state.py), its token weights (what a diagnosis refits), and its two
    parts: ``averaging``, the sync a gradient check makes or settles, and ``anchoring``, what the rank
    must hold now and the oracle carried on from the rank's real state."""

    config: CellConfig
    recorder: Notes
    params: dict[str, dict[str, torch.Tensor]]
    optimizers: dict[str, tuple[torch.optim.Optimizer, ...]]
    weighting: TokenWeighting
    state: OracleState
    averaging: Averaging
    anchoring: Anchoring
