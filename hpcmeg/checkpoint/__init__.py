"""Checkpoint files on disk: the atomic save/load protocol (store.py) and safe loading + RNG state (safe.py)."""
