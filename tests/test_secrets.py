"""One redaction for every place a value is shown or stored: names, references, log lines, errors."""

from __future__ import annotations

import json
import logging
import re

import pytest
from pydantic import ValidationError

from grpo_pipeline.run.request import RunRequest
from grpo_pipeline.errors import ProfileError
from grpo_pipeline.stages.plan import resolve_profile
from grpo_pipeline.profiles.secrets import (is_secret, parse_reference, redact, scrub, secret_literal_problems,
                                           secret_name_pattern)
from grpo_pipeline.stages.environment import resolve_environment

TOKEN = "hf_aB3dE5gH7jK9mN"
DB_PASSWORD = "made-up-pass-4b81e2"
DB_URL = f"postgres://user:{DB_PASSWORD}@db/x"


@pytest.mark.parametrize(
    ("value", "parsed"),
    [("${HF_TOKEN}", ("HF_TOKEN", None)), (" ${A_B:-x y} ", ("A_B", "x y")), ("${A}b", None), ("$HF_TOKEN", None),
     ("${1A}", None), ("plain", None)],
)
def test_a_reference_is_a_whole_value(value, parsed):
    assert parse_reference(value) == parsed


def test_only_a_bare_reference_may_name_a_secret():
    env = {"HF_TOKEN": "${HF_TOKEN}", "WANDB_API_KEY": "${MY_KEY}", "DB_PASSWORD": "${DB_PASSWORD:-x}", "API_KEY": 12,
           "HCCL_BUFFSIZE": "300", "MIRROR_AUTH": "${HF_TOKEN}", "MIRROR_LOGIN": "${HF_TOKEN:-x}"}
    problems = secret_literal_problems({"env": env}, "profile file p.yaml")
    assert [p.split(" holds")[0] for p in problems] == ["profile file p.yaml: env.DB_PASSWORD", "profile file p.yaml: env.API_KEY",
                                                        "profile file p.yaml: env.MIRROR_LOGIN"]


def test_scrub_hides_this_processes_secret_values_and_url_credentials(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("SHORT_KEY", "1")  # too short to scrub: it would blank out every "1"
    assert scrub(f"GET https://user:pw@mirror/x with {TOKEN} at step 1") == "GET https://***@mirror/x with *** at step 1"
    assert redact("HTTPS_PROXY", "http://u:p@proxy:3128") == "http://***@proxy:3128" and is_secret("SHORT_KEY")


def test_a_log_line_or_traceback_of_the_run_never_carries_a_secret_value(monkeypatch):
    from grpo_pipeline.tasks.policy import RunLogFilter

    monkeypatch.setenv("WANDB_API_KEY", TOKEN)
    try:
        raise RuntimeError(f"login failed for key {TOKEN}")
    except RuntimeError as exc:
        record = logging.LogRecord("prefect.task_runs", logging.ERROR, __file__, 1, "retrying with %s", (TOKEN,),
                                   (type(exc), exc, exc.__traceback__))
    assert RunLogFilter().filter(record)
    formatted = logging.Formatter().format(record)
    assert TOKEN not in formatted and "retrying with ***" in formatted and "login failed for key ***" in formatted


@pytest.mark.parametrize(
    "overrides",
    [[f"env.HF_TOKEN={TOKEN}"], [f"env={{API_KEY: {TOKEN}}}"], [f"env.MY_PASSWORD=${{MY_PASSWORD:-{TOKEN}}}"],
     [f"env.HF_TOKEN:{TOKEN}"]],
    ids=["literal", "mapping", "reference-default", "no-equals"],
)
def test_a_run_request_from_the_ui_refuses_a_secret_without_echoing_it(overrides):
    """The flow's parameters are validated when a deployment's run starts: the refusal, as Prefect
    words it for the run's state message, never holds the value."""
    from prefect.exceptions import ParameterTypeError

    with pytest.raises(ValidationError) as refused:
        RunRequest(overrides=overrides)
    assert TOKEN not in str(refused.value) and TOKEN not in str(ParameterTypeError.from_validation_error(refused.value))


@pytest.mark.parametrize(
    ("address", "fragment"),
    [(f"ray://admin:{TOKEN}@head:10001", "carries no credentials"), ("head", "has no port"),
     ("gopher://head:70", "unknown scheme 'gopher'"), ("head:0", "port '0' is not a number from 1 to 65535"),
     ("bad_host!:6379", "names no valid host")],
)
def test_a_ray_address_is_checked_for_its_form_without_echoing_credentials(address, fragment):
    with pytest.raises(ValidationError, match=fragment) as refused:
        RunRequest(ray_address=address)
    assert TOKEN not in str(refused.value)
    assert RunRequest(ray_address="[fd00::1]:6379").ray_address == "[fd00::1]:6379"


@pytest.mark.parametrize(
    ("name", "secret"),
    [("HF_TOKEN", True), ("WANDB_API_KEY", True), ("AWS_SECRET_ACCESS_KEY", True), ("DB_PASSWORD", True),
     ("GITHUB_PAT_TOKEN", True), ("OPENAI_APIKEY", True), ("TOKENIZERS_PARALLELISM", False),
     ("HCCL_BUFFSIZE", False), ("KEYBOARD_LAYOUT", False),
     # Issue 44: names the first list did not know, and names of where a secret or a certificate is.
     *[(name, True) for name in ("GITHUB_PAT", "MY_AUTH", "GH_OAUTH", "HTTP_AUTHORIZATION", "BEARER", "API_JWT",
                                 "SITE_COOKIE", "SESSION_ID", "SENTRY_DSN", "PRIVATE_KEY_PEM", "CLIENT_CERT",
                                 "GCP_CREDS", "SSH_PASSPHRASE")],
     *[(name, False) for name in ("SSL_CERT_FILE", "SSL_CERT_DIR", "SSH_AUTH_SOCK", "HF_TOKEN_PATH", "PATH")]],
)
def test_secret_names(name, secret):
    assert is_secret(name) is secret
    # the form's pattern (the Prefect API checks it) calls the same names secrets
    assert bool(re.fullmatch(secret_name_pattern(), name)) is secret


@pytest.mark.parametrize("name", ["HF_TOKENS", "API_KEYS", "DB_PASSWORDS", "GH_TOKEN2", "PASSWORD1", "MY_SECRETS",
                                  "ACCESS_KEYS_2", "apikeys", "SERVICE_TOKENS_PROD"])
def test_a_secrets_name_in_the_plural_or_numbered_is_a_secret(name):
    """Issue 55: the form stored `env.HF_TOKENS=<literal>` and the command line printed it."""
    assert is_secret(name)
    assert re.fullmatch(secret_name_pattern(), name)


@pytest.mark.parametrize("name", ["MAX_TOKENS", "VLLM_MAX_TOKENS", "NUM_KEYS", "MIN_TOKENS", "TOTAL_TOKENS2"])
def test_a_counted_plural_is_a_number_not_a_secret(name):
    assert not is_secret(name)
    assert not re.fullmatch(secret_name_pattern(), name)


def test_secrets_are_redacted_and_not_forwarded():
    profile = resolve_profile("tiny", "cpu", overrides=["env.WANDB_API_KEY=${WANDB_API_KEY}", "env.MY_PASSWORD=${PW_FILE_VAR}"])
    env = resolve_environment(profile, environ={"WANDB_API_KEY": "abc123456", "PW_FILE_VAR": "pw-value-123"})
    assert env.redacted()["WANDB_API_KEY"] == {"value": "***", "source": "user"}
    assert "abc123456" not in env.model_dump_json() and "pw-value-123" not in env.model_dump_json()
    assert "WANDB_API_KEY" not in env.worker_env and "MY_PASSWORD" not in env.worker_env
    driver = {"PW_FILE_VAR": "pw-value-123"}
    env.apply(driver)  # the driver gets it from its own environment, under the profile's name
    assert driver["MY_PASSWORD"] == "pw-value-123"


@pytest.mark.parametrize(
    "layer",
    [["env.WANDB_API_KEY=abc123456"], ["env={API_KEY: abc123456}"], ["env.DB_PASSWORD=${DB_PASSWORD:-abc123456}"]],
    ids=["literal", "mapping", "reference-default"],
)
def test_a_profile_never_holds_a_secret_value(layer, tmp_path):
    with pytest.raises(ProfileError, match="holds a") as raised:
        resolve_profile("tiny", "cpu", overrides=layer)
    assert "abc123456" not in str(raised.value)
    profile_file = tmp_path / "p.yaml"
    profile_file.write_text("env:\n  HF_TOKEN: abc123456\n")
    with pytest.raises(ProfileError, match="profile file .*p.yaml: env.HF_TOKEN holds a literal value"):
        resolve_profile("tiny", "cpu", profile_file=profile_file)


@pytest.mark.parametrize(
    ("overrides", "setting"),
    [([f"env.MY_DB_URL={DB_URL}"], "env.MY_DB_URL holds credentials in a URL"),
     ([f"env.MY_DB_URL=${{MY_DB_URL:-{DB_URL}}}"], "env.MY_DB_URL holds credentials in a URL"),
     ([f"env={{MY_DB_URL: '{DB_URL}'}}"], "env.MY_DB_URL holds credentials in a URL"),
     (["env.MIRROR_AUTH=${HF_TOKEN:-abc123456}"], "env.MIRROR_AUTH holds a default value in its reference"),
     ([f"data.source=https://user:{DB_PASSWORD}@mirror/data"], "data.source holds credentials in a URL"),
     ([f"model.path=https://{DB_PASSWORD}@mirror/model"], "model.path holds credentials in a URL"),
     ([f"trainer.entrypoint=python3 -m trainer --db {DB_URL}"], "trainer.entrypoint holds credentials in a URL"),
     ([f"eval.models=[/m, 'https://u:{DB_PASSWORD}@h/x']"], "eval.models[1] holds credentials in a URL"),
     ([f"https://u:{DB_PASSWORD}@h=1"], "a key of the profile holds credentials in a URL")],
    ids=["env-literal", "env-reference-default", "env-mapping", "secret-reference-default", "data-source", "model-path",
         "entrypoint", "list-item", "key"],
)
def test_a_secret_literal_is_refused_in_any_setting_naming_the_setting_never_the_value(overrides, setting):
    with pytest.raises(ProfileError) as refused:
        resolve_profile("tiny", "cpu", overrides=overrides)
    with pytest.raises(ValidationError) as refused_request:
        RunRequest(overrides=overrides)
    for message in (str(refused.value), str(refused_request.value)):
        assert f"--set: {setting}" in message and DB_PASSWORD not in message and "abc123456" not in message


def test_a_secret_value_the_shell_expanded_into_a_setting_is_refused_naming_its_variable(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    for overrides, fragment in (
        ([f"env.MIRROR={TOKEN}"], "--set: env.MIRROR holds the value of HF_TOKEN; write env.MIRROR=${HF_TOKEN}"),
        ([f"trainer.experiment_name=run-{TOKEN}"], "--set: trainer.experiment_name holds the value of HF_TOKEN"),
    ):
        with pytest.raises(ValidationError, match=re.escape(fragment)) as refused:
            RunRequest(overrides=overrides)
        assert TOKEN not in str(refused.value)
    # The project's own layers are not compared with the values: a weak secret may be one of their words.
    monkeypatch.setenv("DB_PASSWORD", "tiny-arith")
    assert resolve_profile("tiny", "cpu").trainer.experiment_name == "tiny-arith"


@pytest.mark.parametrize("field", ["model", "profile_file", "run_root"])
def test_a_run_request_refuses_credentials_in_a_url_in_any_field_without_echoing_them(field):
    with pytest.raises(ValidationError, match="holds credentials in a URL") as refused:
        RunRequest(**{field: f"https://u:{DB_PASSWORD}@mirror/x"})
    assert DB_PASSWORD not in str(refused.value)


def test_scrub_hides_what_a_secret_entry_reads_and_the_credentials_in_any_url_value(monkeypatch):
    monkeypatch.setenv("DEPLOY_PW_SOURCE", "pw-value-123")
    monkeypatch.setenv("MY_DB_URL", "postgres://user:made-up%40pass@db/x")
    assert scrub("login with pw-value-123 failed") == "login with pw-value-123 failed"  # nothing names it a secret yet
    resolve_environment(resolve_profile("tiny", "cpu", overrides=["env.MY_PASSWORD=${DEPLOY_PW_SOURCE}"]))
    assert scrub("login with pw-value-123 failed") == "login with *** failed"
    assert scrub("password 'made-up@pass' rejected for user:made-up%40pass") == "password '***' rejected for ***"


def test_the_run_plan_prefect_stores_as_a_flow_parameter_holds_no_secret_value(monkeypatch, tmp_path):
    from grpo_pipeline.stages.plan import plan_run

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("MY_DB_URL", DB_URL)
    request = RunRequest(model="tiny", device="cpu", run_root=str(tmp_path),
                         overrides=["env.MIRROR_AUTH=${HF_TOKEN}", "env.MY_DB_URL=${MY_DB_URL}"])
    plan = plan_run(request, dry_run=True)
    stored = plan.model_dump_json() + request.model_dump_json() + json.dumps(plan.summary())
    assert TOKEN not in stored and DB_PASSWORD not in stored
    assert [plan.env.values[name].secret_from for name in ("MIRROR_AUTH", "MY_DB_URL")] == ["HF_TOKEN", "MY_DB_URL"]


def test_a_stage_error_quoting_a_secret_is_raised_scrubbed_and_keeps_its_kind(monkeypatch):
    """Prefect stores a failed task's message and pickles its exception: neither may hold the value."""
    from grpo_pipeline.tasks.policy import errors_scrubbed
    from grpo_pipeline.errors import UserError

    monkeypatch.setenv("HF_TOKEN", "made-up-token-value-5150")

    def fails(kind):
        raise kind("GET https://mirror/x?token=made-up-token-value-5150 returned 500")

    for kind, raised in ((ConnectionError, RuntimeError), (UserError, UserError)):
        with pytest.raises(raised) as caught:
            errors_scrubbed(fails)(kind)
        assert "made-up-token-value-5150" not in str(caught.value) and caught.value.__cause__ is None
        assert str(caught.value) == f"{kind.__name__}: GET https://mirror/x?token=*** returned 500"
    with pytest.raises(ValueError, match="nothing secret"):  # an error without a secret is raised as it is
        errors_scrubbed(fails)(lambda message: ValueError("nothing secret"))


def test_a_value_read_by_reference_is_a_secret_whatever_its_names_unless_the_profile_marks_it_public(monkeypatch):
    """Issue 44: `env.GH=${GITHUB_PAT}` and `env.CYR=${MY_AUTH}` were stored in clear everywhere; a value
    read by reference now fails safe, whatever the names, and `public_env` shows one on purpose."""
    environ = {"GITHUB_PAT": "ghp-made-up-1234", "MY_AUTH": "made-up-auth-5678", "ODD_NAME": "made-up-odd-9012",
               "IFNAME": "eth0-made-up"}
    profile = resolve_profile("tiny", "cpu", overrides=["env.GH=${GITHUB_PAT}", "env.CYR=${MY_AUTH}",
                                                        "env.PLAIN=${ODD_NAME}", "env.IFACE=${IFNAME}",
                                                        "public_env=[IFACE]"])
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    env = resolve_environment(profile)
    shown = env.redacted()
    assert {name: shown[name]["value"] for name in ("GH", "CYR", "PLAIN", "IFACE")} == {
        "GH": "***", "CYR": "***", "PLAIN": "***", "IFACE": "eth0-made-up"}
    stored = env.model_dump_json() + json.dumps(env.worker_env)
    assert not [value for name, value in environ.items() if name != "IFNAME" and value in stored]
    assert env.worker_env["IFACE"] == "eth0-made-up" and "GH" not in env.worker_env
    assert scrub("GH is ghp-made-up-1234, ODD is made-up-odd-9012") == "GH is ***, ODD is ***"
    driver = dict(environ)
    env.apply(driver)  # the driver still gets each one, under the entry's name
    assert (driver["GH"], driver["CYR"], driver["PLAIN"]) == ("ghp-made-up-1234", "made-up-auth-5678", "made-up-odd-9012")


@pytest.mark.parametrize(("overrides", "problem"), [
    (["public_env=[NOPE]"], "public_env: NOPE is no env entry of the profile"),
    (["env.HF_TOKEN=${HF_TOKEN}", "public_env=[HF_TOKEN]"], "public_env: env.HF_TOKEN is named like a secret"),
])
def test_public_env_names_an_entry_that_may_be_shown(overrides, problem):
    with pytest.raises(ProfileError, match=re.escape(problem)):
        resolve_profile("tiny", "cpu", overrides=overrides)


@pytest.mark.parametrize("field", ["run_name", "run_root", "model", "profile_file"])
def test_a_secret_value_as_a_run_name_or_run_folder_is_refused_naming_its_variable(monkeypatch, field):
    """Issue 44: `--run-name <token>` was printed by the dry run and stored in plan.json, tracking.json,
    the tracker runs and Prefect: the options stored as written get the check `--set` values get."""
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    value = {"run_root": f"/tmp/runs-{TOKEN}", "profile_file": f"{TOKEN}.yaml"}.get(field, TOKEN)
    with pytest.raises(ValidationError, match=re.escape("holds the value of HF_TOKEN, and it is stored and shown")) as refused:
        RunRequest(**{field: value})
    assert TOKEN not in str(refused.value)


def test_credentials_with_a_percent_escaped_at_are_credentials():
    address = f"ray://u:{TOKEN}%40head:10001"
    with pytest.raises(ValidationError, match="carries no credentials") as refused:
        RunRequest(ray_address=address)
    assert TOKEN not in str(refused.value)
    assert scrub(f"tried {address}") == "tried ray://***@head:10001"


def test_a_secret_with_a_line_break_is_scrubbed_line_by_line(monkeypatch):
    """Issue 55: a reward token with a line break was printed inside h11's error: the redaction matched only the
    whole value."""
    monkeypatch.setenv("REWARD_TOKEN", "first-half-4f2a9c\nsecond-half-8e1b7d")
    said = "LocalProtocolError: Illegal header value b'Bearer first-half-4f2a9c\\nsecond-half-8e1b7d' (second-half-8e1b7d)"
    shown = scrub(said)
    assert "first-half-4f2a9c" not in shown and "second-half-8e1b7d" not in shown
