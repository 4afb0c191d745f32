"""Run this project's CUDA tests, demo and benchmark on an offline GPU host."""
