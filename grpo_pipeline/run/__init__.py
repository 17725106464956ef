"""A run before any work: its folder and the names of everything in it (folder.py)."""
