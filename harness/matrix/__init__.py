"""The report data: the matrix and its cells (``schema``), reading and writing ``matrix.json``
(``file``, ``strictjson``), and what two or more matrices say together (``diff``, ``comparison``,
``merge``). Pure data: no torch, no processes, no text for people (that is ``harness.render``).

May import: the core modules of ``harness`` and ``harness.matrix``.
"""
