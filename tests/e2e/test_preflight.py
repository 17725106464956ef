"""The cluster preflight on a real local Ray cluster whose nodes' images differ (tests/node_images.py:
each raylet, and the workers it starts, sees its own installed packages and CANN).

    PYTHONPATH=$PWD python -m pytest -q tests/e2e/test_preflight.py

One node is healthy, one lacks vllm-ascend, one has verl 0.8.0, one has a Megatron-Bridge that does
not know the tiny model's architecture: the flow, run as a user runs it, refuses with a line per bad
node and submits nothing. A healthy cluster passing and its job running is tests/e2e/test_verl_job.py
(its cluster's nodes have the healthy image).
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
from ray.job_submission import JobSubmissionClient

from grpo_pipeline.backends import backend_for
from grpo_pipeline.backends.base import TrainingInputs, TrainingRun
from grpo_pipeline.cluster.preflight import NodesCannotRun
from grpo_pipeline.generation.plan import plan_generation
from node_images import node_image
from grpo_pipeline.stages.plan import resolve_profile
from verl_cluster import CLUSTER, EVENT_WAIT_S, flow_process, npu_cluster

pytestmark = pytest.mark.e2e
IMAGES = {
    "healthy": {},
    "no vllm-ascend": {"without": ("vllm-ascend",)},
    "verl 0.8.0": {"versions": {"verl": "0.8.0"}},
    "a bridge without Qwen3": {"bridge_knows": ["LlamaForCausalLM", "Qwen2ForCausalLM"]},
}


def _label(node) -> str:
    return f"{node.node_ip_address} ({node.node_id[:8]})"


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """4 nodes of 1 NPU, one image each (IMAGES, in order); yields the cluster and each image's node label."""
    ray.shutdown()
    root = tmp_path_factory.mktemp("images")
    made = npu_cluster(len(IMAGES), [node_image(root / f"image{i}", **spec) for i, spec in enumerate(IMAGES.values())])
    yield made, {name: _label(node) for name, node in zip(IMAGES, made.ordered_nodes)}
    ray.shutdown()
    made.shutdown()


def _nothing_submitted(address: str, run_dir: Path) -> None:
    assert [job for job in JobSubmissionClient(address).list_jobs() if job.submission_id] == []
    assert not (run_dir / "verl" / "job.json").exists()


def test_a_node_that_cannot_run_the_job_stops_the_run_before_anything_is_submitted(mixed, api_url, stores, tmp_path):
    cluster, labels = mixed
    flow = flow_process(cluster.address, tmp_path, "mixed", "cluster.nnodes=4", stores=stores, api_url=api_url)
    output, _ = flow.communicate(timeout=3 * EVENT_WAIT_S)
    assert flow.returncode == 2, output
    error = output[output.rindex("\nerror: ") + 1:].splitlines()
    assert error[0] == "error: 3 of 4 Ray nodes cannot run the train stage; nothing was submitted:"
    lines = {line.strip() for line in error[1:4]}
    assert any(line.startswith(f"node {labels['no vllm-ascend']}: vllm-ascend is not installed (") and
               "fix: install the vllm-ascend release of the node's vLLM" in line for line in lines), lines
    assert any(line.startswith(f"node {labels['verl 0.8.0']}: verl 0.8.0 is installed, the job needs verl==0.9.1 (")
               and line.endswith("fix: pip install verl==0.9.1 in the image") for line in lines), lines
    assert any(line.startswith(f"node {labels['a bridge without Qwen3']}: megatron-bridge 0.6.2 does not know "
                               "Qwen3ForCausalLM (it knows LlamaForCausalLM, Qwen2ForCausalLM) (")
               and "or set engine.vanilla_mbridge=true to use mbridge" in line for line in lines), lines
    assert not any(labels["healthy"] in line for line in error)
    assert "Traceback" not in output
    run_dir = tmp_path / "mixed"
    _nothing_submitted(cluster.address, run_dir)
    # The report names the refusal and shows what each node has, one column per image.
    report = (run_dir / "report.md").read_text()
    assert "> **The run failed.**" in report and "## Nodes" in report
    table = [line for line in report.splitlines() if line.startswith("| verl |")]
    assert table and table[0].count("0.9.1") == 3 and table[0].count("0.8.0") == 1


def _train(cluster, tmp_path, name: str, *overrides: str):
    profile = resolve_profile("tiny", "npu", overrides=[*CLUSTER, *overrides])
    run_dir = tmp_path / name
    data = tmp_path / "train.parquet"
    # The preflight reads none of it; the step count is checked against its rows before the preflight.
    pq.write_table(pa.table({"prompt": ["2 + 2 = ?"] * 4096}), data)
    inputs = TrainingInputs(model_path=str(tmp_path), train_files=[str(data)], val_files=[str(data)],
                            checkpoint_dir=str(run_dir / "checkpoints"))
    run = TrainingRun(inputs=inputs, run_dir=str(run_dir), run_name=name, devices_here=0, ray_address=cluster.address,
                      generation=plan_generation(profile))

    class Notes:
        notes, tables = [], []

        def started(self, *args): ...
        def step(self, metrics): ...
        def note(self, message): self.notes.append(message)
        def warn(self, message): ...
        def output(self, line): ...
        def nodes(self, title, table): self.tables.append(table)

    progress = Notes()
    try:
        return backend_for("verl").train(profile, run, progress), progress
    finally:
        ray.shutdown()


def test_nodes_with_the_same_image_share_one_line_and_the_fix_names_the_other_bridge(mixed, tmp_path):
    cluster, labels = mixed
    with pytest.raises(NodesCannotRun) as refused:
        _train(cluster, tmp_path, "mbridge", "cluster.nnodes=4", "engine.vanilla_mbridge=true")
    lines = str(refused.value).splitlines()
    assert lines[0] == "4 of 4 Ray nodes cannot run the train stage; nothing was submitted:"
    # mbridge is on no node: the 2 nodes with nothing else wrong share a line (the bridge they do not
    # use is not asked about), the other two name both of their problems.
    assert len(lines) == 4
    (shared,) = [line for line in lines if line.strip().startswith("2 nodes (")]
    assert labels["healthy"] in shared and labels["a bridge without Qwen3"] in shared
    assert shared.endswith(": mbridge is not installed (engine.vanilla_mbridge=true: verl builds the model with mbridge, "
                           "found by model_type qwen3); fix: install mbridge from git, pip install "
                           "git+https://github.com/ISEEKYAN/mbridge, since 0.15.1 on PyPI has no Qwen3.5; or set "
                           "engine.vanilla_mbridge=false to use Megatron-Bridge")
    (old,) = [line for line in lines if labels["verl 0.8.0"] in line]
    assert "verl 0.8.0 is installed" in old and " | mbridge is not installed" in old
    _nothing_submitted(cluster.address, tmp_path / "mbridge")


def test_a_requirement_dropped_in_the_profile_is_not_asked_for(mixed, tmp_path):
    cluster, labels = mixed
    with pytest.raises(NodesCannotRun) as refused:
        _train(cluster, tmp_path, "dropped", "cluster.nnodes=4", "requires.vllm-ascend=null", "requires.megatron-bridge=null")
    (line,) = str(refused.value).splitlines()[1:]
    assert line.strip().startswith(f"node {labels['verl 0.8.0']}: verl 0.8.0 is installed")


def test_a_node_that_does_not_answer_is_named_within_the_timeout(tmp_path):
    ray.shutdown()
    healthy, hung = node_image(tmp_path / "healthy"), node_image(tmp_path / "hung", workers_hang=True)
    cluster = npu_cluster(2, [healthy, hung])
    try:
        with pytest.raises(NodesCannotRun) as refused:
            _train(cluster, tmp_path, "hung", "cluster.preflight_timeout_s=30")
        lines = str(refused.value).splitlines()
        assert lines[0] == "1 of 2 Ray nodes cannot run the train stage; nothing was submitted:"
        assert lines[1].strip() == (f"node {_label(cluster.ordered_nodes[1])}: did not answer the preflight in 30 s (its "
                                    "Ray workers did not start, or hung: see the node's Ray logs; "
                                    "cluster.preflight_timeout_s sets the wait)")
        _nothing_submitted(cluster.address, tmp_path / "hung")
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_the_cluster_evaluation_checks_only_what_its_engines_need(mixed, tmp_path):
    from grpo_pipeline.stages.evaluate import EvalSettings

    cluster, labels = mixed
    profile = resolve_profile("tiny", "npu", overrides=[*CLUSTER, "cluster.nnodes=4"])
    settings, generate = backend_for("verl").evaluation(profile, EvalSettings.from_profile(profile, plan_generation(profile)), 0,
                                                        cluster.address, {})
    try:
        with pytest.raises(NodesCannotRun) as refused:  # before any engine is started on a node
            generate(tmp_path, [[{"role": "user", "content": "1+1="}]], settings)
    finally:
        ray.shutdown()
    # verl 0.8.0 and a bridge without the model do not matter to vLLM's engines; no vllm-ascend does
    lines = str(refused.value).splitlines()
    assert lines[0] == "1 of 4 Ray nodes cannot run the evaluate stage; nothing was started:"
    assert lines[1].strip().startswith(f"node {labels['no vllm-ascend']}: vllm-ascend is not installed")
    assert len(lines) == 2


def test_the_preflight_alone_names_what_each_image_lacks_and_submits_nothing(mixed, tmp_path, capsys):
    """`--preflight` (docs/install.md's check of a cluster's images): both stages' requirements asked
    of every node, the tables printed, exit 2 with the preflight's own lines."""
    from grpo_pipeline.flows.grpo import main

    cluster, labels = mixed
    code = main(["--model", "tiny", "--device", "npu", "--ray-address", cluster.address, "--preflight",
                 *(f"--set={item}" for item in [*CLUSTER, "cluster.nnodes=4"])])
    out, err = capsys.readouterr()
    assert code == 2
    assert "# train: preflight: 4 nodes answered" in out and "# evaluate: preflight: 4 nodes answered" in out
    assert "| can run evaluate |" in out
    assert "error: 3 of 4 Ray nodes cannot run the train stage; nothing was submitted:" in err
    assert "error: 1 of 4 Ray nodes cannot run the evaluate stage; nothing was started:" in err
    assert f"node {labels['no vllm-ascend']}: vllm-ascend is not installed" in err
    assert not ray.is_initialized()  # it let go of the cluster
    _nothing_submitted(cluster.address, tmp_path / "none")
