"""Rank 0's asyncio front end: AsyncEngine runs LLMEngine's step loop in a background thread and hands each request's
outputs to its caller's event loop as a RequestStream. The server (server.py) checks every request before it gets
here (AsyncEngine.check_request); this module only moves requests and outputs between threads.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import sys
import threading
import time
import traceback
import weakref

import torch

from qwen35.engine import LLMEngine
from qwen35.outputs import GenerationError, RequestOutput
from scheduler.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "RequestStream", "GenerationError"]
log = logging.getLogger("qwen35.engine")


class RequestStream:
    """Async iterator of one request's RequestOutputs (`async for`); `await` on it returns itself, so both
    `async for o in engine.generate(...)` and `s = await engine.generate(...)` work. Leaving it early (a cancelled
    task, aclose(), or dropping it) aborts the request. A request the engine ends with an error (its own failure,
    a shutdown, a stalled engine) raises GenerationError after the outputs it did produce."""

    def __init__(self, owner: "AsyncEngine", request_id: str):
        self.request_id = request_id
        self._owner = owner
        self._queue: asyncio.Queue = asyncio.Queue()
        self._done = False

    def __await__(self):
        return self
        yield  # noqa: unreachable; makes __await__ a generator

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            out = await self._queue.get()
        except BaseException:  # CancelledError: the client went away
            self._leave()
            raise
        if isinstance(out, Exception):
            self._leave()  # frees it in the engine too (a no-op when the engine never had it)
            raise out
        if out.finished:
            self._done = True
            self._owner._streams.pop(self.request_id, None)
            if out.finish_reason == "error":
                raise GenerationError(f"generation failed: {out.error}")
        return out

    async def aclose(self) -> None:
        self._leave()

    def fail(self, error: GenerationError) -> None:
        """End the stream with `error` after what is already queued (event loop thread)."""
        if not self._done:
            self._queue.put_nowait(error)

    def _leave(self) -> None:
        if not self._done:
            self._done = True
            self._owner._streams.pop(self.request_id, None)
            self._owner.abort(self.request_id)

    def __del__(self):
        self._leave()


def exit_job(grace_s: float = 2.0) -> None:
    """What a stalled AsyncEngine does by default: give the error responses a moment to go out, then exit non-zero
    at once (the loop thread is stuck in a collective and can never be joined); torchrun then ends the other ranks
    and exits non-zero itself."""
    time.sleep(grace_s)
    sys.stderr.flush()
    os._exit(1)


class AsyncEngine:
    """Rank 0 front end for asyncio code: the step loop runs in a background thread; results are handed to each
    caller's event loop. add/abort requests travel to the loop thread through a queue, so the event loop never
    waits for a forward step. The loop thread sleeps on that queue while there is no work (the worker ranks then
    wait in their broadcast; a heartbeat reaches them every `heartbeat_s`).

    Liveness: with `step_timeout_s`, a watchdog thread times every step and collective of the loop thread. One that
    lasts longer means a rank is frozen or gone (rank 0 would otherwise wait in the collective for the process
    group's 30-minute timeout while /health said 200): the engine stops being ready (/health 503), every request
    in flight ends with an error, and `on_stall` runs (default exit_job: the process exits non-zero)."""

    def __init__(self, engine: LLMEngine, heartbeat_s: float = 60.0, step_timeout_s: float | None = None,
                 on_stall=exit_job):
        self.engine = engine
        self.heartbeat_s = heartbeat_s
        self.step_timeout_s = step_timeout_s
        self._on_stall = on_stall
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # put() is safe even from __del__
        # live streams by id (event loop thread); weak, so that dropping a stream reaches __del__ and aborts
        self._streams: weakref.WeakValueDictionary[str, RequestStream] = weakref.WeakValueDictionary()
        self._loop: asyncio.AbstractEventLoop | None = None  # the callers' event loop (the server has one)
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}  # loop thread only
        self._failure: GenerationError | None = None  # set once the engine no longer serves (shutdown, stall)
        self._busy_since: float | None = None  # monotonic time the loop thread entered a step or collective
        self._stats = engine.stats()
        self._running = True
        self._thread = threading.Thread(target=self._main, name="qwen35-engine", daemon=True)
        self._thread.start()
        if step_timeout_s:
            threading.Thread(target=self._watchdog, name="qwen35-watchdog", daemon=True).start()

    @property
    def ready(self) -> bool:
        return self._running and self._failure is None and self._thread.is_alive()

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """ValueError when the request can never run (any thread: the server calls it from its workers)."""
        self.engine.check_request(prompt_ids, params)

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 stream: bool = True) -> RequestStream:
        """Start a request that check_request accepted; ValueError (nothing queued) when its id is in use,
        GenerationError (status 503) once the engine has stopped serving. Must be called from a running event
        loop. With stream=False the stream yields one output, the whole completion, when the request ends (the
        engine makes no output per token for it, and the event loop is woken once)."""
        if self._failure is not None:
            raise GenerationError(str(self._failure), self._failure.status)
        if not self.ready:
            raise RuntimeError("engine is not running")
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        self._loop = loop = asyncio.get_running_loop()
        outputs = RequestStream(self, request_id)
        self._streams[request_id] = outputs
        # the loop thread holds only the queue, so dropping the stream reaches __del__ and aborts
        self._commands.put(("add", request_id, prompt_ids, params, loop, outputs._queue, stream))
        return outputs

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def fail_all(self, message: str, status: int = 503) -> None:
        """Stop serving: every request in flight ends with GenerationError(message, status) (streams after what
        they already produced), new ones are refused and /health turns 503. Thread-safe: the server calls it on
        the event loop when it shuts down, the watchdog from its own thread."""
        self._failure = GenerationError(message, status)
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is waiting any more
                self._loop.call_soon_threadsafe(self._fail_streams)

    def _fail_streams(self) -> None:
        for stream in list(self._streams.values()):
            stream.fail(GenerationError(str(self._failure), self._failure.status))

    def stats(self) -> dict:
        return dict(self._stats)

    def shutdown(self) -> None:
        """Stop the loop thread and release the worker ranks."""
        if self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join()
        self._running = False

    # ---- watchdog thread ----------------------------------------------------------------------------------------
    def _watchdog(self) -> None:
        period = min(1.0, self.step_timeout_s / 4)
        while self._thread.is_alive():
            time.sleep(period)
            since = self._busy_since
            if since is not None and time.monotonic() - since > self.step_timeout_s:
                message = (f"engine stalled: a step made no progress for {self.step_timeout_s:g} s (step "
                           f"{self.engine.num_steps + 1}, {self._stats['num_running']} requests running); a rank "
                           f"is frozen, dead or unreachable")
                log.error("%s; failing every request and ending the job", message)
                self.fail_all(message)
                self._on_stall()
                return

    @contextlib.contextmanager
    def _timed(self):
        """Mark the loop thread as inside a step or a collective, which the watchdog times."""
        self._busy_since = time.monotonic()
        try:
            yield
        finally:
            self._busy_since = None

    # ---- loop thread --------------------------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            if self.engine.device.type == "cuda":
                torch.cuda.set_device(self.engine.device)  # the current device is per thread
            while self._apply_commands(block=not self.engine.has_unfinished()):
                if self.engine.has_unfinished():
                    with self._timed():
                        outputs = self.engine.step()
                    self._deliver(outputs)
                self._stats = self.engine.stats()
        except BaseException:
            # a broken step loop must not leave clients or worker ranks hanging: die loudly, torchrun kills the rest
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one when `block`); False once asked to stop."""
        while True:
            try:
                cmd = self._commands.get(timeout=self.heartbeat_s) if block else self._commands.get_nowait()
            except queue.Empty:
                if not block:
                    return True
                with self._timed():
                    self.engine.heartbeat()
                continue
            block = False
            if cmd[0] == "add":
                _, rid, prompt_ids, params, loop, q, stream = cmd
                try:
                    self.engine.add_request(rid, prompt_ids, params, stream)
                except Exception as e:  # checked at the boundary; should it still raise, this request fails alone
                    loop.call_soon_threadsafe(q.put_nowait, GenerationError(f"{type(e).__name__}: {e}"))
                    continue
                self._sinks[rid] = (loop, q)
            elif cmd[0] == "abort":
                out = self.engine.abort_request(cmd[1])
                if out is not None:
                    self._deliver([out])
            else:
                self._running = False
                with self._timed():
                    self.engine.shutdown()
                return False

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their callers: one call into each caller's event loop per step, not one per
        output (each call takes a lock and wakes the loop through a socket: microseconds per request per step, on
        the thread that also runs the steps)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        sinks = self._sinks
        for out in outputs:
            loop, q = sinks[out.request_id] if not out.finished else sinks.pop(out.request_id)
            items = by_loop.get(loop)
            if items is None:
                items = by_loop[loop] = []
            items.append((q.put_nowait, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the caller's event loop is closed: nobody will read these requests
                for _, out in items:
                    sinks.pop(out.request_id, None)
                    self.engine.abort_request(out.request_id)


def _put_all(items: list) -> None:
    """On a caller's event loop: each output into its request's queue, in the order the step produced them."""
    for put, out in items:
        put(out)
