"""The self-check: planted sync faults (``planted``, ``faults``, ``faults_*``), patched into accelerate
or torch inside the ranks, and ``python -m harness selfcheck`` (``run``), which runs the catalogue
under each and counts the faults some case catches.

May import: the faults, what the rank side may (they run inside ranks); ``run``, the core,
``harness.controller``, ``harness.matrix``, the faults and ``harness.wrappers`` names and ``prepare``
(the cells each wrapper gets).
"""
