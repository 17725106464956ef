"""What a memory plan is made of, for either training engine: one role's peak by part (`RoleMemory`),
the plan of a run (`MemoryPlan`, its refusal, its JSON and Markdown), and vLLM's rows, which are the
same whatever trains beside it.

    python -m grpo_pipeline --model qwen3.5-122b-a10b --device gpu --dry-run   # the plan's table

planner/memory.py (Megatron) and planner/fsdp.py (FSDP2) fill them in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from grpo_pipeline.profiles.model_size import ModelSize, head_dim, kv_bytes_per_token, linear_state_bytes_per_sequence

if TYPE_CHECKING:
    from grpo_pipeline.profiles.schema import RunProfile

GIB = 2**30
PARAM_BYTES = 2  # bf16 / fp16 weights
VLLM_OVERHEAD = 2 * GIB  # CUDA graphs, sampler and profiling buffers of one vLLM engine (approximate)
# What the planner keeps free of a device when it sizes a run itself (backends/local/sizing.py,
# backends/verl/sizing.py): what an estimate leaves out and a misjudged batch shape should not cost a run that a
# smaller micro batch or the recomputation would have saved. A refusal still compares the estimate with the device.
HEADROOM = 0.10


@dataclass
class RoleMemory:
    """One role's peak on one device (host: one node), by part, in bytes."""

    role: str
    when: str
    parts: dict[str, float]
    capacity: float | None
    fix: str = ""

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.capacity is None or self.total <= self.capacity

    def problem(self, device: str) -> str:
        """One line: the role, its estimate, the capacity and a fix."""
        where = "node's host memory" if self.role == "host" else f"{device} device"
        return (f"{self.role} needs {gib(self.total)} GiB per {'node' if self.role == 'host' else 'device'} "
                f"({self.when}) but one {where} has {gib(self.capacity)} GiB for it; {self.fix}")


@dataclass
class MemoryPlan:
    device: str
    device_memory: float | None  # bytes of one device
    reserved: float
    source: str
    parameters: int
    active_parameters: int
    roles: list[RoleMemory] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    kv_sequences: int = 0  # full-length sequences the rollout's KV cache holds
    enforced: bool = True  # planner.enforce: a plan that does not fit refuses the run

    @property
    def fits(self) -> bool:
        return all(role.fits for role in self.roles)

    def problems(self) -> list[str]:
        """One message per role that does not fit: its first phase that does not."""
        failing: dict[str, RoleMemory] = {}
        for role in self.roles:
            if not role.fits:
                failing.setdefault(role.role, role)
        return [role.problem(self.device) for role in failing.values()]

    def refusal(self) -> str:
        return "the layout does not fit in memory: " + "; ".join(self.problems())

    def warning(self) -> str | None:
        """What planning logs instead of refusing, under planner.enforce=false."""
        if self.fits or self.enforced:
            return None
        return f"planner.enforce=false, planning goes on: {self.refusal()}"

    def summary(self) -> dict[str, Any]:
        """The plan as JSON: GiB, rounded."""
        return {
            "device": self.device, "device_memory_gib": gib(self.device_memory), "reserved_gib": gib(self.reserved),
            "source": self.source, "parameters": self.parameters, "active_parameters": self.active_parameters,
            "fits": self.fits, "enforced": self.enforced, "warning": self.warning(),
            "roles": [{"role": r.role, "when": r.when, "estimate_gib": gib(r.total), "capacity_gib": gib(r.capacity),
                       "fits": r.fits, "parts_gib": {k: gib(v) for k, v in r.parts.items()}} for r in self.roles],
            "notes": self.notes,
        }


def memory_table(summary: dict[str, Any]) -> list[str]:
    """A plan's summary as a small Markdown table, as the dry run and the report show it."""
    s = summary
    lines = [f"parameters {s['parameters']:,} ({s['active_parameters']:,} active per token); device {s['device']}: "
             f"{s['device_memory_gib']} GiB, {s['reserved_gib']} GiB kept for the runtime ({s['source']})",
             "| role | when | estimate GiB | capacity GiB | fits | largest parts |", "|---|---|---|---|---|---|"]
    for r in s["roles"]:
        largest = ", ".join(f"{k} {v}" for k, v in sorted(r["parts_gib"].items(), key=lambda kv: -kv[1])[:3] if v)
        capacity = "-" if r["capacity_gib"] is None else r["capacity_gib"]
        lines.append(f"| {r['role']} | {r['when']} | {r['estimate_gib']} | {capacity} | {'yes' if r['fits'] else 'NO'} "
                     f"| {largest} |")
    lines += [f"note: {note}" for note in s["notes"]]
    return lines + ([f"warning: {s['warning']}"] if s.get("warning") else [])


def largest_fitting(fits: Callable[[int], bool], limit: int = 1 << 16) -> int | None:
    """The largest batch (any size up to `limit`) that `fits`, where what a batch needs grows with it: doubled, then
    halved in on; None when not even one fits."""
    if not fits(1):
        return None
    low, high = 1, 2
    while high <= limit and fits(high):
        low, high = high, high * 2
    high = min(high, limit + 1)
    while high - low > 1:  # low fits, high does not (or is past the limit)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def largest_batch_row(training: str, checkpointing: bool, largest: int | None, peak: float | None) -> dict:
    """One row of a one-device table (`--suggest-layout` on one device, either backend)."""
    return {"training": training, "gradient_checkpointing": checkpointing, "largest_micro_batch": largest or 0,
            "peak_gib": gib(peak) if largest else None}


def largest_batch_table(title: str, peak: str, device: str, sequence_tokens: int, rows: list[dict],
                        refusal: str) -> tuple[dict, list[str]]:
    """The largest micro batch one device fits, full training and LoRA, checkpointing off and on: as JSON (with
    `refusal` when not one sequence fits) and as the lines printed, under `title`; `peak`: what the GiB are of."""
    summary = {"device": device, "sequence_tokens": sequence_tokens, "rows": rows}
    if not any(row["largest_micro_batch"] for row in rows):
        summary["refusal"] = refusal
    lines = [title, f"| training | gradient checkpointing | largest micro batch | {peak} GiB |", "|---|---|---|---|"]
    return summary, lines + [f"| {row['training']} | {'on' if row['gradient_checkpointing'] else 'off'} | "
                             f"{row['largest_micro_batch'] or 'none fits'} | {row['peak_gib'] or '-'} |" for row in rows]


def gib(value: float | None) -> float | None:
    return None if value is None else round(value / GIB, 1)


def rollout_rows(p: RunProfile, size: ModelSize, rtp: int, capacity: float | None, usable: float | None,
                 resident: float) -> tuple[list[RoleMemory], int]:
    """vLLM's rows at rollout TP `rtp`, beside what the trainer leaves `resident` when it starts, and how
    many full-length sequences its KV cache holds (the same engine for either training engine)."""
    r, arch = p.rollout, p.model.architecture
    if capacity is None:
        return [], 0
    budget = r.gpu_memory_utilization * capacity
    weights = PARAM_BYTES * size.total / rtp
    # One profiling forward of max_num_batched_tokens (verl: 8192) tokens, one layer's widest tensor,
    # plus the sampler's fp32 logits for max_num_seqs sequences.
    widest = max(2 * (arch.intermediate_size or 0), 2 * (arch.num_experts_per_tok or 0) * (arch.moe_intermediate_size or 0),
                 arch.num_attention_heads * head_dim(arch) * 3)
    working = 8192 * (4 * arch.hidden_size + widest / rtp) * 2 + 3 * r.max_num_seqs * arch.vocab_size * 4 + VLLM_OVERHEAD
    kv_cache = budget - weights - working
    max_len = r.max_model_len or p.data.max_prompt_length + p.data.max_response_length
    per_sequence = kv_bytes_per_token(arch, rtp) * max_len + linear_state_bytes_per_sequence(arch, rtp)
    sequences = int(kv_cache // per_sequence) if kv_cache > 0 else 0
    free = None if usable is None else usable - resident
    start = RoleMemory(
        "rollout", f"vLLM start: gpu_memory_utilization {r.gpu_memory_utilization} of the device must be free",
        {"vLLM share": budget, "trainer resident": resident}, usable,
        "set engine.param_offload=true and engine.optimizer_offload=true" if resident else
        f"lower rollout.gpu_memory_utilization to {max(round((free or 0) / capacity - 0.005, 2), 0.05)}")
    cache = RoleMemory(
        "rollout", f"KV cache: {sequences} sequence(s) of {max_len} tokens fit (max_num_seqs {r.max_num_seqs})",
        {"weights": weights, "engine working memory": working, "one sequence's cache": per_sequence}, budget,
        "raise rollout.gpu_memory_utilization or rollout.tp, or lower rollout.max_model_len")
    if 0 < sequences < r.max_num_seqs:
        cache.when += "; fewer than max_num_seqs: vLLM queues the rest"
    return [start, cache], sequences
