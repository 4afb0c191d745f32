import sys

from minicpmo_cg.export.cli import main

sys.exit(main())
