"""A MiniCPM-o 4.5 checkpoint built offline, for runs through vLLM's engine without the real weights."""
