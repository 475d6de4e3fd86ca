"""The case catalogue; installed as the package ``harness.cases`` (``python -m harness run``)."""
