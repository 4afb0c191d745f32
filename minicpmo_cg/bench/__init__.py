"""The benchmark (``minicpmo-cg-bench``, ``python -m minicpmo_cg.bench``): MiniCPM-o 4.5's encoder
CUDA graph adapter, eager vs graphed, capture cost, graph memory, the whole image call, two traffic
replays under both admission rules and the duplex session.
"""
