"""Faults injected into the local backend's Ray Train workers, through the real training path, for the
guards' tests (tests/e2e/test_local_guards.py): Ray's `worker_process_setup_hook` runs `install` first in
every worker process of the run, and each fault is switched on by a variable of the run's environment. A
fault changes its module (TRL's GRPOTrainer, the data order, the native decoder) as the process imports it.

    join(address, FAULT_NAN_LOSS_FROM_STEP=3)   # then train_local(settings, None, None), which runs on it
    python tests/worker_faults.py ADDRESS FAULT_NAN_LOSS_FROM_STEP=3 -- --model tiny --device cpu   # the command line

A run joins a Ray already started (the tests' one local Ray, `ray.cluster_utils.Cluster`) as a job of its own:
Ray gives the job's runtime_env, and so its faults, to that job's workers only.

- FAULT_NAN_LOSS_FROM_STEP=N: the GRPO loss of step N and later is multiplied by NaN (the backward pass,
  the gradient norm and the optimizer step see it as a diverged update would make them);
- FAULT_STALE_ROLLOUT_WEIGHTS=1: the native decoder copies the trainer's q/k/v and gate/up weights once,
  at its first rollout, and never again (a weight sync that leaves the rollout engine on old weights);
- FAULT_CRASH_AT_STEP=N: the worker raises ("injected crash") when step N starts;
- FAULT_TRL_SAMPLER=1: TRL's own sampler orders the data (each epoch drawn from one generator, which a
  resumed run starts afresh), not backends/local/data_order.py's;
- OBSERVE_BATCHES=<file>: each training round's prompts, with the step they are for, appended as JSON lines.
"""

from __future__ import annotations

import importlib.abc
import json
import os
import sys
import time
from collections.abc import Callable
from functools import partial

# How long a run waits for the jobs before it to let go of the Ray's CPUs (their workers end with their
# driver, within seconds): a bound on a leftover, never a timing.
CPUS_FREED_WITHIN_S = 300

# Where what the faults change is defined: each is changed as its module is imported.
GRPO_TRAINER = "trl.trainer.grpo_trainer"
DATA_ORDER = "grpo_pipeline.backends.local.data_order"
DECODING = "grpo_pipeline.generation.decoding"


def install() -> None:
    if step := os.environ.get("FAULT_NAN_LOSS_FROM_STEP"):
        _once_imported(GRPO_TRAINER, partial(_nan_loss_from, step=int(step)))
    if step := os.environ.get("FAULT_CRASH_AT_STEP"):
        _once_imported(GRPO_TRAINER, partial(_crash_at, step=int(step)))
    if os.environ.get("FAULT_TRL_SAMPLER"):
        _once_imported(DATA_ORDER, _trl_sampler)
    if os.environ.get("FAULT_STALE_ROLLOUT_WEIGHTS"):
        _once_imported(DECODING, _stale_rollout_weights)
    if path := os.environ.get("OBSERVE_BATCHES"):
        _once_imported(GRPO_TRAINER, partial(_observe_batches, path=path))


# The changes still to make in this process, by the module they wait for.
_PENDING: dict[str, list[Callable]] = {}


def _once_imported(name: str, change: Callable) -> None:
    """`change(module)` as soon as module `name` has run in this process (at once if it has). The hook runs
    in every worker process of the job, Ray Train's controller and helper actors too, and only the
    training worker imports TRL: importing it here for all of them cost each one ~9 s of CPU, the
    controller's on the way to starting the workers."""
    if name in sys.modules:
        change(sys.modules[name])
        return
    if not _PENDING:
        sys.meta_path.insert(0, _ChangeOnImport())
    _PENDING.setdefault(name, []).append(change)


class _ChangeOnImport(importlib.abc.MetaPathFinder):
    """Finds no module itself: the loader the other finders find for a module a change waits for makes the
    changes right after the module has run, before whoever imports it gets it."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _PENDING:
            return None
        found = (finder.find_spec(fullname, path, target) for finder in sys.meta_path
                 if finder is not self and hasattr(finder, "find_spec"))
        spec = next((spec for spec in found if spec is not None), None)
        if spec is not None:
            spec.loader.exec_module = _then(spec.loader.exec_module, _PENDING.pop(fullname))
        return spec


def _then(run: Callable, changes: list[Callable]) -> Callable:
    def run_and_change(module) -> None:
        run(module)
        for change in changes:
            change(module)

    return run_and_change


def faults(**variables) -> dict:
    """The Ray runtime_env that installs these faults in every worker process (this module travels by
    value: the workers do not have the tests folder on their path)."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return {"worker_process_setup_hook": install, "env_vars": {name: str(value) for name, value in variables.items()}}


def join(address: str, **variables) -> None:
    """Join the Ray at `address` with these faults, once every CPU of it is free: a worker of the run before
    (its driver gone) still holding one would leave this run's workers waiting on Ray's queue."""
    import ray

    ray.init(address=address, runtime_env=faults(**variables), log_to_driver=False)
    deadline = time.monotonic() + CPUS_FREED_WITHIN_S
    while (free := ray.available_resources().get("CPU", 0)) < (cpus := ray.cluster_resources().get("CPU", 0)):
        if time.monotonic() > deadline:
            ray.shutdown()
            raise RuntimeError(f"the Ray at {address} still has {cpus - free:g} of its {cpus:g} CPUs taken after "
                               f"{CPUS_FREED_WITHIN_S} s: a run before this one left workers behind")
        time.sleep(0.2)


def _nan_loss_from(module, step: int) -> None:
    GRPOTrainer = module.GRPOTrainer
    compute_loss = GRPOTrainer.compute_loss

    def poisoned(self, model, inputs, *args, **kwargs):
        loss = compute_loss(self, model, inputs, *args, **kwargs)
        return loss * float("nan") if self.state.global_step + 1 >= step else loss

    GRPOTrainer.compute_loss = poisoned


def _crash_at(module, step: int) -> None:
    GRPOTrainer = module.GRPOTrainer
    training_step = GRPOTrainer.training_step

    def crashing(self, *args, **kwargs):
        if self.state.global_step + 1 == step:
            raise RuntimeError(f"injected crash at step {step}")
        return training_step(self, *args, **kwargs)

    GRPOTrainer.training_step = crashing


def _trl_sampler(module) -> None:
    module.epoch_seeded = lambda drawn: drawn  # TRL's sampler as drawn


def _stale_rollout_weights(module) -> None:
    NativeDecoder = module.NativeDecoder
    refresh = NativeDecoder._refresh_weights

    def once(self):
        if not getattr(self, "_synced_once", False):
            refresh(self)
            self._synced_once = True

    NativeDecoder._refresh_weights = once


def _observe_batches(module, path: str) -> None:
    GRPOTrainer = module.GRPOTrainer
    generate_and_score = GRPOTrainer._generate_and_score_completions

    def observed(self, inputs):
        if self.model.training:
            prompts = [row["prompt"][-1]["content"] for row in inputs]
            with open(path, "a") as out:
                out.write(json.dumps({"step": self.state.global_step + 1, "prompts": prompts}) + "\n")
        return generate_and_score(self, inputs)

    GRPOTrainer._generate_and_score_completions = observed


def main(argv: list[str]) -> int:
    """`ADDRESS NAME=VALUE ... -- ARGS`: the command line (`python -m grpo_pipeline ARGS`) on the local Ray at
    ADDRESS, joined here with these faults (the run uses the Ray this process already has)."""
    split = argv.index("--")
    join(argv[0], **dict(item.split("=", 1) for item in argv[1:split]))
    from grpo_pipeline.flows.grpo import main as command_line

    return command_line(argv[split + 1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
