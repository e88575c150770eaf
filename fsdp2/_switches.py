"""Process-wide on/off switches read from the environment.

fsdp2's switches (``FSDP2_DIVERGENCE_CHECKS``, ``FSDP2_OPTIMIZER_FAST_PATH``) are read once,
at first use, and each has a function that changes it between steps. They parse alike, so
that a value one accepts the other does too, and a typo is an error rather than silently
the default: a job launched with ``=flase`` should not run with the feature it meant to
turn off.
"""

from __future__ import annotations

import os

_ON = ("1", "true", "on", "yes", "")
_OFF = ("0", "false", "off", "no")


def read_switch(name: str, on_means: str, off_means: str) -> bool:
    """The value of the environment variable ``name`` (on when unset). ``on_means`` and
    ``off_means`` say what each value does, for the error on any other value."""
    value = os.environ.get(name, "1").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(
        f"{name}={os.environ[name]!r}: expected 1 (the default: {on_means}) or 0 ({off_means})."
    )
