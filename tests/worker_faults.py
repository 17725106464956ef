"""Faults injected into the local backend's Ray Train workers, through the real training path, for the
guards' tests (tests/e2e/test_local_guards.py): Ray's `worker_process_setup_hook` runs `install` first in
every worker process of the run, and each fault is switched on by a variable of the run's environment.

    runtime_env = faults(FAULT_NAN_LOSS_FROM_STEP=3)   # then train_local(settings, runtime_env, None)
    python tests/worker_faults.py FAULT_NAN_LOSS_FROM_STEP=3 -- --model tiny --device cpu   # the command line

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

import json
import os
import sys


def install() -> None:
    if step := os.environ.get("FAULT_NAN_LOSS_FROM_STEP"):
        _nan_loss_from(int(step))
    if step := os.environ.get("FAULT_CRASH_AT_STEP"):
        _crash_at(int(step))
    if os.environ.get("FAULT_TRL_SAMPLER"):
        from grpo_pipeline.backends.local import data_order

        data_order.epoch_seeded = lambda drawn: drawn  # TRL's sampler as drawn
    if os.environ.get("FAULT_STALE_ROLLOUT_WEIGHTS"):
        _stale_rollout_weights()
    if path := os.environ.get("OBSERVE_BATCHES"):
        _observe_batches(path)


def faults(**variables) -> dict:
    """The Ray runtime_env that installs these faults in every worker process (this module travels by
    value: the workers do not have the tests folder on their path)."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return {"worker_process_setup_hook": install, "env_vars": {name: str(value) for name, value in variables.items()}}


def _nan_loss_from(step: int) -> None:
    from trl import GRPOTrainer

    compute_loss = GRPOTrainer.compute_loss

    def poisoned(self, model, inputs, *args, **kwargs):
        loss = compute_loss(self, model, inputs, *args, **kwargs)
        return loss * float("nan") if self.state.global_step + 1 >= step else loss

    GRPOTrainer.compute_loss = poisoned


def _crash_at(step: int) -> None:
    from trl import GRPOTrainer

    training_step = GRPOTrainer.training_step

    def crashing(self, *args, **kwargs):
        if self.state.global_step + 1 == step:
            raise RuntimeError(f"injected crash at step {step}")
        return training_step(self, *args, **kwargs)

    GRPOTrainer.training_step = crashing


def _stale_rollout_weights() -> None:
    from grpo_pipeline.generation.decoding import NativeDecoder

    refresh = NativeDecoder._refresh_weights

    def once(self):
        if not getattr(self, "_synced_once", False):
            refresh(self)
            self._synced_once = True

    NativeDecoder._refresh_weights = once


def _observe_batches(path: str) -> None:
    from trl import GRPOTrainer

    generate_and_score = GRPOTrainer._generate_and_score_completions

    def observed(self, inputs):
        if self.model.training:
            prompts = [row["prompt"][-1]["content"] for row in inputs]
            with open(path, "a") as out:
                out.write(json.dumps({"step": self.state.global_step + 1, "prompts": prompts}) + "\n")
        return generate_and_score(self, inputs)

    GRPOTrainer._generate_and_score_completions = observed


def main(argv: list[str]) -> int:
    """`NAME=VALUE ... -- ARGS`: the command line (`python -m grpo_pipeline ARGS`) on a local Ray started
    here with these faults (the run joins the Ray this process already has)."""
    import ray

    split = argv.index("--")
    variables = dict(item.split("=", 1) for item in argv[:split])
    ray.init(address="local", runtime_env=faults(**variables), log_to_driver=False, include_dashboard=False)
    from grpo_pipeline.flows.grpo import main as command_line

    return command_line(argv[split + 1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
