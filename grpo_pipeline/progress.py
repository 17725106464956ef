"""Progress of long work: a terminal bar for a person, and the same numbers for the flow's UI.

    .venv/bin/python -m grpo_pipeline --model tiny --device cpu    # the bars, with the log lines above them

Stages use `Bar` wherever they would use tqdm. Outside a flow it is a plain tqdm bar. The Prefect
wrapper of a stage installs a sink with `reporting_to`; every bar created while it is installed
also reports `(fraction done, what)` to it, from whichever thread updates the bar (downloads run in
a thread pool), so the stage function never imports Prefect.

One display owns the terminal while a run goes (`terminal_owned`, the command line's): every line
written to stdout or stderr (Prefect's log, Ray's, a print) is written above the bars through
`tqdm.write`, never into a bar's line; libraries' own bars (the hub client's, transformers') are off,
so the run's bars are the only ones. Where stderr is not a terminal (a log file, CI), no bar is drawn
and the files get plain lines, without a bar's carriage returns and cursor moves.
"""

from __future__ import annotations

import io
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from tqdm.auto import tqdm

ProgressSink = Callable[[float, str], None]

_sink: ContextVar[ProgressSink | None] = ContextVar("progress_sink", default=None)


@contextmanager
def reporting_to(sink: ProgressSink) -> Iterator[None]:
    token = _sink.set(sink)
    try:
        yield
    finally:
        _sink.reset(token)


class Bar(tqdm):
    def __init__(self, *args, **kwargs):
        # Drawn on the terminal itself (not on the lines-above-the-bars stream), and only on a terminal.
        kwargs.setdefault("file", getattr(sys.stderr, "terminal", sys.stderr))
        kwargs.setdefault("disable", None)
        kwargs.setdefault("dynamic_ncols", True)
        super().__init__(*args, **kwargs)
        # Captured here: updates may come from worker threads that do not share this context.
        self._progress_sink = _sink.get()
        # A disabled bar (TQDM_DISABLE=1, or no terminal) sets no desc.
        self._what = str(kwargs.get("desc") or "working")

    def update(self, n: float | None = 1) -> bool | None:
        displayed = super().update(n)
        if self.disable:
            self.n += n or 0  # a disabled tqdm counts nothing, and the flow's progress still needs the count
        if self._progress_sink is not None and self.total:
            self._progress_sink(min(self.n / self.total, 1.0), self._what)
        return displayed


class LinesAboveBars(io.TextIOBase):
    """stdout or stderr while bars are shown: complete lines go out the way `tqdm.write` writes them (the
    bars on the terminal are cleared, the lines written, the bars drawn again below them)."""

    def __init__(self, stream, terminal):
        self.stream, self.terminal, self.pending = stream, terminal, ""

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        if lines:
            self._out("".join(line + "\n" for line in lines))
        return len(text)

    def _out(self, text: str) -> None:
        with tqdm.external_write_mode(file=self.terminal):  # the bars drawn on the terminal step aside
            self.stream.write(text)
            self.stream.flush()

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self.stream, "encoding", "utf-8")


@contextmanager
def terminal_owned() -> Iterator[None]:
    """The run's bars own the terminal for the duration (see the module's docstring)."""
    # The hub client and transformers read this when they are imported, after this point (the flow's
    # stages import them): their per-file and per-shard bars stay off, the stage's own bar says it all.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    real = {"stdout": sys.stdout, "stderr": sys.stderr}
    if not real["stderr"].isatty():
        yield
        return
    # stdout that is not the terminal (`| tee`, a file) keeps its own stream: no bar is drawn into it.
    above = {name: LinesAboveBars(stream, real["stderr"]) for name, stream in real.items() if stream.isatty()}
    # Handlers made before this (a logging set-up already done) write to the old streams: moved here.
    moved = [(handler, handler.stream) for handler in _console_handlers() if handler.stream in real.values()]
    for handler, stream in moved:
        _point(handler, above.get("stdout" if stream is real["stdout"] else "stderr", stream))
    sys.stdout, sys.stderr = above.get("stdout", real["stdout"]), above["stderr"]
    try:
        yield
    finally:
        sys.stdout, sys.stderr = real["stdout"], real["stderr"]
        for stream in above.values():
            if stream.pending:
                stream._out(stream.pending)
        for handler in _console_handlers():
            if isinstance(handler.stream, LinesAboveBars):
                _point(handler, handler.stream.stream)


def _console_handlers() -> list[logging.StreamHandler]:
    loggers = [logging.getLogger(), *(logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict))]
    return [h for logger in loggers for h in getattr(logger, "handlers", []) if isinstance(h, logging.StreamHandler)]


def _point(handler: logging.StreamHandler, stream) -> None:
    handler.setStream(stream)
    if console := getattr(handler, "console", None):  # Prefect's console handler prints through rich
        console.file = stream
