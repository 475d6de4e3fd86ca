"""The rank's process, the top of the rank side's layers (tests/test_layout.py): ``main``, a pool's rank
(join the group once, run cells until told to stop); ``cell``, one cell on one rank; ``environment``,
what the process sets before torch and what the controller asks of it (torch-free); ``preload`` and
``preload_all``, what the pools' fork server imports; ``raises``, a library's raise a case declares."""
