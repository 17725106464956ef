"""The deployments' form (flows/form.py, run/form_rules.py): one table of cases, each checked three
ways. The form: the Prefect API's own validator against the deployment's parameter schema, as it
runs before a flow run (and its parameters) is stored. The run: `RunRequest.from_form`, what the flow
does with the form's fields. The run's YAML-based secret rules (profiles/secrets.py, what every
door applies): whatever they refuse for a secret, the form refuses before it is stored. A refusal
names the field and the rule, never the value."""

from __future__ import annotations

import inspect
import random

import pytest

from grpo_pipeline.flows.form import run_from_form
from grpo_pipeline.run.form_rules import FORM_RULES, override_lines
from grpo_pipeline.run.request import RunRequest
from grpo_pipeline.errors import ProfileError, UserError
from grpo_pipeline.profiles.loader import overrides_to_layer
from grpo_pipeline.profiles.secrets import secret_literal_problems

FORM = {name: p.default for name, p in inspect.signature(run_from_form.fn).parameters.items()
        if p.default is not inspect.Parameter.empty} | {"model": "tiny", "device": "cpu"}
SECRET = "made-up-9f3e"  # the part of a refused value no message may repeat
SEPARATORS = {"VT": "\x0b", "FF": "\x0c", "CR": "\r", "FS": "\x1c", "GS": "\x1d", "RS": "\x1e", "NEL": "\x85",
              "LS": "\u2028", "PS": "\u2029"}
SECRET_LITERAL, SECRET_DEFAULT, URL_CREDENTIALS, GRAMMAR = (rule.says for rule in FORM_RULES["overrides"])
ONE_LINE, NO_URL_CREDENTIALS = (rule.says for rule in FORM_RULES["model"])
NO_AT = FORM_RULES["ray_address"][1].says
RUN_NAME = FORM_RULES["run_name"][0].says

# (field, value, the rule that refuses it or None). The probes are all here.
CASES = [
    ("overrides", "", None),
    ("overrides", "engine.tp=4", None),
    ("overrides", "trainer.total_training_steps=3\nengine.tp=2", None),
    ("overrides", "engine.tp=4\n\nmodel.path=x\n", None),
    ("overrides", "a.b=1\r\nc.d=2", None),
    ("overrides", "trainer.total_training_steps=-3", None),
    ("overrides", "env.HF_TOKEN=${HF_TOKEN}", None),
    ("overrides", 'env.HF_TOKEN="${HF_TOKEN}"', None),
    ("overrides", "env.HF_TOKEN=' ${HF_TOKEN} '", None),
    ("overrides", "env.HF_TOKEN=${HF_TOKEN}  # exported on the worker", None),
    ("overrides", "# the worker's token\nenv.HF_TOKEN=${HF_TOKEN}", None),
    ("overrides", "env.HF_TOKEN=${OTHER_NAME}", None),
    ("overrides", "env.MIRROR_AUTH=${HF_TOKEN}", None),
    ("overrides", "env.X=${HOME:-/tmp}", None),
    ("overrides", "trainer.experiment_name=${HF_TOKEN:-as-written}", None),  # only env values are references
    ("overrides", "eval.models=[/m, 'x y', \"z\", org/model]", None),
    ("overrides", "data.source=https://mirror.example/x", None),
    ("overrides", "trainer.entrypoint=python3 -m trainer --flag=1 a:b", None),
    ("overrides", "a.b=1\x0bc.d=2", None),  # a VT splits lines, for the form as for the run
    ("overrides", f"env.HF_TOKEN={SECRET}", SECRET_LITERAL),
    ("overrides", f"env.hf_token = {SECRET}", SECRET_LITERAL),
    ("overrides", f"env.HF_TOKEN=${{HF_TOKEN:-{SECRET}}}", SECRET_LITERAL),
    ("overrides", f'env.HF_TOKEN="{SECRET}" # c', SECRET_LITERAL),
    ("overrides", "env.HF_TOKEN=", SECRET_LITERAL),
    ("overrides", "env.HF_TOKEN=${HF_TOKEN}}", SECRET_LITERAL),
    ("overrides", "env.HF_TOKEN=${HF_TOKEN}#" + SECRET, SECRET_LITERAL),
    ("overrides", f"env.HF_TOKEN=!!str {SECRET}", SECRET_LITERAL),
    ("overrides", f"a.b=&x {SECRET}\nenv.HF_TOKEN=*x", SECRET_LITERAL),
    ("overrides", f"env.HF_TOKEN=${{HF_TOKEN}}\nengine.tp=2\nenv.API_KEY={SECRET}", SECRET_LITERAL),
    *[("overrides", f"trainer.total_training_steps=2{sep}env.HF_TOKEN={SECRET}", SECRET_LITERAL)
      for sep in SEPARATORS.values()],
    ("overrides", f'env.MIRROR="${{HF_TOKEN:-{SECRET}}}"', SECRET_DEFAULT),
    ("overrides", f"env.MIRROR=${{HF_TOKEN:-{SECRET}}}", SECRET_DEFAULT),
    ("overrides", f"env.GH=${{GITHUB_PAT:-{SECRET}}}", SECRET_DEFAULT),  # PAT, AUTH, DSN...: secrets' names too
    ("overrides", f"env.MIRROR_AUTH=${{HF_TOKEN:-{SECRET}}}", SECRET_LITERAL),  # a secret-named entry first
    # Issue 55: plural, numbered and compound names, which the API stored.
    *[("overrides", f"env.{name}={SECRET}", SECRET_LITERAL) for name in ("HF_TOKENS", "API_KEYS", "DB_PASSWORDS",
                                                                         "GH_TOKEN2", "PASSWORD1")],
    ("overrides", "env.VLLM_MAX_TOKENS=4096", None),  # a number of tokens
    # Issue 44: literal secrets under secret-named keys outside env, which the API stored (HTTP 201).
    ("overrides", f"tracking.wandb.api_key={SECRET}", SECRET_LITERAL),
    ("overrides", f"tracking.mlflow.password={SECRET}", SECRET_LITERAL),
    ("overrides", f"evn.HF_TOKEN={SECRET}", SECRET_LITERAL),
    ("overrides", f"env_HF_TOKEN={SECRET}", SECRET_LITERAL),
    ("overrides", f"hf_token={SECRET}", SECRET_LITERAL),
    ("overrides", f"rollout.vllm_kwargs.hf_token={SECRET}", SECRET_LITERAL),
    ("overrides", f"env.SENTRY_DSN={SECRET}", SECRET_LITERAL),
    ("overrides", f"env.MY_COOKIE='{SECRET}'", SECRET_LITERAL),
    ("overrides", "hf_token=${HF_TOKEN}", None),  # no value stored (and the run refuses the unknown setting)
    ("overrides", "actor.ppo_max_token_len_per_gpu=16384", None),  # the profile's own settings that look like one
    ("overrides", "model.architecture.linear_num_key_heads=16", None),
    ("overrides", "engine.transformer_overrides.moe_token_dispatcher_type=alltoall", None),  # megatron-core's name
    ("overrides", "env.SSL_CERT_FILE=/etc/ssl/certs/ca.pem", None),  # where a certificate is, not a secret
    ("overrides", "env.GH=${GITHUB_PAT}", None),
    ("overrides", f"env.DB_URL=postgres://user:{SECRET}@db/x", URL_CREDENTIALS),
    ("overrides", f"data.source=https://{SECRET}@mirror/x", URL_CREDENTIALS),
    ("overrides", f"data.source=https://mirror/x  # was https://u:{SECRET}@mirror/x", URL_CREDENTIALS),
    ("overrides", f"eval.models=[/m, 'https://u:{SECRET}@h/x']", URL_CREDENTIALS),
    ("overrides", f"env={{HF_TOKEN: {SECRET}}}", GRAMMAR),
    ("overrides", f"env.HF_TOKEN.x={SECRET}", SECRET_LITERAL),
    ("overrides", f"env.HF-TOKEN={SECRET}", GRAMMAR),
    ("overrides", f"ENV.HF_TOKEN={SECRET}", SECRET_LITERAL),
    ("overrides", f"ENV.X={SECRET}", GRAMMAR),
    ("overrides", f"env.X=HF_TOKEN: {SECRET}", GRAMMAR),
    ("overrides", f'data.source="https\\x3a//u:{SECRET}@mirror/x"', GRAMMAR),
    ("overrides", f"a.b=&anchor {SECRET}", GRAMMAR),
    ("overrides", f"trainer={{<<: *x, a: {SECRET}}}", GRAMMAR),
    ("overrides", "env.X=[&a x, *a]", GRAMMAR),
    ("overrides", "env.X=|", GRAMMAR),
    ("overrides", f"data.root=/x\x00{SECRET}", GRAMMAR),
    ("overrides", "no equals sign", GRAMMAR),
    ("overrides", "a.b=1\nno equals sign", GRAMMAR),
    ("overrides", "trainer.total_training_steps", GRAMMAR),
    ("model", "tiny", None),
    ("model", "org/model", None),
    ("model", f"https://u:{SECRET}@host/x", NO_URL_CREDENTIALS),
    ("model", f"tiny\x00{SECRET}", ONE_LINE),
    ("run_root", "runs", None),
    ("run_root", f"/tmp/runs\x00{SECRET}", ONE_LINE),
    ("run_root", f"/tmp/runs\n{SECRET}", ONE_LINE),
    ("run_root", f"https://u:{SECRET}@host/runs", NO_URL_CREDENTIALS),
    ("profile_file", "profile.yaml", None),
    ("profile_file", f"p\x00{SECRET}.yaml", ONE_LINE),
    ("profile_file", f"https://u:{SECRET}@host/p.yaml", NO_URL_CREDENTIALS),
    ("ray_address", "head:6379", None),
    ("ray_address", "ray://head:10001", None),
    ("ray_address", f"ray://u:{SECRET}@head:10001", NO_AT),
    ("ray_address", f"{SECRET}@head:6379", NO_AT),
    ("ray_address", f"ray://u:{SECRET}%40head:10001", NO_AT),  # the '@' %-escaped: the same credentials
    ("ray_address", f"ray://u:{SECRET}%40head:10001".upper(), NO_AT),
    ("ray_address", f"head\x0c{SECRET}:6379", ONE_LINE),
    ("run_name", "try1", None),
    ("run_name", "two words", RUN_NAME),
]


@pytest.fixture(scope="module")
def deployment_schema():
    """The parameter schema `prefect deploy` stores with the deployment (parameter_openapi_schema)."""
    from prefect.utilities.callables import parameter_schema

    return parameter_schema(run_from_form).model_dump_for_openapi()


def form_refusal(schema: dict, parameters: dict) -> str | None:
    """What the Prefect API answers a flow run of the deployment with these parameters: its own validator
    (prefect/server/api/deployments.py, create_flow_run_from_deployment, with enforce_parameter_schema)."""
    from prefect.utilities.schema_tools.validation import ValidationError, validate

    try:
        validate(parameters, schema, raise_on_error=True)
    except ValidationError as refused:
        return str(refused)
    return None


def run_refusal(parameters: dict) -> str | None:
    try:
        RunRequest.from_form(**parameters)
    except UserError as refused:
        return str(refused)
    return None


def yaml_secret_refusal(text: str) -> list[str]:
    """The run's secret rules on the YAML-parsed layer, as every door applies them (the command line's
    --set included); a layer that does not nest (a conflict) has no secret to find."""
    try:
        layer = overrides_to_layer(override_lines(text))
    except ProfileError:
        return []
    return secret_literal_problems(layer, "--set", {})


@pytest.mark.parametrize(("field", "value", "rule"), CASES,
                         ids=[f"{field}-{index}" for index, (field, _, _) in enumerate(CASES)])
def test_the_form_and_the_run_refuse_exactly_the_same_values_by_the_same_rule_without_echoing_them(
        deployment_schema, field, value, rule):
    parameters = {**FORM, field: value}
    by_form, by_run = form_refusal(deployment_schema, parameters), run_refusal(parameters)
    if rule is None:
        assert by_form is None and by_run is None, (by_form, by_run)
    else:
        assert by_form == f"Validation failed for field '{field}'. Failure reason: {rule!r} was expected"
        assert by_run is not None and by_run.startswith(f"{field}") and by_run.endswith(f": {rule}"), by_run
        assert SECRET not in by_form and SECRET not in by_run and "\n" not in by_run
    if field == "overrides" and yaml_secret_refusal(value):
        assert rule is not None, "the run's secret rules refuse what the form stores"
    if field == "overrides" and rule is None:
        assert RunRequest(overrides=override_lines(value)).overrides == override_lines(value)  # every door accepts it


def test_the_run_names_the_line_that_breaks_a_rule():
    refusal = run_refusal({**FORM, "overrides": f"engine.tp=2\x85env.HF_TOKEN={SECRET}"})
    assert refusal == f"overrides, line 2: {SECRET_LITERAL}"


FRAGMENTS = ["${HF_TOKEN}", "${HF_TOKEN:-", "${MIRROR}", "}", SECRET, "https://", "u:p@h", "'", '"', "[", "]", ", ",
             "{", ": ", " #", "#", "&a ", "*a", "!!str ", "\\x3a", "@", " ", "-", "=", "|", "\t", "\x00",
             *["x", "/p", "1", ".5", "a:b", " y"] * 4]  # the plain pieces weigh more, so many draws are accepted
KEYS = ["ENV.HF_TOKEN", "env", "env.HF_TOKEN.x", "env.hf-token", "", *["env.HF_TOKEN", "env.MIRROR", "env.DB_KEY", "a.b"] * 3]
BREAKS = ["\n", "\r\n", *SEPARATORS.values()]


def test_generated_overrides_the_form_stores_hold_nothing_the_runs_secret_rules_refuse(deployment_schema):
    """Soundness beyond the table: random texts from the pieces of every probe; the form and the run
    agree on each, and nothing the form accepts is refused by the YAML-based secret rules."""
    draw = random.Random(36)
    accepted = 0
    for _ in range(600):
        lines = [draw.choice(KEYS) + draw.choice(["=", " = ", "=", ""]) +
                 "".join(draw.choice(FRAGMENTS) for _ in range(draw.randint(0, 4))) for _ in range(draw.randint(1, 2))]
        text = "".join(line + draw.choice(BREAKS) for line in lines[:-1]) + lines[-1]
        by_form = form_refusal(deployment_schema, {**FORM, "overrides": text})
        assert (by_form is None) == (run_refusal({**FORM, "overrides": text}) is None), repr(text)
        if by_form is None:
            accepted += 1
            assert yaml_secret_refusal(text) == [], repr(text)
    assert accepted > 50  # the draw reaches the accepted side, not only refusals


def test_empty_text_boxes_mean_the_defaults():
    request = RunRequest.from_form(**FORM)
    assert (request.overrides, request.profile_file, request.run_name, request.ray_address) == ([], None, None, None)
    assert request.run_root == "runs" and request.stages[-1] == "report"


def test_a_nul_in_a_path_is_refused_in_one_line_by_every_door():
    with pytest.raises(Exception, match=r"--run-dir must be printable characters on one line") as refused:
        RunRequest(run_root="/tmp/a\x00b")
    assert "a\x00b" not in str(refused.value)


def test_every_door_refuses_credentials_in_a_comment_of_an_override_line_which_is_stored_as_written():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="holds credentials in a URL outside its value") as refused:
        RunRequest(overrides=[f"data.source=https://mirror/x  # was https://u:{SECRET}@mirror/x"])
    assert SECRET not in str(refused.value)
