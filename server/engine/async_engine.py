"""asyncio front of the engine: a dedicated engine thread, one asyncio queue per response.

All torch work of a serving process runs on the engine thread: it loads the model, sizes the KV pool
and runs every step. Torch work from a second thread would start a second OpenMP thread team that
fights the first for the cores (served throughput fell to ~60 % of offline that way). Requests are
validated and encoded on the caller's side (`make_request`; errors raise at once, or at the first
`__anext__` of `generate`), handed to the step thread through a locked inbox, and their outputs (what
is new each step: deltas, passed on as they are) come back through `loop.call_soon_threadsafe`, once
per event loop per step, into the queue the requests of one response share (`stream_all`). A
consumer that stops iterating aborts its requests, which frees their blocks at the next loop turn.
Liveness (`alive`, `health`) is this front's: only it knows whether its loop runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from pagoda.server.engine.config import EngineArgs
from pagoda.server.engine.fault_injection import step_fault
from pagoda.server.engine.llm_engine import LLMEngine
from pagoda.server.engine.outputs import EngineStats, RequestOutput
from pagoda.server.engine.sampling_params import SamplingParams
from pagoda.server.engine.sequence import Request
from pagoda.server.engine.validation import RequestError

logger = logging.getLogger(__name__)

IDLE_ADMISSION_WAIT_S = 0.003  # negligible next to a model step, even on a GPU
# Not healthy when the loop has work but has made no progress for this long (a hung kernel, a
# stuck thread); a long CPU prefill of a full context stays well below it.
STALL_SECONDS = 120.0


class EngineDeadError(RuntimeError):
    pass


class _Stream:
    """Where the step thread delivers one request's outputs: the queue (on the caller's event loop)
    that all the requests of one response share, each output tagged with its request's index."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, index: int) -> None:
        self.loop = loop
        self.queue = queue
        self.index = index


def _deliver(items: list[tuple[_Stream, RequestOutput | BaseException]]) -> None:
    """On a stream's loop: what one step had for its streams there."""
    for stream, item in items:
        stream.queue.put_nowait((stream.index, item))


def _deliver_all(items: list[tuple[_Stream, RequestOutput | BaseException]]) -> None:
    """From the step thread: one wake-up of each event loop per step, not one per request. Each
    wake-up hands the GIL to the loop's thread while the step thread waits for it back (one per
    request cost ~8 % of served throughput at 16 streams on 2 cores)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput | BaseException]]] = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, batch in by_loop.items():
        loop.call_soon_threadsafe(_deliver, batch)


class AsyncLLMEngine:
    def __init__(self, engine_args: EngineArgs | None = None, loaded=None) -> None:
        """Cheap: the engine (model, KV pool) is built on the engine thread by `start()`."""
        self._engine_args = engine_args or EngineArgs()
        self._loaded = loaded
        self.engine: LLMEngine | None = None
        self._lock = threading.Lock()  # guards the inbox, aborts, streams and the stats snapshot
        self._wake = threading.Condition(self._lock)
        self._inbox: list[Request] = []
        self._aborts: list[str] = []
        self._streams: dict[str, _Stream] = {}
        self._stats = EngineStats()  # the engine's latest read, taken on the step thread
        # The step loop's wall time with work, and the part of it spent handing outputs to the event
        # loops (seconds, running totals: `EngineStats.loop_busy_seconds_total`, `handoff_seconds_total`)
        self._busy_seconds = 0.0
        self._handoff_seconds = 0.0
        # When the loop last finished a step or was idle (time.monotonic()): stall detection.
        self._last_progress = time.monotonic()
        # Readers of engine state (the KV views): served between two steps on the step thread.
        self._probes: list[tuple[Callable[[LLMEngine], Any], asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._parked = False  # the step thread waits idle inside the lock: engine state cannot change
        self._thread_done = False
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._error: BaseException | None = None
        self._died: asyncio.Future[BaseException] | None = None  # set when the step loop fails

    # ---- properties -------------------------------------------------------------------------------
    @property
    def engine_args(self) -> EngineArgs:
        return self._engine_args

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.engine.encode_chat(messages)

    # ---- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine thread and wait until it has built the engine (load errors raise here)."""
        if self._thread is not None:
            return
        loop = asyncio.get_running_loop()
        built: asyncio.Future[None] = loop.create_future()
        self._died = loop.create_future()
        self._thread = threading.Thread(
            target=self._run, args=(loop, built), name="pagoda-engine-loop", daemon=True
        )
        self._thread.start()
        try:
            await built
        except BaseException:
            await loop.run_in_executor(None, self._thread.join)
            self._thread = None
            raise

    async def wait_dead(self) -> BaseException:
        """Return the step loop's exception once it has failed (never returns on a healthy engine)."""
        assert self._died is not None, "start() first"
        return await asyncio.shield(self._died)

    def _fail(self, error: BaseException) -> None:
        """From another thread (a tensor-parallel worker died): the step loop raises `error`."""
        with self._lock:
            if self._error is None:
                self._error = error
            self._wake.notify()

    async def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
            self._thread = None

    # ---- requests -----------------------------------------------------------------------------------
    def make_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None, **checks: bool
    ) -> Request:
        """Validate and tokenize on the caller's thread (`LLMEngine.make_request`; raises RequestError)."""
        return self.engine.make_request(request_id, prompt, params, **checks)

    async def generate(
        self, prompt: str | list[int], params: SamplingParams | None, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """One new request's outputs; a bad one raises RequestError at the first `__anext__`."""
        request = self.make_request(request_id, prompt, params)
        async with contextlib.aclosing(self.stream_all([request])) as outputs:
            async for _, output in outputs:
                yield output

    async def stream_all(self, requests: Sequence[Request]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run requests made by `make_request` (the prompts of one response): (index, output) as they
        come, each request's last with finished=True. Leaving early aborts the ones still running."""
        ids = [request.request_id for request in requests]
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._error is not None or self._stopping:
                raise EngineDeadError("the engine loop is not running") from self._error
            taken = [rid for at, rid in enumerate(ids) if rid in self._streams or rid in ids[:at]]
            if taken:
                raise RequestError("request_id", f"{taken[0]!r} is already running")
            for index, request_id in enumerate(ids):
                self._streams[request_id] = _Stream(loop, queue, index)
            self._inbox.extend(requests)
            self._wake.notify()
        running = set(range(len(ids)))
        try:
            while running:
                index, item = await queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError("the engine loop failed") from item
                if item.finished:
                    running.discard(index)
                yield index, item
        finally:
            if running:
                self._request_abort(*(ids[index] for index in running))

    def _request_abort(self, *request_ids: str) -> None:
        with self._lock:
            for request_id in request_ids:
                self._streams.pop(request_id, None)
            self._aborts.extend(request_ids)
            self._wake.notify()

    def stats(self) -> EngineStats:
        """The engine's latest stats (taken between two steps): a plain read, any number of readers."""
        with self._lock:
            return self._stats

    # ---- liveness (only this front knows whether its loop runs) --------------------------------------
    @property
    def alive(self) -> bool:
        """The step loop runs: started, and neither failed nor shut down."""
        with self._lock:
            return self._thread is not None and not self._thread_done and self._error is None

    def health(self) -> tuple[bool, str]:
        """(alive, why): the loop thread runs and, when it has work, keeps finishing steps."""
        if not self.alive:
            return False, "engine loop is not running"
        with self._lock:
            busy = self._stats.num_running + self._stats.num_waiting > 0
            quiet_for = time.monotonic() - self._last_progress
        if busy and quiet_for > STALL_SECONDS:
            return False, f"engine loop has not finished a step for over {STALL_SECONDS:.0f} s"
        return True, "ok"

    @property
    def kv_events(self):
        return self.engine.kv_events

    async def inspect(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """fn(engine) on a consistent engine: at once while the step loop is parked idle (it cannot
        move while we hold the lock), else on the step thread right after its current step."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._thread is None or self._parked or self._thread_done or self._error is not None:
                return fn(self.engine)
            future = loop.create_future()
            self._probes.append((fn, loop, future))
            self._wake.notify()
        return await future

    def _run_probes(self) -> None:
        """On the step thread, lock held, between two steps."""
        probes, self._probes = self._probes, []
        for fn, loop, future in probes:
            try:
                result: Any = fn(self.engine)
            except Exception as exc:
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

    # ---- the engine thread ---------------------------------------------------------------------------
    def _run(self, loop: asyncio.AbstractEventLoop, built: asyncio.Future[None]) -> None:
        try:
            self.engine = engine = LLMEngine(self._engine_args, loaded=self._loaded)
        except BaseException as exc:
            loop.call_soon_threadsafe(built.set_exception, exc)
            return
        self._loaded = None  # the engine holds the model now
        engine.runner.add_failure_listener(self._fail)  # a tensor-parallel rank that dies fails the loop
        with self._lock:
            self._refresh_stats()
        loop.call_soon_threadsafe(built.set_result, None)
        fault = step_fault()
        try:
            while True:
                with self._lock:
                    was_idle = False
                    self._run_probes()
                    while not (
                        self._inbox or self._aborts or self._stopping or self._error or engine.has_unfinished()
                    ):
                        self._refresh_stats()
                        self._parked = True
                        self._wake.wait()
                        self._parked = False
                        was_idle = True
                        self._last_progress = time.monotonic()
                    if was_idle:
                        # Requests arrive in bursts (clients whose requests finished in one step
                        # send their next ones together): a moment's wait lets the whole burst share
                        # the first prefill instead of the rest waiting a full step.
                        deadline = time.monotonic() + IDLE_ADMISSION_WAIT_S
                        while not self._stopping and (left := deadline - time.monotonic()) > 0:
                            self._parked = True
                            self._wake.wait(left)
                            self._parked = False
                    if self._error is not None:
                        raise self._error
                    if self._stopping:
                        break
                    busy_since = time.perf_counter()
                    inbox, self._inbox = self._inbox, []
                    aborts, self._aborts = self._aborts, []
                    # A request whose consumer already left is never enqueued.
                    inbox = [r for r in inbox if r.request_id in self._streams]
                for request_id in aborts:  # before the inbox: a new request may reuse the id
                    engine.abort_request(request_id)
                for request in inbox:
                    engine.enqueue(request)
                if fault is not None:
                    fault()
                outputs = engine.step() if engine.has_unfinished() else []
                with self._lock:
                    delivered = []
                    for output in outputs:
                        stream = self._streams.get(output.request_id)
                        if stream is not None:
                            delivered.append((stream, output))
                            if output.finished:
                                del self._streams[output.request_id]
                    self._busy_seconds += time.perf_counter() - busy_since  # the step's part, in this refresh
                    self._refresh_stats()
                    self._last_progress = time.monotonic()
                    self._run_probes()
                # Outside the lock: the woken loop starts new requests at once instead of waiting for it.
                handoff_since = time.perf_counter()
                _deliver_all(delivered)
                handoff = time.perf_counter() - handoff_since
                self._handoff_seconds += handoff  # in the next refresh
                self._busy_seconds += handoff
        except BaseException as exc:  # the loop is dead: fail every waiting consumer
            logger.exception("engine loop failed")
            with self._lock:
                self._error = exc
                _deliver_all([(stream, exc) for stream in self._streams.values()])
                self._streams.clear()
            loop.call_soon_threadsafe(_settle, self._died, exc, None)
        finally:
            engine.shutdown()
            with self._lock:
                self._refresh_stats()
                self._run_probes()
                self._thread_done = True

    def _refresh_stats(self) -> None:
        """Called with the lock held, from the step thread only (engine state does not move meanwhile)."""
        stats = self._stats = self.engine.stats()
        stats.loop_busy_seconds_total, stats.handoff_seconds_total = self._busy_seconds, self._handoff_seconds


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
