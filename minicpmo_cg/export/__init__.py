"""The upstream pull requests: ``minicpmo-cg-export OUT [--verify]`` (``python -m minicpmo_cg.export``).

:mod:`.stack` names each PR's whole files and whole patches; :mod:`.cli` writes them as
``git format-patch`` series on the pinned releases and checks each PR on its own tree. The PR
texts are hand-written, one per PR, under ``docs/upstream/``.
"""
