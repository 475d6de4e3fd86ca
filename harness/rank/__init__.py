"""What runs inside a rank: the cell's context, the oracle and the checks against it, the closeness
rules, the diagnoses, the collectives and their accounting, the models, the schedules and the token
weights, and the runner (``runner.run_cell``) that a pool's or a launcher's rank calls per cell.

May import: the core modules of ``harness`` (records, messages, timeline, text, wording, decorator,
catalogue, versions), ``harness.rank`` and ``harness.wrappers``; ``harness.selfcheck``'s planted
faults only for a cell that names one. Never the controller, the launch path, the reports.
"""
