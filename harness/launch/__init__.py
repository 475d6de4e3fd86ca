"""The launcher path: ``python -m harness launch`` under torchrun, srun or ``accelerate launch``, where
the launcher's processes are the ranks (``main``), what the launcher set (``environment``), the
ranks' shared run (``group``, ``rank``) and the channel they talk over (``channel``).

May import anything but ``harness.cli`` and ``harness.selfcheck``.
"""
