"""The reward files of the tests, as teams write them for verl and for TRL (used unchanged on both backends)."""

VERL_STYLE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's custom reward: a dict with `score` and extras."""
    digits = sum(c.isdigit() for c in solution_str) / max(1, len(solution_str))
    return {"score": digits, "acc": float(ground_truth in solution_str), "length": float(len(solution_str))}
'''

TRL_STYLE = '''
import asyncio


async def digit_share(prompts, completions, ground_truth, **kwargs):
    """TRL's reward_funcs: async, a list of floats, a dataset column by name."""
    await asyncio.sleep(0)
    return [sum(c.isdigit() for c in completion[0]["content"]) / max(1, len(completion[0]["content"]))
            for completion in completions]
'''

RAISES_ON_ONE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] == 1:
        raise ValueError("cannot parse this one")
    return 1.0
'''


def write(folder, name: str, text: str) -> str:
    path = folder / name
    path.write_text(text)
    return str(path)
