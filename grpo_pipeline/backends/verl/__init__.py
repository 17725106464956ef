"""The `verl` training backend: Megatron + vLLM on GPUs or NPUs, run by verl 0.9.1 on a Ray cluster.

    python -m grpo_pipeline --model qwen3.5-122b-a10b --device npu --dry-run   # the rendered command

Modules: `command` (the profile rendered to verl's `main_ppo` overrides), `checkpoint` (a trained
step as a Hugging Face directory), `backend` (the `Backend` the flow calls: its layout rules and the
rest of the interface), `job` (what one attempt submits, and the run's job record), `job_api` (Ray's
job API: client, submit, stop, status), `follow` (the job's log and metrics as they come),
`failures` (why a job failed: retry or not).
"""
