"""The engine's step loop, timed: an opt-in hook of LLMEngine (`engine.timer = StepTimer(engine)` on rank 0; None,
the default, times nothing). The engine calls it, where set, at five points of its step:

    launch(k)              step k is being queued (scheduled, before any of its device work)
    forward(run, *args)    runs the step's forward, sampling and feed (run(*args)), timed
    ready_event(k, ready)  the event to record after step k (GPU): `ready`, or one of the timer's around a timed gap
    wait(launched)         takes a queued step's tokens (launched.host_tokens()), timed
    step_done(wall)        the end of a step() call that took `wall` seconds

Its sums (seconds, since it was installed; per step = per step queued): host_s, the host time outside the forward
(schedule, plan broadcast, sampling, postprocess: a step() call's wall less its forward and its wait); forward_s,
queueing the forward, sampling and the feed; wait_s, waiting for a step's tokens to reach the host; and on a GPU
gpu_idle_s over gpu_gaps, the time the device sat idle between the end of a step and the start of the next one
queued right after it: the part of the host's time that the overlap did not hide.

A gap is timed at every GAP_EVERY-th pair of back-to-back steps only (a CUDA call costs the host 5-25 us): the end
of step k (GAP_EVERY - 1 mod GAP_EVERY) is the timer's own timing event, recorded in place of the engine's ready
event (no call added), and one more event is recorded before step k + 1's device work. Step k + 1's ready event is
the timer's too, so that the gap is read where that step's tokens are taken (both events have run by then). A
step() call that queues nothing (the device may idle for want of work) ends a run of back-to-back steps; a pause of
the caller between two calls (the bench keeps the engine busy) counts as idle.
"""
from __future__ import annotations

import time

import torch

GAP_EVERY = 8


class StepTimer:
    def __init__(self, engine):
        self.steps = 0  # steps queued on the device
        self.host_s = self.forward_s = self.wait_s = 0.0
        self.gpu_idle_s, self.gpu_gaps = 0.0, 0
        self._inner = 0.0  # forward and wait of the step() call under way
        self._queued = False  # whether the step() call under way queued a step
        self._last = None  # the number of the step queued last, while steps follow back to back
        self._gap_open = False  # a gap's start recorded, its end recorded right before it: read when taken
        self._gpu = engine.device.type == "cuda"
        if self._gpu:
            # on the stream the engine records its events on (the default stream of the thread calling step())
            self._stream = torch.cuda.current_stream(engine.device)
            self._end, self._start = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            self._after_gap = torch.cuda.Event()  # the end of the step after a timed gap

    def launch(self, k: int) -> None:
        self.steps += 1
        self._queued = True
        if self._gpu and k % GAP_EVERY == 0:
            self._start.record(self._stream)
            self._gap_open = self._last == k - 1  # the step before ended on self._end
        self._last = k

    def forward(self, run, *args):
        t0 = time.perf_counter()
        out = run(*args)
        dt = time.perf_counter() - t0
        self.forward_s += dt
        self._inner += dt
        return out

    def ready_event(self, k: int, ready):
        phase = k % GAP_EVERY
        if phase == GAP_EVERY - 1:
            return self._end
        return self._after_gap if phase == 0 else ready

    def wait(self, launched) -> list[int]:
        t0 = time.perf_counter()
        tokens = launched.host_tokens()
        dt = time.perf_counter() - t0
        self.wait_s += dt
        self._inner += dt
        if self._gap_open and launched.ready is self._after_gap:  # its step has ended: both ends of the gap have run
            self.gpu_idle_s += self._end.elapsed_time(self._start) / 1e3
            self.gpu_gaps += 1
            self._gap_open = False
        return tokens

    def step_done(self, wall: float) -> None:
        self.host_s += wall - self._inner
        self._inner = 0.0
        if not self._queued:
            self._last = None
        self._queued = False
