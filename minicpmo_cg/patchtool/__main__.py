"""``python -m minicpmo_cg.patchtool``: the same as the ``minicpmo-cg-patch`` console script."""

from minicpmo_cg.patchtool.cli import main

if __name__ == "__main__":
    main()
