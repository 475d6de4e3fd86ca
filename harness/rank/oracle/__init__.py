"""What every rank must hold: the replicas, the schedules, the token weights, the sharded wrappers'
reductions, and ``Oracle`` (``core``). Imports ``harness.rank.numerics``, ``harness.wrappers`` and the
core of ``harness``; the checks it answers to are attached from above (``harness.rank.judging``)."""
