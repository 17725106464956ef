"""Before a verl job is submitted: the address is a Ray cluster's (refused in one line at planning
otherwise), the cluster has the nodes and devices the layout needs (waiting for nodes that join late,
bounded), and every node can read the inputs and write the checkpoints.

A real Ray cluster (`ray.cluster_utils.Cluster`, dashboard and Ray client server on) whose nodes offer
the custom `NPU` resource; nodes are added while the wait is on. What is not Ray: a tiny server on
127.0.0.1 that answers every request with 404, over HTTP/2 (as a proxy in front of the port did) or HTTP/1.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import h2.config
import h2.connection
import h2.events
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
from ray.cluster_utils import Cluster

from grpo_pipeline.cluster.ray_cluster import FREE_PORTS
from ray.job_submission import JobSubmissionClient

from grpo_pipeline.backends import backend_for
from grpo_pipeline.backends.base import TrainingInputs, TrainingRun
from grpo_pipeline.cluster.node_tasks import NotSharedError, check_paths_on_nodes
from grpo_pipeline.cluster.ray_cluster import ClusterNotReady, wait_for_nodes
from grpo_pipeline.cluster.ray_address import check_reachable, job_api_url, parse_ray_address
from grpo_pipeline.stages.plan import resolve_profile
from grpo_pipeline.generation.plan import plan_generation
from verl_cluster import ENTRYPOINT, EVENT_WAIT_S, wait_for


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def head_only(monkeypatch):
    ray.shutdown()
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    client_port = _free_port()
    cluster = Cluster(initialize_head=True, head_node_args={**FREE_PORTS, "num_cpus": 1, "resources": {"NPU": 1},
                                                            "include_dashboard": True,
                                                            "ray_client_server_port": client_port})
    cluster.client_server_address = f"ray://127.0.0.1:{client_port}"
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


class _NotFound(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_error(404)

    do_POST = do_GET

    def log_message(self, *args):
        pass


def _answer_http2_with_404(connection: socket.socket) -> None:
    """HTTP/2 without TLS (h2c, gRPC's transport): every request's answer is 404."""
    h2c = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=False))
    h2c.initiate_connection()
    with connection:
        connection.sendall(h2c.data_to_send())
        while data := connection.recv(65536):
            for event in h2c.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    h2c.send_headers(event.stream_id, [(":status", "404"), ("content-length", "0")], end_stream=True)
            connection.sendall(h2c.data_to_send())


@contextmanager
def not_ray(protocol: str) -> Iterator[int]:
    """A server on 127.0.0.1 answering 404 to everything; yields its port."""
    if protocol == "http1":
        server = ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            yield server.server_address[1]
        finally:
            server.shutdown()
            server.server_close()
        return
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:  # closed: the test is over
                return
            threading.Thread(target=_answer_http2_with_404, args=(connection,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()


@pytest.mark.parametrize("protocol", ["http2", "http1"])
def test_a_port_that_is_not_rays_is_refused_in_one_line_before_the_run_starts(cli, tmp_path, protocol):
    with not_ray(protocol) as port:
        for address, port_name in ((f"127.0.0.1:{port}", "GCS port"), (f"ray://127.0.0.1:{port}", "Ray client port")):
            done = cli("--model", "tiny", "--device", "npu", "--backend", "verl", "--ray-address", address,
                       "--run-dir", str(tmp_path / "runs"), "--set", f"data.root={tmp_path / 'data'}",
                       "--set", f"model.root={tmp_path / 'models'}")
            assert done.returncode == 2, done.stderr[-2000:]
            assert done.stderr.startswith(f"error: --ray-address: {address} is not a Ray cluster's {port_name}"), done.stderr
            assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stdout
            assert f"give the head's {port_name} (" in done.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "data").exists()  # nothing started


def test_a_ray_head_answers_the_check_and_says_where_its_job_api_is(head_only):
    check_reachable(parse_ray_address(head_only.address))
    client_server = head_only.client_server_address
    wait_for(lambda: _accepts(client_server), "the Ray client server", within_s=120)
    check_reachable(parse_ray_address(client_server))
    url = job_api_url(head_only.address)
    assert url.startswith("http://") and [job.submission_id for job in JobSubmissionClient(url).list_jobs()] == [None]


def _accepts(address: str) -> bool:
    parsed = parse_ray_address(address)
    try:
        socket.create_connection((parsed.host, parsed.port), timeout=5).close()
    except OSError:
        return False
    return True


def test_the_wait_covers_a_node_that_joins_late_and_names_what_never_came(head_only):
    notes: list[str] = []
    outcome: dict = {}
    waiting = threading.Thread(target=lambda: outcome.update(
        ready=wait_for_nodes("NPU", 2, 1, timeout_s=EVENT_WAIT_S, note=notes.append, note_every_s=1.0)))
    waiting.start()
    time.sleep(3.0)
    assert waiting.is_alive(), "the wait ended before the second node joined"
    head_only.add_node(num_cpus=1, resources={"NPU": 1})  # Ray starts nodes from the main thread only
    waiting.join(timeout=EVENT_WAIT_S)
    assert len(outcome["ready"]) == 2
    assert notes and notes[0].startswith("waiting for the Ray cluster: 1 of the 2 nodes with 1 NPU each are there")

    head_only.add_node(num_cpus=1)  # a node without NPUs: named, with what it offers
    wait_for(lambda: sum(node["Alive"] for node in ray.nodes()) == 3, "the third node")
    with pytest.raises(ClusterNotReady) as raised:
        wait_for_nodes("NPU", 3, 1, timeout_s=2, note=notes.append)
    message = str(raised.value)
    assert message.startswith("the Ray cluster is not ready after 2 s (cluster.ready_timeout_s=2): 2 of the 3 nodes with "
                              "1 NPU each are there (node ")
    assert message.count(" offers 0 NPU") == 1
    assert "start the missing nodes (ray start --address=<head>:6379 --resources='{\"NPU\": 1}')" in message


def test_every_node_must_read_the_inputs_and_write_the_checkpoints(head_only, tmp_path):
    data = tmp_path / "train.parquet"
    data.write_bytes(b"PAR1")
    assert check_paths_on_nodes({}, {"data.root": [str(data)]}, {"--run-dir": [str(tmp_path / "run")]}) == 1
    with pytest.raises(NotSharedError) as raised:
        check_paths_on_nodes({}, {"data.root": [str(tmp_path / "absent.parquet")]}, {"--run-dir": ["/proc/run"]})
    message = str(raised.value)
    assert message.startswith("data.root and --run-dir are not on storage every Ray node shares: node ")
    assert "absent.parquet: it is not there or not readable" in message and "cannot write to /proc/run" in message


def test_train_submits_nothing_to_a_cluster_without_the_nodes_it_needs(head_only, tmp_path):
    profile = resolve_profile("tiny", "npu", "verl", overrides=[
        "cluster.nnodes=2", "cluster.devices_per_node=1", "cluster.ready_timeout_s=2", "trainer.total_training_steps=2",
        ENTRYPOINT])
    run_dir = tmp_path / "short"
    data = tmp_path / "train.parquet"
    # Its rows are counted (the step count) before the cluster is waited for; nothing else reads it.
    pq.write_table(pa.table({"prompt": ["2 + 2 = ?"] * 4096}), data)
    inputs = TrainingInputs(model_path=str(tmp_path), train_files=[str(data)], val_files=[str(data)],
                            checkpoint_dir=str(run_dir / "checkpoints"))
    run = TrainingRun(inputs=inputs, run_dir=str(run_dir), run_name="short", devices_here=0, ray_address=head_only.address,
                      generation=plan_generation(profile))

    class Silent:
        def started(self, *args): ...
        def step(self, metrics): ...
        def note(self, message): ...
        def output(self, line): ...
        def nodes(self, title, table): ...

    with pytest.raises(ClusterNotReady, match=r"1 of the 2 nodes with 1 NPU each are there"):
        backend_for("verl").train(profile, run, Silent())
    assert [job for job in JobSubmissionClient(head_only.address).list_jobs() if job.submission_id] == []
    assert not (run_dir / "verl" / "job.json").exists()
