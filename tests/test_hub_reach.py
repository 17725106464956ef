"""A hub that cannot be reached, and a tracker without its credentials, are refused before the flow
starts: one line with the fix, the settings below it, exit 2, nothing started (store/hub_reach.py,
stages/plan.py). Real sockets on 127.0.0.1: a closed port refuses, a listening one accepts.

    .venv/bin/python -m pytest -q tests/test_hub_reach.py
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from grpo_pipeline.errors import HEADLINE_CHARS
from grpo_pipeline.store.hub import HubSettings, fetch_snapshot
from grpo_pipeline.store.hub_reach import HubUnreachable, first_hop, reach_problem


@pytest.fixture
def closed_port() -> int:
    """A port nothing listens on (bound, then closed: the kernel refuses connections to it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def listening_port():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield server.getsockname()[1]


@pytest.fixture(autouse=True)
def quick_tries(monkeypatch):
    monkeypatch.setattr("grpo_pipeline.store.hub_reach.REACH_PAUSE_S", 0.05)


def refusal(done) -> tuple[str, list[str]]:
    assert done.returncode == 2, (done.stdout, done.stderr)
    headline, *details = done.stderr.strip().splitlines()
    assert headline.startswith("error: ") and len(headline) <= len("error: ") + HEADLINE_CHARS, headline
    assert "Traceback" not in done.stderr and all(line.startswith("  ") for line in details)
    return headline, details


@pytest.mark.parametrize("endpoint, problem", [
    ("http://127.0.0.1:{port}", "127.0.0.1:{port} refuses connections"),
    ("https://no-such-hub.invalid", "the name no-such-hub.invalid does not resolve"),
])
def test_a_dataset_from_an_unreachable_hub_is_refused_at_planning(cli, tmp_path, monkeypatch, closed_port, endpoint,
                                                                 problem):
    endpoint = endpoint.format(port=closed_port)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    done = cli("--model", "tiny", "--device", "cpu", "--set", "data.dataset=gsm8k", "--set", f"data.root={tmp_path / 'data'}",
               "--run-dir", str(tmp_path / "runs"), env={"HF_ENDPOINT": endpoint})
    headline, details = refusal(done)
    assert headline == (f"error: cannot fetch dataset openai/gsm8k: {problem.format(port=closed_port)}; use a network "
                        "that reaches it, a mirror in HF_ENDPOINT, or a local copy (--set data.source=<its folder>)")
    assert details[0].startswith(f"  HF_ENDPOINT={endpoint}; HF_HUB_OFFLINE=1 only serves what is in the store, and "
                                 f"{tmp_path / 'data' / 'gsm8k'}/")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "data").exists()


def test_offline_without_a_copy_in_the_store_is_refused_at_planning(cli, tmp_path):
    done = cli("--model", "tiny", "--device", "cpu", "--set", "data.dataset=gsm8k", "--set", f"data.root={tmp_path}",
               "--run-dir", str(tmp_path / "runs"), env={"HF_HUB_OFFLINE": "1"})
    headline, details = refusal(done)
    assert headline.startswith("error: cannot fetch dataset openai/gsm8k: HF_HUB_OFFLINE is set and the store has no copy")
    assert details[0].startswith(f"  the store's place for it: {tmp_path / 'gsm8k'}/")


def test_the_hub_is_not_asked_for_what_the_run_does_not_fetch(cli, tmp_path, closed_port):
    """The built-in dataset and model: no hub, so an unreachable HF_ENDPOINT changes nothing at planning."""
    done = cli("--model", "tiny", "--device", "cpu", "--dry-run", env={"HF_ENDPOINT": f"http://127.0.0.1:{closed_port}"})
    assert done.returncode == 0, done.stderr


@pytest.mark.e2e  # starts a listening server on 127.0.0.1
def test_a_listening_hub_or_proxy_is_reachable_and_no_proxy_is_honoured(listening_port, closed_port):
    assert reach_problem(f"http://127.0.0.1:{listening_port}", {}) is None
    through_proxy = {"HTTPS_PROXY": f"http://127.0.0.1:{listening_port}"}
    assert first_hop("https://no-such-hub.invalid", through_proxy) == ("127.0.0.1", listening_port)
    assert reach_problem("https://no-such-hub.invalid", through_proxy) is None
    exempt = {**through_proxy, "NO_PROXY": ".invalid"}
    assert first_hop("https://no-such-hub.invalid", exempt) == ("no-such-hub.invalid", 443)
    assert reach_problem(f"http://127.0.0.1:{closed_port}", {}) == f"127.0.0.1:{closed_port} refuses connections"


def test_a_fetch_that_cannot_connect_is_not_left_to_the_stage_retries(tmp_path, closed_port):
    """The hub went away after planning: the transfer's connection error is asked again for a few seconds,
    then said once as a refusal (a UserError: Prefect does not retry it)."""
    settings = HubSettings(endpoint=f"http://127.0.0.1:{closed_port}")
    with pytest.raises(HubUnreachable, match=f"cannot fetch dataset openai/gsm8k: 127.0.0.1:{closed_port} refuses"):
        fetch_snapshot("openai/gsm8k", "dataset", "main", None, tmp_path / "download", settings)
    assert not Path(tmp_path / "download").exists()


def test_wandb_online_without_a_key_is_refused_before_the_flow(cli, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: no `wandb login`
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    done = cli("--model", "tiny", "--device", "cpu", "--set", "tracking.trackers=[wandb]", "--run-dir", str(tmp_path / "runs"))
    headline, details = refusal(done)
    assert headline == ("error: tracking: W&B (online) needs WANDB_API_KEY, which is not set here (nor `wandb login`); "
                        "export it, or --set tracking.wandb.mode=offline") and details == []
    assert not (tmp_path / "runs").exists()


def test_a_benchmark_the_store_lacks_is_refused_offline_at_planning(cli, tmp_path):
    """eval.benchmarks are fetched from the hub too: the evaluate stage's benchmark is asked for at planning."""
    done = cli("--model", "tiny", "--device", "cpu", "--stages", "evaluate", "--set", "eval.benchmarks=[heldout,math500]",
               "--set", f"data.root={tmp_path}", "--run-dir", str(tmp_path / "runs"), env={"HF_HUB_OFFLINE": "1"})
    headline, details = refusal(done)
    assert headline.startswith("error: cannot fetch benchmark math500 (") and "HF_HUB_OFFLINE is set" in headline
    assert headline.endswith("unset it, or use eval.benchmarks without it")
    assert details[0].startswith(f"  the store's place for it: {tmp_path / 'math500'}/")
    assert not (tmp_path / "runs").exists()
