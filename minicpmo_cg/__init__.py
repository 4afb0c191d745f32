"""MiniCPM-o 4.5 encoder CUDA graphs: the patch tool, the demo and the benchmark around the patch set."""
