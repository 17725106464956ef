"""The progress a stage reports to the flow's UI, with and without a terminal bar."""

from __future__ import annotations

import logging
import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import textwrap

import pytest

from grpo_pipeline.progress import Bar, reporting_to

# A run's console in miniature: two bars (one nested), log lines through a StreamHandler made before the
# terminal was taken (as Prefect's is) and one made after (as Ray's is), and a print.
CONSOLE = textwrap.dedent("""
    import logging, sys
    early = logging.getLogger("early"); early.addHandler(logging.StreamHandler(sys.stderr)); early.propagate = False
    from grpo_pipeline.progress import Bar, terminal_owned
    with terminal_owned():
        late = logging.getLogger("late"); late.addHandler(logging.StreamHandler(sys.stderr)); late.propagate = False
        with Bar(total=3, desc="GRPO steps") as outer:
            for step in range(3):
                with Bar(total=2, desc="inner", leave=False) as inner:
                    inner.update(2)
                early.warning("LINE early %d", step)
                late.warning("LINE late %d", step)
                print(f"LINE print {step}")
                outer.update(1)
    print("LINE after")
""")


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


def test_a_local_rays_default_token_auth_is_kept_without_its_warning():
    """Ray warns on every new local Ray that token auth (its default) is on; the pipeline keeps the default
    and drops that one warning, while Ray's other words (auth turned off) still show."""
    setup = pytest.importorskip("ray._private.authentication.authentication_token_setup")
    if not hasattr(setup, "_warn_token_auth_enabled"):
        pytest.skip("this Ray announces its default differently")
    from grpo_pipeline.cluster.ray_cluster import RAY_AUTH_DEFAULT_NOTICE, quiet_default_token_auth

    said: list[str] = []
    heard = logging.Handler()
    heard.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger(setup.__name__)  # Ray's loggers do not propagate to the root's handlers
    logger.addHandler(heard)
    try:
        quiet_default_token_auth()
        setup._warn_token_auth_enabled()
        setup._warn_token_auth_disabled()
    finally:
        logger.removeHandler(heard)
    assert not any(m.startswith(RAY_AUTH_DEFAULT_NOTICE) for m in said) and any("disabled" in m for m in said)


def run_console(as_terminal: bool) -> str:
    """CONSOLE's output: through a pseudo-terminal (a person's terminal), or into a pipe (a log file)."""
    env = dict(os.environ, PYTHONPATH=os.getcwd(), COLUMNS="100")
    if not as_terminal:
        done = subprocess.run([sys.executable, "-c", CONSOLE], capture_output=True, text=True, env=env, timeout=120)
        return done.stdout + done.stderr
    pid, fd = pty.fork()
    if pid == 0:  # the child: stdin, stdout and stderr are the terminal
        os.execve(sys.executable, [sys.executable, "-c", CONSOLE], env)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))  # a 100-column terminal
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.waitpid(pid, 0)
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.e2e  # runs the console in a subprocess
def test_on_a_terminal_every_line_starts_its_own_line_above_the_bars():
    out = run_console(as_terminal=True)
    assert out.count("LINE ") == 10 and "GRPO steps" in out, out
    for index in [i for i in range(len(out)) if out.startswith("LINE ", i)]:
        # A bar's line is cleared (carriage return) or ended before a log line is written: never `...]LINE`.
        assert out[index - 1] in "\r\n", repr(out[max(0, index - 60):index + 20])


@pytest.mark.e2e  # runs the console in a subprocess
def test_into_a_file_lines_are_plain_text_without_bars_or_cursor_moves():
    out = run_console(as_terminal=False)
    assert out.count("LINE ") == 10 and "GRPO steps" not in out
    assert "\r" not in out and "\x1b[A" not in out
