"""The `local` training backend: GRPO with TRL's GRPOTrainer on Ray Train workers, any device.

    python -m grpo_pipeline --model tiny --device cpu --set cluster.devices_per_node=2
    python -m grpo_pipeline --model smollm2-135m --device gpu

Ray Train starts N workers (devices on gpu / npu, processes on cpu) and the process group (nccl,
hccl or gloo, from the device profile); in each, TRL's GRPOTrainer trains the prepared model on the
prepared parquet files, data-parallel (accelerate reuses Ray's process group and wraps the model in
DDP). The worker never calls Prefect: it writes `metrics.jsonl` and checkpoints under the run
directory, and the driver (the flow's train task) follows them.

Checkpoints: every `trainer.save_freq` steps, `checkpoints/global_step_N/` (HF policy + tokenizer +
optimizer, scheduler, RNG and trainer state), then `checkpoints/latest` (atomically, last). A retry
resumes from `latest`; nothing a previous attempt wrote is deleted.

The verl <-> TRL mapping of the one `algorithm` section (also in docs/local-backend.md):

| profile (verl key)                          | GRPOConfig                                   |
|---------------------------------------------|----------------------------------------------|
| algorithm.rollout_n (rollout.n)             | num_generations                              |
| algorithm.use_kl_loss, kl_loss_coef         | beta = kl_loss_coef if use_kl_loss else 0    |
| algorithm.clip_ratio_low / _high            | epsilon / epsilon_high                       |
| algorithm.lr (actor.optim.lr)               | learning_rate, lr_scheduler_type="constant"  |
| algorithm.entropy_coeff                     | entropy_coef                                 |
| algorithm.loss_agg_mode                     | loss_type (token-mean -> dapo, ...)          |
| algorithm.temperature                       | temperature                                  |
| data.max_response_length                    | max_completion_length                        |
| data.max_prompt_length                      | prompts longer are filtered or refused here  |
| data.train_batch_size x rollout_n           | generation_batch_size                        |
|   x generation.steps_per_generation         |                                              |
| generation.cache / compile / engine         | cache_implementation, disable_compile=False, |
|                                             | use_vllm + vllm_mode="colocate"              |
| actor.ppo_mini_batch_size x rollout_n       | completions per optimizer step (grad. accum.) |
| actor.ppo_micro_batch_size_per_gpu          | per_device_train_batch_size (+ grad. accum.) |
| trainer.total_training_steps, save_freq     | max_steps, save_steps (x steps_per_generation)|
| model.enable_gradient_checkpointing         | gradient_checkpointing (off where the step   |
|   (unset: decided from the devices found)   | fits without it: train_memory)               |

Modules: `mapping` (the table above, and what the mapping cannot express), `settings` (the
driver's checks before a worker starts, and what workers get), `worker` (inside each Ray Train
worker), `driver` (starts the workers and follows them), `checkpoints` (the layout a retry resumes
from), `backend` (the `Backend` the flow calls), `trl_hooks` (every use of TRL's private methods, pinned
to the TRL releases checked).

TRL's own defaults differ (loss_type="dapo" happens to match token-mean, beta=0, a linearly decaying
learning rate, num_generations=8, max_completion_length=512): every value above is set explicitly.
"""
