"""What the stages share: the content store, hub snapshots, atomic files, progress bars, the run's Ray
cluster, RL data and rewards, and the models the pipeline builds itself."""
