"""Rank 0 -> every other rank of one host: the per-step metadata (int64 messages) through shared memory.

A gloo broadcast costs the sending rank 0.14-0.44 ms per message on the 2-core CPU box (TCP plus hand-offs between
gloo's threads, slower the longer the threads slept), and with it rank 0's host time per step at TP=2 was 0.5-1.3 ms
on 2x H100: more than a whole decode step's host work. Here a message is a copy into a ring of slots in a shared
file mapping and one counter store; a worker polls the counter (spinning briefly, then yielding, then sleeping a
little longer the longer it has idled) and copies the message out. Messages longer than a slot go over gloo (the
caller's fallback), their place in the order kept by a marker in the ring: those are prefill steps, which take far
longer than the broadcast.

Layout (int64 words; each counter on a cache line of its own): [0] the number of messages written, [1] rank 0's
pid; per reader r, at LINE * (1 + r): the number of messages it has read, its pid; then `slots` slots of LINE
words of header ([0] the message length, -1: sent over the fallback) and `capacity` words of data. Rank 0 writes a
slot only once every reader has read the message that used it before.

Ordering: the writer stores the data, then the counter; a reader loads the counter, then the data. x86 keeps
stores in order and loads in order, which is all this needs; other architectures would need fences, which Python
cannot issue, so `supported()` says no there and the caller keeps gloo.
"""
from __future__ import annotations

import mmap
import os
import platform
import tempfile
import time
import uuid
from array import array


LINE = 8                 # int64 words per cache line
SLOTS = 4
CAPACITY = 16384         # int64 words per slot (128 KiB): every decode step, most mixed steps
SPIN_S, YIELD_S = 0.002, 0.05  # waiting: yield the core for this long, then sleep 50 us, from YIELD_S on 1 ms
LIVENESS_S = 1.0         # while sleeping, check this often that the peer process still exists


def supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def new_path() -> str:
    root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(root, f"qwen35-channel-{uuid.uuid4().hex}")


class HostChannel:
    """One writer (rank 0), `world - 1` readers. Rank 0 constructs it with create=True (making the file at `path`),
    the others then open the same path; once all have, rank 0 may unlink() it (the mappings stay)."""

    def __init__(self, path: str, rank: int, world: int, create: bool, slots: int = SLOTS,
                 capacity: int = CAPACITY):
        self.rank, self.readers, self.slots, self.capacity = rank, world - 1, slots, capacity
        self.path = path
        self._slot_words = LINE + capacity
        self._data0 = LINE * (1 + self.readers)
        self._acks = range(LINE, self._data0, LINE)  # each reader's count of messages read (its pid next to it)
        words = self._data0 + slots * self._slot_words
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, 8 * words)
            self._map = mmap.mmap(fd, 8 * words)
        finally:
            os.close(fd)
        self._words = memoryview(self._map).cast("q")  # loads and stores of int64 words, single and in slices
        self._seq = 0
        if rank == 0:
            self._words[1] = os.getpid()
        else:
            self._ack = LINE * rank
            self._words[self._ack + 1] = os.getpid()

    def unlink(self) -> None:
        """Remove the file (rank 0, once every rank has opened it): nothing is left behind, even after a crash."""
        if os.path.exists(self.path):
            os.unlink(self.path)

    def close(self) -> None:
        self._words.release()
        try:
            self._map.close()
        except BufferError:  # a view of it is still alive somewhere: the mapping goes with it
            pass

    # ---- rank 0 ---------------------------------------------------------------------------------------------
    def send(self, values: list[int]) -> bool:
        """Write one message (int64 values). False: too long for a slot; its marker is written and the
        caller must now send the values over its fallback, which every reader then expects."""
        seq = self._seq + 1
        words = self._words
        free = seq - self.slots  # the slot's previous message: every reader must have read it
        acks = self._acks
        if any(words[a] < free for a in acks):
            self._wait(lambda: all(words[a] >= free for a in acks), [words[a + 1] for a in acks],
                       "a worker rank to read the step metadata")
        base = self._data0 + (seq % self.slots) * self._slot_words
        n = len(values)
        fits = n <= self.capacity
        if fits:
            words[base + LINE:base + LINE + n] = array("q", values)
        words[base] = n if fits else -1
        words[0] = seq  # last: a reader that sees it sees the message
        self._seq = seq
        return fits

    # ---- the other ranks ------------------------------------------------------------------------------------
    def recv(self) -> list[int] | None:
        """The next message; None when it comes over the caller's fallback."""
        seq = self._seq + 1
        words = self._words
        if words[0] < seq:
            self._wait(lambda: words[0] >= seq, [words[1]], "rank 0's next step")
        base = self._data0 + (seq % self.slots) * self._slot_words
        n = words[base]
        out = words[base + LINE:base + LINE + n].tolist() if n >= 0 else None
        words[self._ack] = seq
        self._seq = seq
        return out

    @staticmethod
    def _wait(ready, pids: list[int], what: str) -> None:
        """Poll `ready` until true: spin, then yield the core (steps come every few ms while serving), then sleep
        (idle); a peer process that has gone away raises instead of waiting forever."""
        for _ in range(64):
            if ready():
                return
        t0 = checked = time.monotonic()
        while not ready():
            now = time.monotonic()
            if now - t0 < SPIN_S:
                os.sched_yield()
                continue
            time.sleep(50e-6 if now - t0 < YIELD_S else 1e-3)
            if now - checked > LIVENESS_S:
                checked = now
                for pid in pids:
                    if pid and not _alive(pid):
                        raise RuntimeError(f"waiting for {what}, but process {pid} has exited")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
