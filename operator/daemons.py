"""The pause between the rounds of the operator's kopf daemons (status refresh, autoscaler)."""

from __future__ import annotations

import asyncio
import contextlib

import kopf


async def pause(stopped: kopf.DaemonStopped, seconds: float) -> None:
    """Sleep `seconds`, or until the daemon is told to stop.

    Not `await stopped.wait(seconds)`: kopf runs that wait as a task of its own, which ends in a
    TimeoutError, and when the operator exits while one is pending, `kopf.operator()` re-raises that
    error (seen as operator exits failing in the tests, now and then). Here the timeout is raised in
    the daemon's own task, and kopf's wait task only ever ends done or cancelled.
    """
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stopped.wait(), seconds)
