"""What a run trains on and starts from, made or converted here: verl's RL parquet (the built-in, math and mapped datasets) and the built-in models."""
