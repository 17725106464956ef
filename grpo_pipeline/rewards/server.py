"""A reward server (`reward.url`): completions scored by an HTTP service, in batched JSON requests.

    python -m grpo_pipeline --model tiny --device cpu --set reward.url=http://127.0.0.1:8000/score \\
        --set 'reward.token=${REWARD_TOKEN}'

The request, one POST per `reward.batch_size` completions:
`{"prompts": [[{role, content}...]...], "completions": [str...], "data_source": [...], "ground_truth": [...],
"extra_info": [{...}...]}`, with `Authorization: Bearer <token>` when `reward.token` names one. The answer:
`{"rewards": [number | null, ...]}` (or the bare list), one per completion, in order.

A request that fails in a way a second try may fix (connection refused or reset, a timeout, HTTP 5xx or 429)
is tried again `reward.retries` times with backoff; then the run stops on one line (`RewardServerDown`:
training is interrupted and the train stage's retry resumes from the latest checkpoint). An answer that can
never be right (HTTP 4xx, not JSON, the wrong count, a value that is not a number) stops the run on one
line naming it (`RewardError`, not retried). The token's value is read from the environment of the process
that scores, never stored, and never in a message.
"""

from __future__ import annotations

import os
import time
from typing import Any

from grpo_pipeline.errors import UserError
from grpo_pipeline.profiles.secrets import hold_by_reference, parse_reference, scrub
from grpo_pipeline.rewards.functions import Batch, NonFiniteReward, RewardError, Scored, non_finite, number

BACKOFF_S = 0.5
BACKOFF_MAX_S = 8.0


class RewardServerDown(RuntimeError):
    """The server did not answer usably after every retry (a fault a later attempt may get past)."""


def token_value(reference: str | None) -> str | None:
    """The token `${NAME}` names, from this process's environment (None without a reference)."""
    if not reference:
        return None
    name = parse_reference(reference)[0]
    hold_by_reference([name])  # whatever its name, its value is scrubbed from every message
    value = os.environ.get(name)
    if not value:
        raise UserError(f"reward.token={reference}: {name} is not set in this process's environment; export it "
                        "where the flow runs (and, for a cluster job, on every node before `ray start`)")
    return value


class RewardServer:
    """The client; plain settings, so Ray ships it to workers and verl's reward threads."""

    name = "server"

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 30.0, retries: int = 3,
                 batch_size: int = 64):
        self.url, self.token, self.timeout_s, self.retries, self.batch_size = url, token, timeout_s, retries, batch_size

    def __call__(self, batch: Batch, log_metric=None) -> Scored:
        values: list[float | None] = []
        for start in range(0, len(batch), self.batch_size):
            values += self._request(batch, start, min(len(batch), start + self.batch_size))
        return Scored(values=values)

    def _request(self, batch: Batch, start: int, end: int) -> list[float | None]:
        import httpx

        payload = {
            "prompts": batch.prompts[start:end], "completions": batch.completions[start:end],
            "data_source": batch.columns["data_source"][start:end], "ground_truth": batch.columns["ground_truth"][start:end],
            "extra_info": [dict(info or {}) for info in batch.columns["extra_info"][start:end]],
        }
        secret = token_value(self.token)
        headers = {"Authorization": f"Bearer {secret}"} if secret else {}
        where = f"reward server {scrub(self.url)}"
        failure = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(BACKOFF_MAX_S, BACKOFF_S * 2 ** (attempt - 1)))
            try:
                response = httpx.post(self.url, json=payload, headers=headers, timeout=self.timeout_s)
            except httpx.TimeoutException:
                failure = f"no answer within {self.timeout_s:g} s (reward.timeout_s)"
                continue
            except httpx.TransportError as exc:
                failure = f"{type(exc).__name__}: {scrub(str(exc))[:200]}"
                continue
            if response.status_code >= 500 or response.status_code == 429:
                failure = f"HTTP {response.status_code} {_said(response)}"
                continue
            if response.status_code >= 400:
                raise RewardError(f"{where} refused the batch of {batch.row(start)}..{batch.row(end - 1)}: HTTP "
                                  f"{response.status_code} {_said(response)} (not retried: check reward.url and reward.token)")
            return self._values(response, end - start, where, batch, start)
        raise RewardServerDown(f"{where} failed {self.retries + 1} times for the batch of {batch.row(start)}.."
                               f"{batch.row(end - 1)}: {failure}")

    def _values(self, response, expected: int, where: str, batch: Batch, start: int) -> list[float | None]:
        try:
            answer: Any = response.json()
        except ValueError:
            raise RewardError(f"{where} answered with something that is not JSON ({_said(response)}); it must answer "
                              '{"rewards": [...]}') from None
        rewards = answer.get("rewards") if isinstance(answer, dict) else answer
        if not isinstance(rewards, list):
            raise RewardError(f"{where} answered without a list of rewards ({_said(response)}); it must answer "
                              '{"rewards": [...]}, one number or null per completion')
        if len(rewards) != expected:
            raise RewardError(f"{where} answered {len(rewards)} rewards for {expected} completions (the batch of "
                              f"{batch.row(start)}..{batch.row(start + expected - 1)}); it must answer one per completion, in order")
        values = []
        for offset, value in enumerate(rewards):
            try:
                values.append(number(value))
            except TypeError:
                kind = NonFiniteReward if non_finite(value) else RewardError
                raise kind(f"{where} answered {str(value)[:40]!r} for {batch.row(start + offset)}: a reward is a "
                           "number or null") from None
        return values


def _said(response) -> str:
    """A short, scrubbed look at what the server said."""
    return repr(scrub(response.text.strip())[:120])
