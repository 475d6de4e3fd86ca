"""What runs inside a rank, in layers, each importing only those below it (tests/test_layout.py), each a
folder of its own but the case's side:

- ``numerics``: the closeness rules, gloo's summation order, the oracle's own collectives, the fused
  check, the backend's probed defects, the recording of the wrapper's reductions, the RNG helpers;
- ``harness.wrappers``: the wrapper a cell trains under;
- ``oracle``: the replicas, the schedules, the token weights, the sharded wrappers' reductions, and
  ``Oracle`` (``oracle.core``): what every rank must hold;
- ``judging``: the checks against the oracle, the diagnoses, the recorder, the judging of the
  wrapper's reductions;
- ``watch``: a loop followed as it is (``ctx.watch``), and what a script's watch shares with it;
- the case's side, directly here: the cell's context, the Trainer, the models and data;
- ``script``: a script run as it is (``python -m harness watch``) and its watch;
- ``process``: the rank's process: a pool's rank (``process.main``), one cell on one rank
  (``process.cell.run_rank_cell``, which a pool's or a launcher's rank calls per cell), what it
  preloads, and the cells of a watched script (``script/cells.py``).

Each also imports the core modules of ``harness``; the rank's process, ``harness.selfcheck``'s planted
faults only for a cell that names one. Never the controller, the launch path, the reports.
"""
