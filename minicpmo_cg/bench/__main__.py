"""``python -m minicpmo_cg.bench``: see :mod:`minicpmo_cg.bench`."""

import sys

from minicpmo_cg.bench.cli import main

sys.exit(main())
