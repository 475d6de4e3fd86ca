"""`python -m harness`: the command line in harness.cli."""

import sys

from harness.cli import main

sys.exit(main())
