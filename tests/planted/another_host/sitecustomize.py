"""Planted into a launch's processes (first on PYTHONPATH): rank 1 says it runs on another host, as
on a second node. Every rank of tests/test_launch.py runs on this machine, where rank 0 sees a dead
rank's process end at once (harness/launch/liveness.py); on another host it is found by its
silence, which this lets a test reach. Nothing else of the rank changes."""

import os

if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RUN_ID"):
    from harness.launch import liveness

    _own = liveness.identity

    def _elsewhere():
        own = _own()
        return own and {**own, "boot": "another host's boot id"}

    liveness.identity = _elsewhere
