"""Every file and folder a run writes in its folder (`runs/<run>/`), each named once, here.

    python -m grpo_pipeline --model tiny --device cpu --run-name r1   # then: ls -a runs/r1

Whoever writes or reads one of them asks `RunFolder` for its name (`run_dir / RunFolder.METRICS`),
so a renamed file cannot leave a reader looking for the old name, and docs/files.md, the report's
file list and planning's check of the folder (`RunFolder.KEPT`) all read one list.
tests/test_house.py keeps each name out of every other module.
"""

from __future__ import annotations

from grpo_pipeline.profiles.trackers.tensorboard_tracker import TensorboardTracker


class RunFolder:
    """The names in a run's folder, relative to it. Files first, then folders and what they hold."""

    # What the run was asked and planned (tasks/stage_tasks.py, flows/pipeline.py).
    PROFILE = "profile.yaml"  # the planned profile, as the run used it
    ENV = "env.json"  # the environment every process gets; secrets shown as ***
    PLAN = "plan.json"  # the backend, the command and the generation plan
    DATASET = "data/dataset.json"  # the training and validation files the run read
    BENCHMARKS = "data/benchmarks.json"  # the evaluation's benchmark files
    MODEL = "model.json"  # the base model's directory, as prepared
    NODES = "nodes.json"  # each cluster node's answer to the preflight (cluster runs)
    # What training writes (backends/, stages/train.py).
    METRICS = "metrics.jsonl"  # one record per training step, whatever the engine
    PHASES = "phases.jsonl"  # the local backend's time per phase of each step
    GUARDS = "guards.json"  # the guard that stopped the run, for the report
    TRAIN = "train.json"  # the train stage's result
    POLICY = "policy.json"  # the exported policy's directory
    BEST = "best"  # a link to the best checkpoint's policy (stages/export.py)
    BEST_RECORD = "best.json"  # which checkpoint is the best, and why
    # What the flow keeps (tasks/, tracking/trackers.py).
    TIMINGS = "timings.json"  # seconds per stage
    TRACKING = "tracking.json"  # the tracker runs' ids and the last step logged
    LOCK = ".run.lock"  # the live run that holds the folder (run/lock.py)
    # The report and its plots (stages/report.py, benchmark_report.py, guard_panel.py).
    REPORT = "report.md"
    REWARD_CURVE = "reward_curve.png"
    EVAL_PLOT = "eval_comparison.png"
    CURVE_PLOT = "checkpoint_curve.png"
    GUARDS_PLOT = "guards.png"
    # Folders, and the files of theirs the run names.
    CHECKPOINTS = "checkpoints"  # the policy at each saved step
    EVAL = "eval"  # the evaluation's per-sample files
    EVAL_REPORT = "eval/eval.json"  # the evaluation's result
    RAY = "ray"  # Ray Train's storage (local backend)
    TENSORBOARD = TensorboardTracker.folder  # TensorBoard's events, unless the profile names another (the class's)
    JOB = "verl"  # the verl job's folder: its record, reward package and metrics per attempt
    JOB_RECORD = "job.json"  # in JOB: the submitted job, for a retry to find

    # What the run keeps in its folder: a folder (True) or a file (False). Something of the other
    # kind there would fail a stage minutes or hours in; planning refuses it (`run_folder_problem`).
    KEPT = {CHECKPOINTS: True, EVAL: True, RAY: True, METRICS: False, REPORT: False, PROFILE: False, ENV: False,
            TRAIN: False, POLICY: False, TIMINGS: False}
