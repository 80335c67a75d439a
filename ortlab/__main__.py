"""Run the ortlab command line: ``python -m ortlab demo``."""

from __future__ import annotations

import sys

from ortlab.cli import main

sys.exit(main())
