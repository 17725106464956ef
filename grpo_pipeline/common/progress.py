"""Progress of long work: a terminal bar for a person, and the same numbers for the flow's UI.

Stages use `Bar` wherever they would use tqdm. Outside a flow it is a plain tqdm bar. The Prefect
wrapper of a stage installs a sink with `reporting_to`; every bar created while it is installed
also reports `(fraction done, what)` to it, from whichever thread updates the bar (downloads run in
a thread pool), so the stage function never imports Prefect.
"""

from __future__ import annotations

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
        super().__init__(*args, **kwargs)
        # Captured here: updates may come from worker threads that do not share this context.
        self._progress_sink = _sink.get()
        # A disabled bar (TQDM_DISABLE=1, or no terminal with tqdm.auto's defaults) sets no desc.
        self._what = str(kwargs.get("desc") or "working")

    def update(self, n: float | None = 1) -> bool | None:
        displayed = super().update(n)
        if self.disable:
            self.n += n or 0  # a disabled tqdm counts nothing, and the flow's progress still needs the count
        if self._progress_sink is not None and self.total:
            self._progress_sink(min(self.n / self.total, 1.0), self._what)
        return displayed
