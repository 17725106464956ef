"""Where a GRPO step's time goes, measured around TRL's own methods of the trainer a worker runs.

    python bench/bench_grpo_step.py --device cpu --model tiny      # sets trainer.phase_timing (below)

With `LocalTrainSettings.phase_timing` on, rank 0 appends one JSON line per optimizer step to
`<run>/phases.jsonl`: seconds in each phase, the step's wall time and, on a GPU, the peak memory
allocated so far (`peak_gib`). Phases are exclusive (a phase
inside another pauses the outer one), so they add up to the step; what no phase claims is `other`
(`_prepare_inputs` outside the phases below: rewards, advantages, batching; TRL's and Ray Train's
bookkeeping, checkpoints):

The wraps of TRL's private methods are backends/local/trl_hooks.py's `time_phases` (pinned there):

| phase | TRL / pipeline method |
|---|---|
| generation | `_generate_single_turn` (the native decoder or TRL's generate) |
| weight_sync | the native decoder's `_refresh_weights` (packs q/k/v and gate/up from the policy, on the device) |
| old_logprobs | `_get_per_token_logps_and_entropies` on the policy, inside `_generate_and_score_completions` |
| ref_logprobs | the same on the reference model (TRL skips it when beta = 0) |
| forward_backward | `training_step` less what it calls above and `_prepare_inputs` (`compute_loss` and `backward`) |
| optimizer | the optimizer's `step` and `zero_grad` (gradient clipping counts as `other`) |

On a GPU each boundary synchronises the device (the timings are the kernels', not their launches);
that costs a few launches' worth of overlap, so turn it on to measure, not to train.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

from transformers import TrainerCallback

PHASES = ("generation", "weight_sync", "old_logprobs", "ref_logprobs", "forward_backward", "optimizer")


class StepPhases(TrainerCallback):
    """Exclusive seconds per phase of the current optimizer step, written at its end."""

    def __init__(self, out: Path | None, synchronize=lambda: None, peak_memory=lambda: None):
        self.out, self.synchronize, self.peak_memory = out, synchronize, peak_memory
        self.seconds = dict.fromkeys(PHASES + ("other",), 0.0)
        self.stack: list[list] = []  # [phase, started] of the phases running, innermost last
        self.step_started = time.perf_counter()
        self.scoring = False  # inside _generate_and_score_completions: a log-prob pass is old or ref
        self.records: list[dict] = []

    @classmethod
    def attach(cls, trainer, out: Path | None) -> StepPhases:
        import torch

        on_cuda = torch.cuda.is_available() and trainer.args.device.type == "cuda"
        sync = torch.cuda.synchronize if on_cuda else (lambda: None)
        # The step's peak, for the memory plan's prediction beside it (backends/local/train_memory.py).
        peak = (lambda: torch.cuda.max_memory_allocated() / 2**30) if on_cuda else (lambda: None)
        phases = cls(out, sync, peak)
        from grpo_pipeline.backends.local.trl_hooks import time_phases

        time_phases(trainer, phases)  # TRL's private methods, wrapped where they are pinned
        if hasattr(trainer, "native_decoder"):
            make = trainer.native_decoder

            def native_decoder():
                decoder = make()
                if decoder is not None and not getattr(decoder, "_phase_timed", False):
                    phases.wrap(decoder, "_refresh_weights", lambda *a, **k: "weight_sync")
                    decoder._phase_timed = True
                return decoder

            trainer.native_decoder = native_decoder
        trainer.add_callback(phases)
        return phases

    def wrap_scoring(self, owner, name: str) -> None:
        """While `owner.name` runs, a log-prob pass is the old policy's or the reference's, not the loss's."""
        score = getattr(owner, name)

        @functools.wraps(score)
        def scoring(*args, **kwargs):
            self.scoring = True
            try:
                return score(*args, **kwargs)
            finally:
                self.scoring = False

        setattr(owner, name, scoring)

    def wrap(self, owner, name: str, phase_of) -> None:
        """`owner.name` timed as the phase `phase_of(its arguments)` names (None: not a phase of its own)."""
        method = getattr(owner, name)

        @functools.wraps(method)
        def timed(*args, **kwargs):
            phase = phase_of(*args, **kwargs)
            if phase is None:
                return method(*args, **kwargs)
            self._enter(phase)
            try:
                return method(*args, **kwargs)
            finally:
                self._leave()

        setattr(owner, name, timed)

    def _enter(self, phase: str) -> None:
        self.synchronize()
        now = time.perf_counter()
        if self.stack:
            outer = self.stack[-1]
            self.seconds[outer[0]] += now - outer[1]
        self.stack.append([phase, now])

    def _leave(self) -> None:
        self.synchronize()
        now = time.perf_counter()
        phase, started = self.stack.pop()
        self.seconds[phase] += now - started
        if self.stack:
            self.stack[-1][1] = now  # the outer phase resumes

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        if optimizer is not None:
            for name in ("step", "zero_grad"):
                self.wrap(optimizer, name, lambda *a, **k: "optimizer")

    def on_step_begin(self, args, state, control, **kwargs):
        self.synchronize()
        self.step_started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.synchronize()
        wall = time.perf_counter() - self.step_started
        record = {"step": state.global_step, "wall_s": round(wall, 6),
                  **{phase: round(self.seconds[phase], 6) for phase in PHASES}}
        record["other"] = round(wall - sum(record[phase] for phase in PHASES), 6)
        if (peak := self.peak_memory()) is not None:
            record["peak_gib"] = round(peak, 3)
        self.records.append(record)
        if self.out is not None:
            with self.out.open("a") as file:
                file.write(json.dumps(record) + "\n")
        self.seconds = dict.fromkeys(PHASES + ("other",), 0.0)
