"""The local controller: the options, the pools of rank processes, a cell's run and verdict, the
progress lines. Runs in pytest's process (and every xdist worker) and never imports torch itself.

May import: the core modules of ``harness``, ``harness.wrappers.registry`` and ``harness.matrix``;
``harness.rank.process.main`` only as the target of the processes it starts, and
``harness.rank.process.environment`` (torch-free) for what a rank process is.
"""
