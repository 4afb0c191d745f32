"""``python -m minicpmo_cg.checkpoint``: the same as ``minicpmo-cg-checkpoint``."""

import sys

from minicpmo_cg.checkpoint.cli import main

sys.exit(main())
