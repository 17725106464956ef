"""A reward that scores every response the same, whatever it says: every group's rewards constant, every
advantage zero, nothing learned (the fault the reward_collapse guard stops: tests/e2e/test_local_guards.py).
Written for verl: `compute_score(data_source, solution_str, ground_truth, extra_info=None)`."""


def always_one(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0
