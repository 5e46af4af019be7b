"""``python -m resident_pg.bench``: the latency ladder's command line (cli.py)."""

import sys

from .cli import main

sys.exit(main())
