"""What the deployments' form rules cost on long hostile text: time at n and at 2n characters, side by side.

    .venv/bin/python bench/bench_form_rules.py [--chars 50000]

The Prefect API runs the form's rules (run/form_rules.py, Python's `re`) on every flow run a
deployment is asked for, on text anyone with the form sends. A backtracking regex with two runs of
blanks side by side (`[ \\t]*x?[ \\t]*`) tries every split of a long run on a line that fails: its
time grows with the square of the length (a 50,000-character line took 40-130 s before the rules
were written without such pairs). Each probe below is timed at n and 2n characters: a ratio near 2
is linear, near 4 quadratic. Compile time is left out (the patterns are compiled once, first).
"""

from __future__ import annotations

import argparse
import time

from grpo_pipeline.run.form_rules import FORM_RULES

PROBES = {  # a hostile line of about n characters, by what it repeats
    "blanks after a secret's '='": lambda n: "env.HF_TOKEN=" + " " * n + "x",
    "blanks after '=', then a NUL": lambda n: "a.b=" + " " * n + "\x00",
    "blanks in a comment, then a NUL": lambda n: "a.b=x" + " " * n + "#" + " " * n + "\x00",
    "blanks in a list, then a NUL": lambda n: "a.b=[x" + " " * n + "\x00",
    "blanks in quotes, then a NUL": lambda n: 'env.X="' + " " * n + "\x00",
    "words of a plain value, then a NUL": lambda n: "a.b=" + "x " * (n // 2) + "\x00",
    "list items, then a NUL": lambda n: "a.b=[" + " x," * (n // 3) + "\x00",
    "short lines, then a NUL": lambda n: "a.b=x  \n" * (n // 8) + "\x00",
    "a secret's default, unclosed": lambda n: "env.X=${HF_TOKEN:-" + " " * n,
}


def seconds(text: str) -> float:
    started = time.perf_counter()
    for rules in FORM_RULES.values():
        for rule in rules:
            rule.broken(text)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chars", type=int, default=50_000)
    n = parser.parse_args().chars
    seconds("compile every pattern once")
    print(f"{'probe':<40} {'n s':>8} {'2n s':>8} {'ratio':>6}")
    for name, make in PROBES.items():
        at_n, at_2n = seconds(make(n)), seconds(make(2 * n))
        print(f"{name:<40} {at_n:8.3f} {at_2n:8.3f} {at_2n / at_n:6.1f}")


if __name__ == "__main__":
    main()
