"""The shared-memory channel for the per-step metadata (dist/host_channel.py) and broadcast_ints over it."""
import os
import random
import socket
import subprocess
import threading

import pytest
import torch
import torch.multiprocessing as mp

from dist import host_channel, parallel
from dist.host_channel import HostChannel

pytestmark = pytest.mark.skipif(not host_channel.supported(), reason="the channel is x86 only (gloo elsewhere)")


def _pair(world=3, **kw):
    path = host_channel.new_path()
    writer = HostChannel(path, 0, world, create=True, **kw)
    readers = [HostChannel(path, r, world, create=False, **kw) for r in range(1, world)]
    writer.unlink()
    assert not os.path.exists(path)
    return writer, readers


def test_messages_arrive_in_order_exactly_with_the_ring_wrapping():
    """Random lengths (0 .. twice a slot) through a ring of 2 slots of 16 words, readers in threads: every message
    arrives in order and exact; one too long for a slot is refused by send (the caller's fallback) and recv says
    so with None, in its place in the order."""
    writer, readers = _pair(world=3, slots=2, capacity=16)
    rng = random.Random(0)
    msgs = [[rng.randrange(-2**63, 2**63) for _ in range(rng.randrange(0, 33))] for _ in range(300)]
    got = [[] for _ in readers]

    def read(i):
        for _ in msgs:
            got[i].append(readers[i].recv())

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(readers))]
    for t in threads:
        t.start()
    sent = [writer.send(m) for m in msgs]  # blocks whenever a reader is two messages behind
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive()
    assert sent == [len(m) <= 16 for m in msgs] and not all(sent) and any(sent)
    for per_reader in got:
        for m, g, fits in zip(msgs, per_reader, sent):
            assert (g is None) if not fits else g == m
    for c in (writer, *readers):
        c.close()


def test_a_reader_whose_writer_has_exited_raises(monkeypatch):
    monkeypatch.setattr(host_channel, "LIVENESS_S", 0.05)
    monkeypatch.setattr(host_channel, "YIELD_S", 0.01)
    writer, (reader,) = _pair(world=2)
    dead = subprocess.Popen(["true"])
    dead.wait()
    writer._words[1] = dead.pid  # rank 0 "was" that process
    with pytest.raises(RuntimeError, match=f"process {dead.pid} has exited"):
        reader.recv()
    writer.close()
    reader.close()


def _broadcast_worker(rank, world, port, lengths, channel, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    if not channel:  # as on a host where the channel is not supported: gloo for everything
        host_channel.supported = lambda: False
    parallel.init_distributed("cpu")
    assert (parallel._CHANNEL is not None) == channel
    for i, n in enumerate(lengths):
        want = [j * (i + 1) - 7 - (j % 3) * 2**61 for j in range(n)]  # int64 values far from zero too
        got = parallel.broadcast_ints(want if rank == 0 else None)
        out[rank, i] = int(got == want)
    # every message went through the ring (the long ones as markers)
    out[rank, -1] = parallel._CHANNEL._seq if channel else len(lengths)
    parallel.destroy()


@pytest.mark.parametrize("world,channel", [(2, True), (3, True), (2, False)])
def test_broadcast_ints_through_shared_memory_and_its_fallback(world, channel):
    """broadcast_ints between processes goes through the channel; a message longer than a slot follows over gloo
    behind its marker, in order with the others. Without the channel, all over gloo."""
    lengths = [0, 1, 5, host_channel.CAPACITY, host_channel.CAPACITY + 1, 3, 2 * host_channel.CAPACITY, 7] * 3
    out = torch.zeros(world, len(lengths) + 1, dtype=torch.int64).share_memory_()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_broadcast_worker, args=(world, port, lengths, channel, out), nprocs=world, join=True,
                       start_method="spawn")
    assert int(out[:, :-1].sum()) == world * len(lengths)
    assert out[:, -1].tolist() == [len(lengths)] * world
