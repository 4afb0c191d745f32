"""Helpers shared by several test modules (not collected: no ``test_*`` files here)."""
