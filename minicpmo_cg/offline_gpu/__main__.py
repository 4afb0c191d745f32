"""``python -m minicpmo_cg.offline_gpu``: see :mod:`minicpmo_cg.offline_gpu.cli`."""

import sys

from minicpmo_cg.offline_gpu.cli import main

sys.exit(main())
