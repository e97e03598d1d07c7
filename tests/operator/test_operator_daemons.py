"""The daemons' pause between rounds, with kopf's own stop flag."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import kopf
from pagoda.operator import daemons, kube


def stop_flag() -> tuple[kube.DaemonStopper, kopf.DaemonStopped]:
    """A daemon's stop flag as kopf hands it over: the setter kopf keeps, the checker the daemon gets."""
    setter = kube.DaemonStopper()
    return setter, kopf.AsyncDaemonStopperChecker(setter)


async def tasks_failed_during(sleep: Callable[[], Awaitable[object]]) -> list[BaseException]:
    """The exceptions of the tasks that `sleep` left behind failed, cancellations aside: kopf's exit
    re-raises those from `kopf.operator()` when such a task was pending as the operator stopped."""
    seen: set[asyncio.Task] = set()

    async def watch() -> None:
        while True:
            seen.update(asyncio.all_tasks())
            await asyncio.sleep(0.002)

    before = asyncio.all_tasks()
    watcher = asyncio.create_task(watch())
    await asyncio.sleep(0)
    await sleep()
    await asyncio.sleep(0.01)  # let what the sleep left finish
    watcher.cancel()
    ended = [t for t in seen - before if t is not watcher and t.done() and not t.cancelled()]
    return [t.exception() for t in ended if t.exception() is not None]


async def test_pause_leaves_no_task_failed_by_its_timeout():
    _, stopped = stop_flag()
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await tasks_failed_during(lambda: daemons.pause(stopped, 0.05)) == []
    assert loop.time() - started >= 0.05
    # kopf's own timed wait leaves one (why `pause` exists): when kopf no longer does, this fails
    failed = await tasks_failed_during(lambda: stopped.wait(0.05))
    assert [type(e) for e in failed] == [TimeoutError]


async def test_pause_ends_when_the_daemon_is_stopped():
    setter, stopped = stop_flag()
    loop = asyncio.get_running_loop()
    loop.call_later(0.02, setter.set, kopf.DaemonStoppingReason.OPERATOR_EXITING)
    started = loop.time()
    await daemons.pause(stopped, 30)
    assert loop.time() - started < 5 and stopped
