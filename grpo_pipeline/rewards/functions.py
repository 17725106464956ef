"""A reward function a team brings, written for verl or for TRL, loaded from its file and called on a
batch as its own trainer would call it.

    python -m grpo_pipeline --model tiny --device cpu --set 'reward.functions=[/path/reward.py:compute_score]'

- verl style: `compute_score(data_source, solution_str, ground_truth, extra_info=None)`, one sample a call
  (as verl's NaiveRewardManager calls it, `experimental/reward_loop/reward_manager/naive.py`), sync or
  async; a number, or a dict with `score` and extras (verl logs the extras; here they are logged per step
  and reach the trackers).
- TRL style: `f(prompts, completions, **columns) -> list[float | None]`, one call a batch (as TRL's
  GRPOTrainer calls `reward_funcs`), sync or async; `prompts` and `completions` are chat messages, the
  columns are the dataset's (`data_source`, `ground_truth`, `extra_info`, ... and each field of
  `extra_info`), plus TRL's own `trainer_state`, `log_extra` and `log_metric`.

The style is read from the signature, never guessed from a call.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import inspect
import math
import numbers
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

from grpo_pipeline.errors import UserError

Style = Literal["verl", "trl"]
VERL_PARAMETERS = ("data_source", "solution_str", "ground_truth")
TRL_PARAMETERS = ("prompts", "completions")
# What TRL's GRPOTrainer passes every reward function beside the dataset's columns (trl 1.16 _calculate_rewards).
TRL_SUPPLIED = ("completion_ids", "trainer_state", "log_extra", "log_metric", "environments")
ACCEPTED = ("verl's compute_score(data_source, solution_str, ground_truth, extra_info=None) or TRL's "
            "f(prompts, completions, **columns)")


class RewardError(UserError):
    """A reward function that cannot be used, or that failed on a sample (its row named)."""


class NonFiniteReward(RewardError):
    """A reward that returned NaN or an infinity for a sample (its row named): in training, the non_finite
    guard's to stop (backends/local/rewards.py), as it stops a NaN loss."""


@dataclass
class Batch:
    """Completions to score, with the dataset columns of each one's row."""

    prompts: list[list[dict]]
    completions: list[str]
    columns: dict[str, list[Any]]
    rows: list[str] = field(default_factory=list)  # how an error names each sample's row

    def __len__(self) -> int:
        return len(self.completions)

    def row(self, index: int) -> str:
        return self.rows[index] if index < len(self.rows) else f"sample {index}"


@dataclass
class Scored:
    """One reward's values on a batch (None: no reward for that sample), and the numeric extras it gave."""

    values: list[float | None]
    extras: dict[str, list[float | None]] = field(default_factory=dict)


def split_spec(spec: str) -> tuple[Path, str]:
    path, _, name = spec.rpartition(":")
    if not path or not name.isidentifier():
        raise RewardError(f"reward function {spec!r}: expected /path/to/file.py:function")
    return Path(path).expanduser(), name


@cache
def load_function(spec: str) -> Callable:
    """The function `spec` names, its file imported once per process (as verl's load_extern_object does)."""
    path, name = split_spec(spec)
    if not path.is_file():
        raise RewardError(f"reward function {spec!r}: {path} is not a file; give a Python file every node can read")
    module_name = f"grpo_reward_{path.stem}_{hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # pickling and dataclasses inside it resolve the module by name
    try:
        module_spec.loader.exec_module(module)
    except BaseException as exc:
        sys.modules.pop(module_name, None)
        raise RewardError(f"reward function {spec!r}: importing {path} failed: {type(exc).__name__}: {exc}") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise RewardError(f"reward function {spec!r}: {path} defines no function {name!r}")
    return function


def style_of(function: Callable, spec: str) -> Style:
    """verl's or TRL's, from the parameters; anything else is refused, naming both accepted forms."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        raise RewardError(f"reward function {spec!r}: its signature cannot be read; write {ACCEPTED}") from None
    names = list(parameters)
    if names[: len(VERL_PARAMETERS)] == list(VERL_PARAMETERS) or set(VERL_PARAMETERS) <= set(names):
        return "verl"
    if names[: len(TRL_PARAMETERS)] == list(TRL_PARAMETERS) or set(TRL_PARAMETERS) <= set(names):
        return "trl"
    raise RewardError(f"reward function {spec!r} takes ({', '.join(names)}); write {ACCEPTED}")


def asked_columns(function: Callable) -> list[str]:
    """The dataset columns a TRL-style function names (TRL passes every column; these must exist)."""
    parameters = inspect.signature(function).parameters.values()
    return [p.name for p in parameters if p.name not in (*TRL_PARAMETERS, *TRL_SUPPLIED)
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty]


def number(value: Any) -> float | None:
    """A reward value as a float; None stays None (no reward for the sample); anything else is refused."""
    if value is None:
        return None
    if isinstance(value, numbers.Real):  # bools too: True is 1.0, as verl would sum it
        result = float(value)
        if math.isfinite(result):
            return result
    if hasattr(value, "item") and getattr(value, "size", 1) == 1:  # numpy / torch scalars
        return number(value.item())
    raise TypeError(f"{value!r} is not a finite number")


def non_finite(value: Any) -> bool:
    """A number that is NaN or infinite (a numpy or torch scalar too)."""
    if hasattr(value, "item") and getattr(value, "size", 1) == 1:
        value = value.item()
    return isinstance(value, numbers.Real) and not math.isfinite(float(value))


def run_async(awaitable):
    """An async reward's result from synchronous code (TRL runs its async rewards on a loop of its own)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(awaitable)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:  # called from inside a running loop: give it a loop of its own
        return pool.submit(asyncio.run, awaitable).result()


class UserReward:
    """One reward function of the profile, callable on a `Batch` in its own style."""

    def __init__(self, spec: str, name: str | None = None):
        self.spec = spec
        self.function = load_function(spec)
        self.style = style_of(self.function, spec)
        self.name = name or self.function.__name__
        self.is_async = inspect.iscoroutinefunction(self.function)

    def __call__(self, batch: Batch, log_metric: Callable[[str, float], None] | None = None) -> Scored:
        if self.style == "verl":
            return self._verl(batch)
        return self._trl(batch, log_metric)

    def _verl(self, batch: Batch) -> Scored:
        def arguments(i: int) -> dict:
            return dict(data_source=batch.columns["data_source"][i], solution_str=batch.completions[i],
                        ground_truth=batch.columns["ground_truth"][i], extra_info=dict(batch.columns["extra_info"][i] or {}))

        if self.is_async:
            async def all_samples():
                return await asyncio.gather(*(self._guarded(i, batch, self.function(**arguments(i)))
                                              for i in range(len(batch))))
            results = run_async(all_samples())
        else:
            results = [self._call_one(i, batch, arguments(i)) for i in range(len(batch))]
        scored = Scored(values=[])
        for i, result in enumerate(results):
            if isinstance(result, dict):
                if "score" not in result:
                    raise RewardError(f"reward {self.name} returned a dict without 'score' for {batch.row(i)}: "
                                      "a verl reward's dict holds `score` and any extras")
                value, extras = result["score"], {k: v for k, v in result.items() if k != "score"}
            else:
                value, extras = result, {}
            scored.values.append(self._number(value, i, batch))
            for key, extra in extras.items():
                try:
                    extra = number(extra)
                except TypeError:
                    continue  # verl keeps non-numeric extras for its dumps; only numbers are logged
                scored.extras.setdefault(key, [None] * len(batch))[i] = extra
        return scored

    def _call_one(self, i: int, batch: Batch, arguments: dict):
        try:
            return self.function(**arguments)
        except Exception as exc:
            raise self._raised(i, batch, exc) from None

    async def _guarded(self, i: int, batch: Batch, awaitable):
        try:
            return await awaitable
        except Exception as exc:
            raise self._raised(i, batch, exc) from None

    def _raised(self, i: int, batch: Batch, exc: Exception) -> RewardError:
        text = str(exc).splitlines()[0][:300] if str(exc) else ""
        return RewardError(f"reward {self.name} ({self.spec}) raised on {batch.row(i)}{self._where(exc)}: "
                           f"{type(exc).__name__}: {text}")

    def _where(self, exc: Exception) -> str:
        """` at <file>:<line>`: the last line of the user's own file the exception passed through (the line to
        fix), where the traceback itself is not shown."""
        import traceback

        own = Path(self.spec.rpartition(":")[0]).expanduser().resolve()
        lines = [frame for frame in traceback.extract_tb(exc.__traceback__) if Path(frame.filename).resolve() == own]
        return f" at {own.name}:{lines[-1].lineno}" if lines else ""

    def _trl(self, batch: Batch, log_metric) -> Scored:
        completions = [[{"role": "assistant", "content": text}] for text in batch.completions]
        kwargs = {**batch.columns, "trainer_state": None, "log_extra": lambda *a, **k: None,
                  "log_metric": log_metric or (lambda name, value: None)}
        try:
            result = self.function(prompts=batch.prompts, completions=completions, **kwargs)
            if inspect.isawaitable(result):
                result = run_async(result)
        except Exception as exc:
            raise RewardError(f"reward {self.name} ({self.spec}) raised on the batch of {batch.row(0)}..."
                              f"{batch.row(len(batch) - 1)}{self._where(exc)}: {type(exc).__name__}: "
                              f"{str(exc)[:300]}") from None
        if not isinstance(result, (list, tuple)) or len(result) != len(batch):
            got = f"{len(result)} values" if isinstance(result, (list, tuple)) else type(result).__name__
            raise RewardError(f"reward {self.name} returned {got} for {len(batch)} completions; a TRL reward returns "
                              "one float (or None) per completion")
        return Scored(values=[self._number(value, i, batch) for i, value in enumerate(result)])

    def _number(self, value: Any, i: int, batch: Batch) -> float | None:
        try:
            return number(value)
        except TypeError as exc:
            kind = NonFiniteReward if non_finite(value) else RewardError
            raise kind(f"reward {self.name} returned {exc} for {batch.row(i)}; a reward is a number "
                       "(or None for no reward)") from None
