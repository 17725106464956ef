"""The project's own exception types.

A `UserError` is something the person running the pipeline can fix (a bad profile, an unknown device,
a missing file, an invalid parallel layout). The CLI prints its message as one line and exits 2, and
Prefect's retry condition never retries it. Anything else is a bug or a transient fault.
"""

EXIT_USER_ERROR = 2  # what every command line of the project exits with on a UserError


class UserError(Exception):
    """Bad input: the message names what is wrong and how to fix it."""


class ProfileError(UserError):
    """A profile layer or override that does not describe a valid run."""


class DeviceError(UserError):
    """A requested device kind that is unknown or not usable on this host."""
