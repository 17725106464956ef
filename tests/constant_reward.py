"""A reward that scores every response the same, whatever it says: every group's rewards constant, every
advantage zero, nothing learned (the fault the reward_collapse guard stops: tests/e2e/test_local_guards.py)."""


def always_one(response: str, ground_truth: str) -> float:
    return 1.0
