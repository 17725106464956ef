"""fp32 master weights for a policy that trains and generates in bf16, as verl's FSDP actor keeps them.

    .venv/bin/python -m pytest -q tests/test_verl_parity.py -k bf16

verl's actor loads the policy in fp32 (`fsdp_config.model_dtype`) and computes in bf16 (FSDP's
MixedPrecision casts the fp32 weights for every forward); the optimizer steps the fp32 weights. Stepping the
bf16 weights themselves loses every Adam step smaller than half a bf16 spacing of the weight: at a learning
rate of 5e-5, every weight of magnitude 0.0256 or more keeps its value. Here the model stays in bf16 (its
forward, backward and rollouts run as before) and the optimizer steps fp32 copies of its 16-bit parameters:
each step takes the model's gradients into the copies, steps them, and writes them back rounded, which is
the bf16 weight verl's forward would use. Not carried across a resume: the checkpoint holds the bf16 policy,
so the copies restart from it (what was below a bf16 spacing is lost once a resume).
"""

from __future__ import annotations

import inspect

SIXTEEN_BIT = ("bfloat16", "float16")


def with_master_weights(optimizer):
    """The same optimizer class, settings and parameter groups over fp32 copies of the 16-bit parameters (others
    stay as they are: a LoRA adapter is fp32 already); the returned optimizer is the one to step and schedule
    (the given one where no parameter is 16-bit)."""
    import torch

    pairs = []
    groups = []
    for group in optimizer.param_groups:
        params = []
        for param in group["params"]:
            if str(param.dtype).removeprefix("torch.") in SIXTEEN_BIT:
                master = param.detach().float().clone()
                pairs.append((param, master))
                params.append(master)
            else:
                params.append(param)
        groups.append({**{key: value for key, value in group.items() if key != "params"}, "params": params})
    if not pairs:
        return optimizer
    accepted = inspect.signature(type(optimizer)).parameters
    master_optimizer = type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})

    def take_gradients(*_):
        for param, master in pairs:  # one parameter at a time: the bf16 gradient is freed as its copy is made
            master.grad = None if param.grad is None else param.grad.float()
            param.grad = None

    @torch.no_grad()
    def write_back(*_):
        for param, master in pairs:
            param.copy_(master)
            master.grad = None

    master_optimizer.register_step_pre_hook(take_gradients)
    master_optimizer.register_step_post_hook(write_back)
    master_optimizer.fp32_copies = pairs  # marks it, and lets a test read the copies
    return master_optimizer


def trains_master_weights(run_dtype: str) -> bool:
    """Whether the run's weights need fp32 copies for the optimizer: a 16-bit training dtype (verl's actor keeps
    fp32 weights whatever it computes in)."""
    return run_dtype in SIXTEEN_BIT
