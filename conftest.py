"""Loads the harness plugin for every run from this checkout (cases/ and tests/)."""

pytest_plugins = ["harness.plugin"]
