"""What scores completions: the built-in rewards, the ones users bring (verl- or TRL-style, a reward server), how they combine, and the checks they pass before a run starts."""
