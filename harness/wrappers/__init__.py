"""The wrapper a cell trains under (DDP, FSDP2, FSDP1, DeepSpeed ZeRO), on the rank side: the names
(``names``, which import nothing), how accelerate is asked for each and the prepared model verified
(``prepare``), how a sharded model is read whole (``sharding``, ``deepspeed_cpu``), and what the
installed accelerate and torch can do (``probe``, ``capabilities``).

May import: the core modules of ``harness``, ``harness.wrappers`` and ``harness.rank``.
"""
