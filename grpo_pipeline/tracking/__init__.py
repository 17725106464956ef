"""The experiment trackers: one interface over MLflow, W&B and TensorBoard (trackers.py), where they keep a run, and the run's tracker session."""
