"""The project's own exception types.

A `UserError` is something the person running the pipeline can fix (a bad profile, an unknown device,
a missing file, an invalid parallel layout). The CLI prints its first line (the problem and one fix,
about 200 characters at most) after `error:`, any further lines (the details) indented below it, and
exits 2; Prefect's retry condition never retries it. Anything else is a bug or a transient fault.
"""

EXIT_USER_ERROR = 2  # what every command line of the project exits with on a UserError
HEADLINE_CHARS = 200  # a refusal's first line: the problem and one fix, readable at a glance


class UserError(Exception):
    """Bad input: the message names what is wrong and how to fix it (first line), then any details."""


class ProfileError(UserError):
    """A profile layer or override that does not describe a valid run."""


class DoesNotFit(ProfileError):
    """A run that fits the devices found at no setting the planner could choose (planner.enforce)."""


class DeviceError(UserError):
    """A requested device kind that is unknown or not usable on this host."""


def headline_and_details(problems: list[str], prefix: str = "") -> str:
    """Several problems as one refusal: the first line of the first (its problem and fix) as the headline,
    with how many more there are; its own details and the other problems on lines below it."""
    headline, *details = problems[0].splitlines()
    more = f" (+{len(problems) - 1} more below)" if len(problems) > 1 else ""
    return "\n".join([f"{prefix}{headline}{more}", *details, *problems[1:]])
