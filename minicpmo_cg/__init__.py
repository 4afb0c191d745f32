"""Patch tool, resources and main job for the MiniCPM-o 4.5 encoder CUDA graph patch set."""
