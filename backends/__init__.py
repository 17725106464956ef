"""Training engines behind one interface: `verl` (a Ray job on GPUs/NPUs) and `local` (TRL on Ray Train)."""
