"""The verl backend as the flow sees it (backends/base.py): verl trains on the user's Ray cluster as a
Ray job, which the train stage submits, follows, stops and resumes.

    python -m grpo_pipeline --model qwen3.5-122b-a10b --device npu --ray-address head:6379

Its layout rules (Megatron's TP x PP x CP against the world and the model, EP/ETP against the experts,
or FSDP2's group and Ulysses size; vLLM's TP against a node and the heads, batch sizes against the
engine's data-parallel ranks) and its entrypoint (shell words naming a command) are checked whenever a
profile is resolved. An attempt of the train stage:
1. adds to the run's records the steps its jobs trained while no flow followed them (the flow was
   killed: verl's own file of each attempt has them), then returns at once when the run is already
   complete (verl's tracker file at the last step, or a job of this run that ended it): a finished
   run is never submitted again; trainer.resume_mode=disable over the run's checkpoints is refused
   (only the stage's own retries resume whatever it says);
2. follows the run's job if it is still pending or running, or ended while no flow followed it, else waits until
   the cluster has the nodes and devices the layout needs, every node can read the data and the model and write
   the checkpoints, and every node's image can run the job (cluster/preflight.py), then submits the next attempt;
3. lets go of Ray (following needs only the job API), streams the job's log into the task's log and verl's
   per-step metrics into the run's records (follow.py); stops the job when no step ends in trainer.step_timeout_s;
4. ends on the job's status: SUCCEEDED at the tracker's step; FAILED with a config error (not
   retried, the job's own line) or another cause (`TrainingInterrupted`: the stage's retry resumes
   from the latest checkpoint with trainer.resume_mode=auto); or on the cluster itself: a job API
   that stops answering (the head died) ends the run (`ClusterLost`, not retried) with a line that names
   the cluster, the last step and how to resume. Checkpoints are never deleted. A success before verl's
   own last step, or a resume from a step without its dataloader state, is a guard's (backends/guards.py).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from pathlib import Path

from grpo_pipeline.backends.base import Backend, TrainingInputs, TrainingInterrupted, TrainingProgress, TrainingRun, TrainResult
from grpo_pipeline.backends.guards import GuardTrip, check_data_position, check_short_run
from grpo_pipeline.backends.metrics import append_metrics, keep_metrics_up_to, read_metrics, step_ranges
from grpo_pipeline.backends.verl.checkpoint import verl_hf_dir
from grpo_pipeline.backends.verl.command import entrypoint_problems, verl_command
from grpo_pipeline.backends.verl.engines import verl_engine
from grpo_pipeline.backends.verl.failures import diagnose
from grpo_pipeline.backends.verl.follow import JobLog, VerlMetrics, steps_missing_from, total_steps, tracker_step
from grpo_pipeline.backends.verl.resume import keep_good_checkpoint, missing_dataloader_state
from grpo_pipeline.backends.verl.steps import planned_steps, step_count_problem
from grpo_pipeline.backends.verl.job import LOST, TERMINAL, JobRecord, job_spec, new_token, read_record, write_record
from grpo_pipeline.backends.verl.job_api import job_client, job_status, stop_job, submit
from grpo_pipeline.backends.verl.lora import lora_problems, merged_policy, verl_adapter
from grpo_pipeline.backends.verl.requirements import verl_requirements
from grpo_pipeline.backends.verl.rewards import job_reward_package, pipeline_reward
from grpo_pipeline.backends.verl.sizing import one_device_table, size_verl_run, sizing_notes
from grpo_pipeline.store.files import write_json_atomic
from grpo_pipeline.cluster.node_tasks import check_paths_on_nodes
from grpo_pipeline.cluster.preflight import NodesCannotRun, run_preflight
from grpo_pipeline.cluster.ray_cluster import ClusterLost, answer_timeout_s, connect_ray, disconnect_ray, wait_for_nodes
from grpo_pipeline.cluster.ray_address import cluster_address, parse_ray_address
from grpo_pipeline.errors import UserError
from grpo_pipeline.generation.plan import GenerationPlan
from grpo_pipeline.planner.memory import MemoryPlan, plan_for
from grpo_pipeline.profiles.model_size import size_problems
from grpo_pipeline.profiles.requirements import NodeRequirement, for_stage
from grpo_pipeline.profiles.schema import RunProfile
from grpo_pipeline.rewards.check import check_rewards
from grpo_pipeline.rewards.plan import RewardPlan
from grpo_pipeline.run.folder import RunFolder

POLL_S = 1.0
LOG_LINES_KEPT = 400  # the end of the job's log, where its failure is
log = logging.getLogger(__name__)
# Run folders (their job record's token) this process has submitted a job for: the train stage's
# retries resume them whatever trainer.resume_mode says; a later run of the folder is held to it.
_SUBMITTED_HERE: set[str] = set()


class JobStopped(UserError):
    """The run's job was stopped from outside the run (ray job stop, the dashboard)."""


class VerlBackend(Backend):
    name = "verl"
    logs_to_trackers = True

    def detected_layer(self, profile: RunProfile, devices_here: int, generation: GenerationPlan,
                       detected_names: list[str] | None = None, detected_gib: list[float] | None = None,
                       given: frozenset[str] = frozenset()) -> dict | None:
        # Micro batches, recomputation, offload, vLLM's share and concurrency, around what is given (sizing.py).
        if detected_gib and (sizing := size_verl_run(profile, detected_names, detected_gib, given, self.profile_problems)):
            return sizing.layer or None
        return None

    def memory_plan(self, profile: RunProfile, detected_names: list[str] | None = None,
                    detected_gib: list[float] | None = None) -> MemoryPlan | None:
        plan = plan_for(profile, detected_names, detected_gib)
        if plan and detected_gib and (free := size_verl_run(profile, detected_names, detected_gib, frozenset(), self.profile_problems)):
            plan.notes += sizing_notes(profile, free)  # each sized setting beside the planner's own choice
        return plan

    def memory_note(self, profile: RunProfile, generation: GenerationPlan, detected_names: list[str] | None = None,
                    detected_gib: list[float] | None = None) -> str | None:
        if problems := size_problems(profile.model.architecture):
            return f"not estimated, {'; '.join(problems)}"
        return None

    def size_table(self, profile: RunProfile, generation: GenerationPlan) -> tuple[dict, list[str]] | None:
        return one_device_table(profile)

    def node_requirements(self, profile: RunProfile, stage: str) -> dict[str, NodeRequirement]:
        return for_stage({**verl_requirements(profile), **profile.requires}, stage)

    def generation_summary(self, profile, generation):
        r = profile.rollout
        return (f"rollouts: {r.engine} inside verl's job (rollout.tp={r.tp}); evaluation: on the cluster's nodes, "
                f"{generation.engine} (the run's generation plan)")

    def evaluation(self, profile, settings, devices_here, ray_address, runtime_env):
        """On the run's cluster (the policy is too big for the flow's host): the run's generation plan, which the
        nodes follow (generation/sharding.py `generate_on_node`), one engine per `rollout.tp` devices, each a Ray
        task on the nodes, once every node is shown able to run it."""
        from grpo_pipeline.generation.sharding import on_cluster

        def check_nodes() -> None:
            checked = run_preflight(self.node_requirements(profile, "evaluate"), profile.platform.ray_resource,
                                    "evaluate", profile.cluster.preflight_timeout_s)
            log.info(checked.summary_line())
            if refusal := checked.refusal():
                raise NodesCannotRun(refusal)

        devices = profile.cluster.nnodes * profile.cluster.devices_per_node
        engine = on_cluster(profile.platform, max(1, devices // profile.rollout.tp), profile.rollout.tp, ray_address,
                            runtime_env, check_nodes)
        return settings.model_copy(update={"tensor_parallel_size": profile.rollout.tp}), engine

    def profile_problems(self, profile: RunProfile) -> list[str]:
        p = profile
        if not p.platform.accelerated:
            return [f"backend=verl on device {p.platform.kind}: verl needs GPUs or NPUs and vLLM; use --backend local, "
                    "or --device gpu|npu with --dry-run to render the cluster command here"]
        problems = verl_engine(p).problems(p)  # the engine's layout, vLLM's, batches (backends/verl/engines.py)
        problems += entrypoint_problems(p.trainer.entrypoint) + lora_problems(p)
        if p.trainer.save_freq <= 0:
            problems.append(f"trainer.save_freq={p.trainer.save_freq}: the verl backend resumes and exports from "
                            "verl's checkpoints; set it to a number of steps (verl also saves the last step)")
        return problems

    def check_run(self, profile: RunProfile, devices_here: int, stages: list[str], dry_run: bool,
                  ray_address: str | None) -> None:
        if not {"train", "evaluate"} & set(stages) or dry_run:
            return
        address, origin = cluster_address(ray_address)
        if address is None:
            raise UserError(
                "backend verl trains as a Ray job on a running cluster, and evaluates there: start it (`ray start --head` on the head "
                "node, `ray start --address=<head>:6379` on the others) and pass --ray-address <head>:6379 "
                "(or set RAY_ADDRESS)"
            )
        parsed = parse_ray_address(address, origin)
        if parsed is not None and parsed.scheme in ("http", "https"):
            raise UserError(
                f"{origin}={address}: backend verl checks the cluster's nodes through Ray itself; give the head's "
                "GCS address (<head>:6379) or ray://<head>:10001 (the job API's address is read from the cluster)"
            )

    def command(self, profile: RunProfile, inputs: TrainingInputs) -> list[str] | None:
        return verl_command(profile, inputs)

    def submission(self, profile: RunProfile, run: TrainingRun) -> dict | None:
        spec = job_spec(profile, run.inputs, Path(run.run_dir), run.run_name, run.runtime_env, "<token>", 1)
        return spec.model_dump(exclude={"metrics_file"})

    def train(self, profile: RunProfile, run: TrainingRun, progress: TrainingProgress) -> TrainResult:
        run_dir, checkpoints = Path(run.run_dir), Path(run.inputs.checkpoint_dir)
        max_steps = planned_steps(profile, run.inputs.train_files)
        if problem := step_count_problem(profile, run.inputs.train_files):
            raise UserError(problem)
        record, done = read_record(run_dir), tracker_step(checkpoints)
        if record is not None and (missing := _record_missing_steps(run_dir, record, profile.sequences_per_step)):
            # The job trains on while no flow follows it (a killed flow): those steps get no line of their own.
            steps = f"step{'s' * (len(missing) > 1)} {step_ranges(missing)}"
            progress.note(f"{steps} trained while no flow followed Ray job {record.submission_id}: recorded from verl's "
                          f"metrics file")
        if (record and record.finished) or (done is not None and done >= max_steps):
            final = record.final_step if record and record.finished else done
            progress.note(f"the run was already complete at step {final}: nothing submitted")
            return _result(run_dir, checkpoints, final, min(final, max_steps), None, True)
        retry_here = record is not None and record.token in _SUBMITTED_HERE
        if done is not None and profile.trainer.resume_mode == "disable" and not retry_here:
            raise UserError(f"trainer.resume_mode=disable: {checkpoints} already holds this run's checkpoints (step "
                            f"{done}), which verl would write over; choose a new --run-name, or resume_mode=auto")
        client = job_client(run.ray_address)
        status = job_status(client, record.submission_id) if record is not None else None
        if status in ("PENDING", "RUNNING") or (status == "SUCCEEDED" and not record.ended):
            progress.note(f"following the run's Ray job {record.submission_id} (attempt {record.attempt}, {status.lower()})")
        else:
            record = self._submit_next(profile, run, client, record, done, progress)
        # Following needs only the job API. A Ray connection (the readiness checks', the flow's node
        # checks') would make Ray's core abort this process a minute after the head died.
        disconnect_ray()
        progress.started(max_steps, record.resumed_from)
        return self._follow(profile, run, client, record, max_steps, progress)

    def _submit_next(self, profile: RunProfile, run: TrainingRun, client, record: JobRecord | None, done: int | None,
                     progress: TrainingProgress) -> JobRecord:
        """Check the cluster is ready for the run, then submit the next attempt (recorded first), which
        resumes from the latest checkpoint: the steps after it are trained again."""
        if done is not None:
            check_data_position(profile.guards, done, missing_dataloader_state(Path(run.inputs.checkpoint_dir), done))
        connect_ray(run.ray_address, run.runtime_env)
        resource = profile.platform.ray_resource
        wait_for_nodes(resource, profile.cluster.nnodes, profile.cluster.devices_per_node,
                       profile.cluster.ready_timeout_s, progress.note)
        inputs, run_dir = run.inputs, Path(run.run_dir)
        checked = run_preflight(self.node_requirements(profile, "train"), resource, "train",
                                profile.cluster.preflight_timeout_s)
        write_json_atomic(run_dir / RunFolder.NODES, checked.model_dump(mode="json"))
        progress.note(checked.summary_line())
        progress.nodes(f"What each node's image has ({checked.stage} stage)", checked.table())
        if refusal := checked.refusal():
            raise NodesCannotRun(refusal)
        check_paths_on_nodes(
            entries={},
            readable={"data.root": [*inputs.train_files, *inputs.val_files],
                      "model.root": [inputs.model_path, *filter(None, [inputs.dist_checkpoint_path])]},
            writable={"--run-dir": [inputs.checkpoint_dir, str(run_dir / RunFolder.JOB)]},
        )
        for line in check_rewards(RewardPlan.from_section(profile.reward), inputs.train_files[0],
                                  profile.reward.check_timeout_s):
            progress.note(line)
        if pipeline_reward(profile):
            job_reward_package(profile, run_dir / RunFolder.JOB)
        attempt, token = (record.attempt + 1, record.token) if record else (1, new_token())
        spec = job_spec(profile, inputs, run_dir, run.run_name, run.runtime_env, token, attempt)
        record = JobRecord(token=token, attempt=attempt, submission_id=spec.submission_id, address=client.get_address(),
                           metrics_file=spec.metrics_file, status="SUBMITTED", resumed_from=done,
                           model_path=inputs.model_path)
        write_record(run_dir, record)  # before the submit: a crash in between leaves a job `stop` can find
        keep_metrics_up_to(run_dir / RunFolder.METRICS, done or 0)
        _SUBMITTED_HERE.add(token)
        submit(client, spec)
        progress.note(f"submitted Ray job {spec.submission_id} (attempt {attempt}) to {record.address}")
        return record

    def _follow(self, profile: RunProfile, run: TrainingRun, client, record: JobRecord, max_steps: int,
                progress: TrainingProgress) -> TrainResult:
        run_dir, checkpoints = Path(run.run_dir), Path(run.inputs.checkpoint_dir)
        sid = record.submission_id
        recorded = read_metrics(run_dir / RunFolder.METRICS)
        metrics = VerlMetrics(Path(record.metrics_file), max((r.step for r in recorded), default=0),
                              profile.sequences_per_step, record.resumed_from)
        job_log = JobLog(client, sid)
        tail: deque[str] = deque(maxlen=LOG_LINES_KEPT)
        timeout_s, running_since, last_step_at = profile.trainer.step_timeout_s, None, time.monotonic()
        answered_at, verl_total = time.monotonic(), None

        def pass_on(lines: list[str]) -> None:
            nonlocal last_step_at, verl_total
            for line in lines:
                tail.append(line)
                progress.output(line)
                verl_total = total_steps(line) or verl_total
            for step in metrics.new():
                append_metrics(run_dir / RunFolder.METRICS, step)
                progress.step(step)
                last_step_at = time.monotonic()

        try:
            while True:
                try:
                    status = job_status(client, sid)
                except (OSError, RuntimeError):  # requests' errors are OSErrors
                    if time.monotonic() - answered_at > answer_timeout_s():
                        self._lost(run, record, checkpoints)
                    time.sleep(POLL_S)
                    continue
                answered_at = time.monotonic()
                if status in TERMINAL:
                    break
                if status is None:
                    _save_status(run_dir, record, LOST)
                    raise TrainingInterrupted(f"the Ray cluster no longer knows job {sid} (its head restarted?); the "
                                              f"retry resumes from step {tracker_step(checkpoints) or 0}")
                pass_on(job_log.lines())
                if status == "RUNNING" and running_since is None:
                    running_since = last_step_at = time.monotonic()
                if running_since is not None and time.monotonic() - last_step_at > timeout_s:
                    stop_job(client, sid)
                    _save_status(run_dir, record, "STOPPED")
                    raise TrainingInterrupted(
                        f"no training step finished in {timeout_s} s (trainer.step_timeout_s): taken for a hang; Ray job "
                        f"{sid} stopped; the latest checkpoint is step {tracker_step(checkpoints) or 0}")
                time.sleep(POLL_S)
            pass_on(job_log.finish(client.get_job_logs(sid)))
        finally:
            job_log.close()
        final = tracker_step(checkpoints)
        if status == "SUCCEEDED":
            return self._succeeded(profile, run_dir, checkpoints, record, final, max_steps, verl_total, progress)
        _save_status(run_dir, record, status)
        if status == "STOPPED":
            raise JobStopped(f"Ray job {sid} was stopped outside this run (ray job stop, the dashboard); run the flow "
                             f"again with --run-name {run.run_name} to resume from step {final or 0}")
        cause = diagnose("\n".join(tail), client.get_job_info(sid).message or "")
        if cause.kind == "config":
            raise UserError(f"verl job {sid} failed on its configuration: {cause.line}")
        raise TrainingInterrupted(
            f"verl job {sid} failed ({'transient: ' if cause.kind == 'transient' else ''}{cause.line}); the retry "
            f"resumes from step {final or 0}")

    def _lost(self, run: TrainingRun, record: JobRecord, checkpoints: Path) -> None:
        """The cluster's job API stopped answering: end the run, saying where it stopped and how to go on.
        Not retried: the run needs the cluster back (a retry would wait on it again, and find the job gone)."""
        disconnect_ray()
        run_dir = Path(run.run_dir)
        _save_status(run_dir, record, LOST)
        last = max((r.step for r in read_metrics(run_dir / RunFolder.METRICS)), default=0)
        checkpoint = tracker_step(checkpoints) or 0
        raise ClusterLost(
            f"the Ray cluster at {cluster_address(run.ray_address)[0]} stopped answering (its job API at {record.address}, "
            f"for {answer_timeout_s():.0f} s) while job {record.submission_id} ran; the run's last step is {last}, its "
            f"latest checkpoint step {checkpoint}; once the cluster is back, run the flow again with --run-name "
            f"{run.run_name} to resume from step {checkpoint}")

    def _succeeded(self, profile: RunProfile, run_dir: Path, checkpoints: Path, record: JobRecord, final: int | None,
                   max_steps: int, verl_total: int | None, progress: TrainingProgress) -> TrainResult:
        _save_status(run_dir, record, "SUCCEEDED")  # finished once its final step is known and complete
        if final is None:
            raise UserError(f"verl job {record.submission_id} succeeded but left no checkpoint in {checkpoints} "
                            "(its tracker file latest_checkpointed_iteration.txt is missing); set trainer.save_freq > 0")
        if verl_total:  # verl's own step count (its log's); fewer than max_steps after filtering prompts
            check_short_run(profile.guards, final, verl_total, f"verl job {record.submission_id}")
        write_record(run_dir, record.model_copy(update={"status": "SUCCEEDED", "final_step": final}))
        resumed = record.resumed_from
        if resumed is not None and final <= resumed:
            # verl resumed at its last step: it validates and exits without training (and says success).
            progress.note(f"the run was already complete at step {final} (verl's tracker file): nothing trained")
            return _result(run_dir, checkpoints, final, final, None, True)
        if final < max_steps:
            progress.warn(f"verl ended the run at step {final} of the {max_steps} planned (its own count of the data, "
                          "after filtering overlong prompts)")
        return _result(run_dir, checkpoints, final, min(max_steps, final), resumed, False)

    def stop(self, run_dir: Path) -> bool:
        """Stop the run's job if it is still pending or running (the failure hooks: a cancel from the
        UI, SIGTERM, a crash), and wait until Ray says it ended, so no orphaned job keeps the devices."""
        record = read_record(run_dir)
        if record is None or record.ended:
            return False
        try:
            client = job_client(record.address)
            stopped = stop_job(client, record.submission_id)
            status = job_status(client, record.submission_id)
        except Exception as exc:  # the hooks must go on: say why the job could not be stopped
            log.error("could not stop Ray job %s at %s: %s", record.submission_id, record.address, exc)
            return False
        _save_status(Path(run_dir), record, status or "STOPPED")  # it may have ended on its own meanwhile
        return stopped

    def stop_for_guard(self, run_dir: Path, trip: GuardTrip) -> str:
        self.stop(run_dir)  # through Ray's job API
        return keep_good_checkpoint(Path(run_dir) / RunFolder.CHECKPOINTS, trip)  # the train stage's checkpoint_dir

    def policy_dir(self, result: TrainResult) -> Path:
        # The base model names a dist checkpoint's tensors where verl saved no HF config (its job record has it),
        # and is what a LoRA run's adapter is merged into.
        record = read_record(Path(result.metrics_file).parent) if result.metrics_file else None
        base = Path(record.model_path) if record is not None and record.model_path else None
        return merged_policy(Path(result.checkpoint_dir), base) or verl_hf_dir(Path(result.checkpoint_dir), base)

    def adapter_dir(self, result: TrainResult) -> Path | None:
        return verl_adapter(Path(result.checkpoint_dir))


def _record_missing_steps(run_dir: Path, record: JobRecord, responses_per_step: int) -> list[int]:
    """Add to metrics.jsonl what the attempts' verl files hold past its last step (each step once); the steps added."""
    missing = steps_missing_from(read_metrics(run_dir / RunFolder.METRICS), record.attempt_metrics_files(), record.resumed_from,
                                 responses_per_step)
    for step in missing:
        append_metrics(run_dir / RunFolder.METRICS, step)
    return [step.step for step in missing]


def _save_status(run_dir: Path, record: JobRecord, status: str) -> None:
    write_record(run_dir, record.model_copy(update={"status": status}))


def _result(run_dir: Path, checkpoints: Path, step: int | None, max_steps: int, resumed_from: int | None,
            already_complete: bool) -> TrainResult:
    return TrainResult(
        backend="verl", checkpoint_dir=str(checkpoints / f"global_step_{step}") if step is not None else "",
        steps_done=step or 0, max_steps=max_steps, metrics_file=str(run_dir / RunFolder.METRICS), resumed_from=resumed_from,
        already_complete=already_complete,
    )
