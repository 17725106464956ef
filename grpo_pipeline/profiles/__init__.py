"""Typed run profiles: the pydantic schema, the YAML layers (devices/, models/) and their loader."""
