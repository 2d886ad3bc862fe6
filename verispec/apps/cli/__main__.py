"""`python -m verispec.apps.cli`: the `verispec` command without its console script."""

import sys

from verispec.apps.cli import main

sys.exit(main())
