"""Every text a person reads in a report or a command's output: the terminal matrix, Markdown, HTML,
the diff, the comparison and the self-check's report, and writing the three reports of a run
(``reports``). A cell's and a failure's own words are ``harness.wording``; all of it goes through the
one escaper in ``harness.text``.

May import: the core modules of ``harness``, ``harness.matrix``, ``harness.render`` and the
self-check's results.
"""
