"""The benchmark (``minicpmo-cg-bench``, ``python -m minicpmo_cg.bench``): MiniCPM-o 4.5's encoder
CUDA graph adapter, eager vs graphed, capture cost, graph memory, the whole image call, two traffic
replays under both admission rules and the duplex session.

One module per scenario (``--only`` selects some). Without CUDA, ``--allow-cpu`` runs every section on
tiny shapes with a CPU stand-in for capture: only the logic is exercised. Targets are reported, not
enforced. Exit status: 0 done, 1 a graphed output differed from eager or a section failed, 2 usage.
"""
