"""A run before any work: its request (request.py, checked by form_rules.py), the names of everything
in its folder (folder.py) and the folder's lock (lock.py)."""
