"""Fault injection for the reliability tests: make a model step raise, as a dead kernel would.

`PAGODA_FAULT_STEP_RAISE=<path>`: once a file exists at <path>, the next step of the engine loop
raises `InjectedFault`. Read once, when the engine loop starts; unset (always, outside tests) the
loop never looks at the file system.
"""

from __future__ import annotations

import os
from collections.abc import Callable

ENV = "PAGODA_FAULT_STEP_RAISE"


class InjectedFault(RuntimeError):
    pass


def step_fault() -> Callable[[], None] | None:
    """A check to call before every model step, or None when no fault is configured."""
    path = os.environ.get(ENV)
    if not path:
        return None

    def check() -> None:
        if os.path.exists(path):
            raise InjectedFault(f"injected fault: {path} exists ({ENV})")

    return check
