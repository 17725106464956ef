"""The deployments' form rules: one definition that the Prefect API checks before it stores a run's
parameters, and that the run checks again on what the form sent.

    pytest tests/test_form.py     # every case of one table, through the API's validator and the run

Prefect stores a flow run's parameters when the run is created, before any code of ours runs, and
the only check it makes then is JSON schema (Python's `re` for `pattern`). A schema cannot run YAML,
so the override box accepts a strict grammar that a regex decides completely and whose YAML reading
is known in advance, and the run accepts exactly that grammar from the form:

- lines split where `str.splitlines()` splits them (`\\n`, `\\r`, VT, FF, FS/GS/RS, NEL, U+2028/9);
- a line is blank, a `# comment`, or `KEY=VALUE` with an optional trailing `# comment`;
- KEY is dotted names (`trainer.total_training_steps`); an env entry is exactly `env.NAME`; a key with
  a secret-named part anywhere (profiles/secrets.py's rule: `tracking.wandb.api_key`, `hf_token`) holds
  a bare `${NAME}` at most, as no setting but an env entry takes a secret;
- VALUE is a plain scalar (no YAML indicator first, no `: ` or ` #` inside), a 'single-quoted' or
  "double-quoted" string without backslash escapes, or a flat [list] of those: no {mappings},
  anchors, aliases, tags, merge keys, block scalars or escapes (set nested settings by dotted keys);
- every character is printable as YAML reads it (no NUL, no control character, no BOM).

Within that grammar YAML only drops (comments, quotes, list punctuation) and never makes text, so
a check of the raw text finds whatever the run's YAML-based secret check (profiles/secrets.py)
would find in the parsed value: a secret-named key holds a bare `${NAME}`, an env entry that reads a
secret has no `:-default`, and no text holds a URL's credentials (its `@` %-escaped or not). What the form cannot know
is the worker's environment: a value equal to a secret the worker holds is refused by the run only.

A refusal names the field and the rule, never the value: Prefect's API words a failed `pattern` as
"'<value>' does not match '<pattern>'" (jsonschema's message), so each rule is written as
`if <broken> then const <rule>` (jsonschema: "'<rule>' was expected"), and the first broken rule,
in order, is the one reported, by the API and by the run alike.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from grpo_pipeline.profiles.secrets import URL_CREDENTIALS_PATTERN, secret_key_exemptions, secret_name_pattern

_BREAK_CHARS = r"[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]"  # what str.splitlines() splits on
_BREAK = rf"(?:\r\n|{_BREAK_CHARS})"
_LINE_START = rf"(?:\A|(?<={_BREAK_CHARS}))"
_LINE_END = rf"(?=\Z|{_BREAK_CHARS})"
# Printable as YAML reads it (PyYAML's reader refuses the rest), less line breaks and the BOM.
CHAR = r"[\t\x20-\x7e\xa0-\u2027\u202a-\ud7ff\ue000-\ufefe\uff00-\ufffd\U00010000-\U0010ffff]"
_NON_SPACE = rf"(?![ \t]){CHAR}"
_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
# `env.NAME` or dotted names that are not under env (ENV., Env. included: no way round the env rules).
_KEY = rf"(?:env\.{_NAME}|(?!(?i:env)\b){_NAME}(?:\.{_NAME})*)"
# YAML's indicators: none may start a plain value; `-` only as a number's sign.
_INDICATOR = r"[-?:,\[\]{}#&*!|>'\"%@`]"
_PLAIN_FIRST = rf"(?:(?!{_INDICATOR}){_NON_SPACE}|-(?=[0-9.]))"
_PLAIN_INSIDE = rf"(?:(?!:){_NON_SPACE}|:(?={_NON_SPACE}))"  # `: ` would make a mapping
_PLAIN_WORD = rf"(?:(?![:#]){_NON_SPACE}|:(?={_NON_SPACE})){_PLAIN_INSIDE}*"  # ` #` starts a comment
_PLAIN = rf"{_PLAIN_FIRST}{_PLAIN_INSIDE}*(?:[ \t]+{_PLAIN_WORD})*"
_SINGLE_QUOTED = rf"'(?:(?!'){CHAR}|'')*'"
_DOUBLE_QUOTED = rf"\"(?:(?![\"\\]){CHAR})*\""  # no backslash: no escape can hide `://` or a name
_FLOW_CHAR = rf"(?![,\[\]{{}}#]){_NON_SPACE}"
_FLOW_INSIDE = rf"(?:(?!:){_FLOW_CHAR}|:(?={_FLOW_CHAR}))"
_FLOW_PLAIN = rf"(?:(?!{_INDICATOR}){_FLOW_CHAR}|-(?=[0-9.])){_FLOW_INSIDE}*(?:[ \t]+{_FLOW_INSIDE}+)*"
_ITEM = rf"(?:{_SINGLE_QUOTED}|{_DOUBLE_QUOTED}|{_FLOW_PLAIN})"
_LIST = rf"\[[ \t]*(?:{_ITEM}[ \t]*(?:,[ \t]*{_ITEM}[ \t]*)*(?:,[ \t]*)?)?\]"
_VALUE = rf"(?:{_LIST}|{_SINGLE_QUOTED}|{_DOUBLE_QUOTED}|{_PLAIN})"
_COMMENT = rf"#{CHAR}*"
# Never two runs of blanks (or a comment and blanks) side by side: on a line that fails, a regex would
# try every split of a long run between them (quadratic); each alternative here has one way to match.
_ENTRY = rf"{_KEY}[ \t]*=(?:[ \t]*{_VALUE}(?:[ \t]+{_COMMENT}|[ \t]*)|[ \t]*{_COMMENT}|[ \t]*)"
OVERRIDE_LINE = rf"[ \t]*(?:{_ENTRY}|{_COMMENT})?"
_OVERRIDE_TEXT = rf"\A(?:{OVERRIDE_LINE}{_BREAK})*{OVERRIDE_LINE}\Z"

_SECRET = secret_name_pattern()
_REFERENCE = rf"\$\{{{_NAME}\}}"
_REFERENCE_VALUE = rf"(?:{_REFERENCE}|'[ \t]*{_REFERENCE}[ \t]*'|\"[ \t]*{_REFERENCE}[ \t]*\")"
# A key that names a secret (profiles/secrets.py `_names_a_secret`): a secret-named part anywhere
# (env.HF_TOKEN, tracking.wandb.api_key, evn.HF_TOKEN, hf_token) less the profile's own settings that only
# look like one (actor.ppo_max_token_len_per_gpu); under a free-form mapping, a key whose last part names
# one (rollout.vllm_kwargs.hf_token, not engine.transformer_overrides.moe_token_dispatcher_type).
_EXACT, _FREE = secret_key_exemptions()
_LOOKS_SECRET = "|".join(re.escape(setting) for setting in sorted(_EXACT))
_FREE_FORM = "|".join(re.escape(prefix) for prefix in _FREE)
_SECRET_KEY = (rf"(?:(?!(?:{_LOOKS_SECRET})[ \t]*=)(?!(?:{_FREE_FORM})\.)(?:{_NAME}\.)*{_SECRET}(?:\.{_NAME})*"
               rf"|(?:{_FREE_FORM})(?:\.{_NAME})*\.{secret_name_pattern(credential=True)}(?:\.{_NAME})*)")
_SECRET_LITERAL = (rf"{_LINE_START}[ \t]*{_SECRET_KEY}[ \t]*="
                   rf"(?![ \t]*{_REFERENCE_VALUE}[ \t]*(?:[ \t]{_COMMENT})?{_LINE_END})")
_SECRET_DEFAULT = rf"{_LINE_START}[ \t]*env\.{_NAME}[ \t]*=[ \t]*(?:['\"][ \t]*)?\$\{{{_SECRET}:-"
RUN_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"


class Rule(NamedTuple):
    """`pattern` found (`broken_when_found`) or not found in a field's text breaks the rule `says`."""

    pattern: str
    broken_when_found: bool
    says: str

    def broken(self, text: str) -> bool:
        return (re.search(self.pattern, text) is not None) == self.broken_when_found


ONE_LINE = Rule(rf"\A{CHAR}*\Z", False, "printable characters on one line (no NUL, control character or line break)")
_NO_URL_CREDENTIALS = Rule(URL_CREDENTIALS_PATTERN, True, "no credentials in a URL (scheme://user:password@host): "
                           "this form is stored; export them where the flow runs and name the variable")
# In order: the first rule a value breaks is the one reported.
FORM_RULES: dict[str, tuple[Rule, ...]] = {
    "model": (ONE_LINE, _NO_URL_CREDENTIALS),
    "overrides": (
        Rule(_SECRET_LITERAL, True, "a secret-named key holds only a reference, and only an env entry takes one: "
             "env.HF_TOKEN=${HF_TOKEN} (this form is stored; export the value in the worker's environment)"),
        Rule(_SECRET_DEFAULT, True, "a reference to a secret has no default value: ${HF_TOKEN}, never "
             "${HF_TOKEN:-value}"),
        _NO_URL_CREDENTIALS,
        Rule(_OVERRIDE_TEXT, False, "one KEY=VALUE a line (KEY: dotted names, env.NAME for the environment; VALUE: "
             "plain, 'quoted' or \"quoted\" without backslashes, or a [list]; no {mapping}, &anchor, *alias or "
             "!tag; a trailing # comment is fine)"),
    ),
    "run_name": (Rule(rf"\A(?:{RUN_NAME})?\Z", False, "letters, digits, '.', '_' or '-', not starting with '.', "
                      "'_' or '-' (it names a folder)"),),
    "run_root": (ONE_LINE, _NO_URL_CREDENTIALS),
    "ray_address": (ONE_LINE, Rule("[@%]", True, "no '@' nor %-escape: a Ray address carries no credentials "
                                    "(export RAY_AUTH_TOKEN where the flow runs if the cluster uses token auth)")),
    "profile_file": (ONE_LINE, _NO_URL_CREDENTIALS),
}


def json_schema(field: str) -> dict[str, Any]:
    """The field's rules for its JSON schema (`Field(json_schema_extra=...)`): `if` the first rule is
    broken `then` a `const` that no value meets (so the message is the rule's words), `else` the next."""
    schema: dict[str, Any] = {}
    for rule in reversed(FORM_RULES[field]):
        found = {"pattern": rule.pattern}
        step = {"if": found if rule.broken_when_found else {"not": found},
                "then": {"const": rule.says, "not": {"const": rule.says}}}
        schema = {**step, "else": schema} if schema else step
    return schema


def first_broken(field: str, text: str) -> str | None:
    """What the run says of a form's field that breaks a rule: the field, the rule, and for the
    overrides the line's number; never the value."""
    for rule in FORM_RULES[field]:
        if rule.broken(text):
            where = field
            if field == "overrides":
                line = next((number for number, line in enumerate(text.splitlines(), 1) if rule.broken(line)), None)
                where = f"overrides, line {line}" if line else field
            return f"{where}: {rule.says}"
    return None


def override_lines(text: str) -> list[str]:
    """The run's reading of the override box (after `first_broken` found nothing): its KEY=VALUE lines,
    split as the form's rules split them, blank and comment-only lines left out."""
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
