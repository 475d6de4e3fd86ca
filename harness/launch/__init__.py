"""The launcher path: ``python -m harness launch`` under torchrun, srun or ``accelerate launch``, where
the launcher's processes are the ranks (``main``), what the launcher set (``environment``), the
ranks' shared run (``group``, ``rank``), the channel they talk over (``channel``), and whether a
rank's process on rank 0's own host has ended (``liveness``).

May import: the core modules of ``harness``, ``harness.controller``, ``harness.rank`` and
``harness.plugin`` (the launcher's rank 0 runs pytest with it).
"""
