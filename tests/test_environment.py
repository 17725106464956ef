"""The environment stage: precedence, the proxy policy for every case form, redaction, driver apply."""

from __future__ import annotations

import pytest

from grpo_pipeline.errors import ProfileError
from grpo_pipeline.stages.plan import resolve_profile
from grpo_pipeline.stages.environment import NO_PROXY_VARS, PROXY_VARS, ray_head_host, redact, resolve_environment

PROXIES = {"http_proxy": "http://proxy:3128", "HTTPS_PROXY": "http://user:pw@proxy:3128", "ALL_PROXY": "socks5://proxy:1080"}


def env_for(policy: str, environ: dict[str, str], device: str = "npu", **kwargs):
    profile = resolve_profile("qwen3.5-122b-a10b", device, overrides=[f"proxy_policy={policy}"])
    return resolve_environment(profile, environ=environ, **kwargs)


def test_clear_removes_every_case_form_on_driver_and_workers():
    env = env_for("clear", dict(PROXIES, no_proxy="corp"))
    driver = dict(PROXIES, HOME="/root")
    env.apply(driver)
    assert not any(name in driver for name in PROXY_VARS) and driver["HOME"] == "/root"
    assert driver["HCCL_CONNECT_TIMEOUT"] == "5400"
    assert {name: env.worker_env[name] for name in PROXY_VARS} == dict.fromkeys(PROXY_VARS, "")
    assert env.proxy_actions[:3] == ["removed http_proxy", "removed HTTPS_PROXY", "removed ALL_PROXY"]


def test_bypass_cluster_keeps_proxy_and_adds_cluster_hosts_to_both_no_proxy_forms():
    env = env_for("bypass-cluster", dict(PROXIES, NO_PROXY="corp.example"), ray_address="ray://10.0.0.5:10001",
                  cluster_hosts=["node-2"])
    for name in NO_PROXY_VARS:
        hosts = env.values[name].value.split(",")
        assert hosts == ["corp.example", "localhost", "127.0.0.1", "::1", "10.0.0.5", "node-2"]
        assert env.values[name].source == "proxy-policy"
    driver = dict(PROXIES)
    env.apply(driver)
    assert driver["http_proxy"] == "http://proxy:3128"  # downloads that need the proxy still work
    assert not any(name in env.worker_env for name in PROXY_VARS)  # proxy URLs are node-local


def test_keep_changes_nothing():
    env = env_for("keep", dict(PROXIES))
    assert not any(name in env.values for name in (*PROXY_VARS, *NO_PROXY_VARS))
    assert "kept http_proxy, HTTPS_PROXY, ALL_PROXY" in env.proxy_actions[0]


def test_unknown_proxy_policy_is_a_profile_error():
    with pytest.raises(ProfileError, match="proxy_policy='sometimes'"):
        resolve_profile("tiny", "cpu", overrides=["proxy_policy=sometimes"])


@pytest.mark.parametrize(
    ("address", "host"),
    [("ray://10.0.0.5:10001", "10.0.0.5"), ("head-node:6379", "head-node"), ("auto", None), (None, None),
     ("http://[fd00::1]:8265", "fd00::1")],
)
def test_ray_head_host(address, host):
    assert ray_head_host(address) == host


def test_redaction_hides_secrets_and_proxy_credentials():
    assert redact("HF_TOKEN", "hf_abc") == "***"
    assert redact("HTTPS_PROXY", "http://user:pw@proxy:3128") == "http://***@proxy:3128"
    assert redact("TOKENIZERS_PARALLELISM", "false") == "false"


def test_npu_env_is_complete_for_ray_workers():
    env = env_for("bypass-cluster", {})
    workers = env.ray_runtime_env()["env_vars"]
    assert workers["RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"] == "1"
    assert workers["HCCL_CONNECT_TIMEOUT"] == "5400" and workers["HCCL_BUFFSIZE"] == "300"
    assert all(isinstance(v, str) for v in workers.values())


def test_user_exported_env_wins_and_is_recorded():
    profile = resolve_profile("qwen3.5-122b-a10b", "npu")
    env = resolve_environment(profile, environ={"HCCL_BUFFSIZE": "600"})
    assert env.values["HCCL_BUFFSIZE"].value == "600" and env.values["HCCL_BUFFSIZE"].source == "user"
    assert env.values["HCCL_CONNECT_TIMEOUT"].source == "profile"


def test_env_references_are_read_from_the_environment_or_reported():
    profile = resolve_profile("tiny", "cpu", overrides=["env.MIRROR=${MY_MIRROR:-https://hf-mirror.com}",
                                                       "env.NODE=${NODE_NAME}", "env.HF_TOKEN=${HF_TOKEN}",
                                                       "public_env=[MIRROR, NODE]"])
    env = resolve_environment(profile, environ={})
    assert env.values["MIRROR"].value == "https://hf-mirror.com" and env.values["MIRROR"].source == "profile"
    assert env.unset_references == ["NODE (${NODE_NAME})", "HF_TOKEN (${HF_TOKEN})"]
    with pytest.raises(ProfileError, match=r"NODE \(\$\{NODE_NAME\}\), HF_TOKEN \(\$\{HF_TOKEN\}\) refer\(s\) to a "
                       "variable that is not set"):
        env.check_references()
    env = resolve_environment(profile, environ={"MY_MIRROR": "http://m", "NODE_NAME": "n1", "HF_TOKEN": "hf_abcdef"})
    assert env.values["MIRROR"].value == "http://m" and env.values["NODE"].value == "n1" and not env.unset_references
    assert env.values["HF_TOKEN"].secret_from == "HF_TOKEN" and env.values["HF_TOKEN"].value is None
    # Not listed in public_env, a value read by reference is held as a secret (issue 44), whatever its names.
    hidden = resolve_environment(profile.model_copy(update={"public_env": []}), environ={"MY_MIRROR": "http://m"})
    assert hidden.values["MIRROR"].secret_from == "MY_MIRROR" and hidden.values["MIRROR"].value is None


SECRET = "test-secret-value-7f3a9c"


@pytest.mark.parametrize(
    ("entry", "environ", "source"),
    [("env.MIRROR_AUTH=${HF_TOKEN}", {"HF_TOKEN": SECRET}, "HF_TOKEN"),
     ("env.MY_DB_URL=${MY_DB_URL}", {"MY_DB_URL": f"postgres://user:{SECRET}@db/x"}, "MY_DB_URL"),
     ("env.HTTPS_PROXY=http://proxy:3128", {"HTTPS_PROXY": f"http://{SECRET}@proxy:3128"}, "HTTPS_PROXY"),
     ("env.MIRROR_HEADER=${MIRROR_HEADER_SRC}", {"HF_TOKEN": SECRET, "MIRROR_HEADER_SRC": f"Bearer {SECRET}"},
      "MIRROR_HEADER_SRC")],
    ids=["reads-a-secret-variable", "reads-a-url-with-credentials", "exported-proxy-with-credentials-wins",
         "reads-a-copy-of-a-secret"],
)
def test_an_entry_whose_value_is_a_secret_is_held_by_reference_and_reaches_the_driver_only(entry, environ, source):
    name = entry.split("=")[0].removeprefix("env.")
    env = resolve_environment(resolve_profile("tiny", "cpu", overrides=[entry]), environ=dict(environ))
    assert env.values[name].secret_from == source and env.values[name].value is None
    assert env.redacted()[name] == {"value": "***", "source": "user"} and name not in env.worker_env
    assert SECRET not in env.model_dump_json() + str(env.ray_runtime_env())
    driver = dict(environ)
    env.apply(driver)
    assert driver[name] == environ[source]
