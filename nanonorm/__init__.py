"""nanoNorm's library: what the commands and model.py import, and no user runs directly."""
