"""The progress a stage reports to the flow's UI, with and without a terminal bar."""

from __future__ import annotations

import pytest

from grpo_pipeline.common.progress import Bar, reporting_to


@pytest.mark.parametrize("disable", [False, True])  # True: TQDM_DISABLE=1, or no terminal
def test_the_sink_sees_the_fraction_and_what_whether_or_not_the_bar_is_shown(disable):
    seen = []
    with reporting_to(lambda fraction, what: seen.append((fraction, what))):
        with Bar(total=4, desc="hashing", disable=disable) as bar:
            bar.update(1)
            bar.update(3)
    assert seen == [(0.25, "hashing"), (1.0, "hashing")]


def test_a_bar_reports_to_the_sink_in_place_where_it_was_made_not_where_it_is_updated():
    """Downloads update bars from worker threads, which do not share the stage's context: the sink
    is taken when the bar is made."""
    seen = []
    with Bar(total=2, disable=True) as made_outside:
        with reporting_to(lambda fraction, what: seen.append(fraction)):
            made_outside.update(2)
    assert made_outside.n == 2 and seen == []
