"""How a rank's state is judged against the oracle: the checks, the diagnoses, the recorder, and the
judging of the wrapper's reductions. Imports the layers below (``harness.rank.oracle``,
``harness.wrappers``, ``harness.rank.numerics``) and the core of ``harness``."""
