"""One redaction for every place a value is shown or stored: names, references, log lines, errors."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from flows.request import RunRequest
from profiles.secrets import is_secret, parse_reference, redact, scrub, secret_literal_problems

TOKEN = "hf_aB3dE5gH7jK9mN"


@pytest.mark.parametrize(
    ("value", "parsed"),
    [("${HF_TOKEN}", ("HF_TOKEN", None)), (" ${A_B:-x y} ", ("A_B", "x y")), ("${A}b", None), ("$HF_TOKEN", None),
     ("${1A}", None), ("plain", None)],
)
def test_a_reference_is_a_whole_value(value, parsed):
    assert parse_reference(value) == parsed


def test_only_a_bare_reference_may_name_a_secret():
    env = {"HF_TOKEN": "${HF_TOKEN}", "WANDB_API_KEY": "${MY_KEY}", "DB_PASSWORD": "${DB_PASSWORD:-x}", "API_KEY": 12,
           "HCCL_BUFFSIZE": "300"}
    problems = secret_literal_problems(env, "profile file p.yaml")
    assert [p.split(" holds")[0] for p in problems] == ["profile file p.yaml: env.DB_PASSWORD", "profile file p.yaml: env.API_KEY"]


def test_scrub_hides_this_processes_secret_values_and_url_credentials(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("SHORT_KEY", "1")  # too short to scrub: it would blank out every "1"
    assert scrub(f"GET https://user:pw@mirror/x with {TOKEN} at step 1") == "GET https://***@mirror/x with *** at step 1"
    assert redact("HTTPS_PROXY", "http://u:p@proxy:3128") == "http://***@proxy:3128" and is_secret("SHORT_KEY")


def test_a_log_line_or_traceback_of_the_run_never_carries_a_secret_value(monkeypatch):
    from flows.pipeline import RunLogFilter

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
