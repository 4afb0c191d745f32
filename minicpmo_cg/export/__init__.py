"""The upstream pull requests: ``minicpmo-cg-export OUT [--verify]`` (``python -m minicpmo_cg.export``)."""
