"""The rank side's bottom layer: the closeness rules, gloo's summation order, the oracle's own
collectives, the fused check, the backend's probed defects, the recording of the wrapper's
reductions. Imports only the core of ``harness``."""
