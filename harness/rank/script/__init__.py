"""A training script checked as it is (``python -m harness watch``, docs/script.md): ``run`` runs it on
a rank and adopts its first Accelerator, ``watch`` follows that Accelerator's calls, ``plugins`` reads
the script's FSDP or DeepSpeed plugin into the cell's, ``tiny_model`` shrinks its pretrained models, and
``cells`` is the case file the command's pytest session collects."""
