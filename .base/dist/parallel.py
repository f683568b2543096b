"""Process group and collectives for tensor parallelism: NCCL on GPU, gloo on CPU, one API.

Every rank of a torchrun job is one tensor-parallel rank. Without torchrun (or with world size 1) every collective
is a no-op, so the same model code runs on one device with no process group at all.

Two groups exist when running on GPUs: the default NCCL group for tensor collectives on the device (inside the
forward, and the sampler's candidates), and a gloo group on the host for setup and the per-step metadata (a list of
integers): a worker rank receives step N+1's metadata while its device still runs step N, which a broadcast queued
on the device behind step N's collectives would not allow. When every rank runs on this host (x86), the metadata
goes through shared memory instead (dist/host_channel.py: microseconds, where gloo takes 0.1-0.5 ms).
`all_reduce` sums small messages through torch symmetric memory instead of NCCL once `setup_symmetric_all_reduce`
has run (dist/allreduce.py: one-shot / two-shot by size, NCCL beyond).
"""
from __future__ import annotations

import datetime
import logging
import os
import pickle
import socket

import torch
import torch.distributed as torch_dist

from dist import allreduce, host_channel, push

log = logging.getLogger("qwen35.dist")

_WORLD = 1
_RANK = 0
_CPU_GROUP = None
# broadcast_ints sends this many values in its first collective (the length first); longer tensors need a second
INTS_FIRST = 1024
_ints_buffer: torch.Tensor | None = None
_CHANNEL: host_channel.HostChannel | None = None  # broadcast_ints from rank 0 through shared memory


def init_distributed(device_type: str = "cuda", timeout_s: float = 1800.0) -> tuple[int, int]:
    """Join the torchrun job described by the environment (RANK, WORLD_SIZE, MASTER_ADDR, ...).

    Returns (rank, world_size). Safe to call when not launched by torchrun: then it is TP=1 with no group.
    """
    global _WORLD, _RANK, _CPU_GROUP
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world == 1:
        _WORLD, _RANK = 1, 0
        return 0, 1
    if not torch_dist.is_initialized():
        # never NVLink multicast (NVLS): on shared hosts it can take the GPUs out of service
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        backend = "nccl" if device_type == "cuda" else "gloo"
        kwargs = {}
        if device_type == "cuda":
            local_rank = int(os.environ.get("LOCAL_RANK", rank))
            torch.cuda.set_device(local_rank)
            kwargs["device_id"] = torch.device("cuda", local_rank)
        torch_dist.init_process_group(backend, rank=rank, world_size=world,
                                      timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    _WORLD, _RANK = world, rank
    if device_type == "cuda":
        _CPU_GROUP = torch_dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    else:
        _CPU_GROUP = None  # the default group is already gloo
    if _CHANNEL is None:  # (a second call keeps the one every rank has: its message counts must stay in step)
        _open_host_channel()
    return rank, world


def _open_host_channel() -> None:
    """Every rank: the shared-memory channel for broadcast_ints when all ranks run on this host (and it is x86),
    else gloo. Collective."""
    global _CHANNEL
    channel, why = None, ""
    if _RANK == 0:
        if host_channel.supported():
            try:
                channel = host_channel.HostChannel(host_channel.new_path(), 0, _WORLD, create=True)
            except OSError as e:
                why = f"{type(e).__name__}: {e}"
        else:
            why = "not an x86 host"
    host, path, why = broadcast_object((socket.gethostname(), channel.path if channel else None, why))
    if _RANK != 0 and path is not None:
        if host != socket.gethostname():
            why = f"rank {_RANK} runs on another host"
        else:
            try:
                channel = host_channel.HostChannel(path, _RANK, _WORLD, create=False)
            except OSError as e:
                why = f"rank {_RANK}: {type(e).__name__}: {e}"
    ok = all_reduce_min_int(int(channel is not None))  # every rank has opened it (or one could not)
    if channel is not None and _RANK == 0:
        channel.unlink()  # the mappings stay; nothing is left on disk, even after a crash
    if ok:
        _CHANNEL = channel
    elif channel is not None:
        channel.close()
    if _RANK == 0:
        how = "shared memory" if ok else f"gloo ({why or 'a rank could not open the shared memory'})"
        log.info("step metadata to the other ranks: %s", how)


def setup_symmetric_all_reduce(max_graph_bytes: int, device: torch.device) -> bool:
    """Give `all_reduce` a symmetric-memory workspace (collective; CUDA at TP > 1; before any CUDA graph capture).

    Its data region holds max(max_graph_bytes, allreduce.TWO_SHOT_MAX_BYTES): every all-reduce of a captured
    decode step (at most max batch tokens x hidden) stays off NCCL. $QWEN35_ALLREDUCE=nccl keeps NCCL for all.
    An existing workspace that is big enough is kept (several runners in one process). Returns whether one is in
    use; when it cannot be set up (no peer access, an old torch) the log says why and NCCL does every all-reduce."""
    choice = os.environ.get(allreduce.ENV, "auto")
    if choice not in ("auto", "nccl", "oneshot"):
        raise ValueError(f"{allreduce.ENV} must be auto, oneshot or nccl; got {choice!r}")
    if _WORLD == 1 or torch.device(device).type != "cuda" or choice == "nccl" or allreduce.triton is None:
        return False
    data_bytes = max(max_graph_bytes, allreduce.TWO_SHOT_MAX_BYTES)
    ws = allreduce.current()
    if ws is not None and ws.data_bytes >= data_bytes:
        return True
    try:
        ws = allreduce.symmetric_workspace(data_bytes, device)
    except Exception as e:
        log.warning("symmetric-memory all-reduce unavailable on rank %d (%s: %s)", _RANK, type(e).__name__, e)
        ws = None
    if all_reduce_min_int(int(ws is not None)) == 0:  # every rank takes the same path, or none would finish
        log.warning("symmetric-memory all-reduce off: NCCL for every all-reduce")
        return False
    allreduce.install(ws)
    return True


def setup_push(slots: int, max_rows: int, hidden: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Give decode steps' layer boundaries an inbox per rank (dist/push.py: producers push their partial sums,
    consumers pull), where the symmetric-memory all-reduce is set up (collective; before any CUDA graph capture).
    $QWEN35_ALLREDUCE=oneshot keeps the one-shot kernel at every boundary (for comparisons). Returns whether one
    is in use."""
    if allreduce.current() is None or os.environ.get(allreduce.ENV, "auto") == "oneshot":
        return False
    try:
        box = push.symmetric_inbox(slots, max_rows, hidden, dtype, device)
    except Exception as e:
        log.warning("push boundaries unavailable on rank %d (%s: %s)", _RANK, type(e).__name__, e)
        box = None
    if all_reduce_min_int(int(box is not None)) == 0:
        log.warning("push boundaries off: the one-shot all-reduce at every boundary")
        return False
    push.install(box)
    return True


def destroy() -> None:
    global _WORLD, _RANK, _CPU_GROUP, _CHANNEL
    allreduce.install(None)
    push.install(None)
    if _CHANNEL is not None:
        _CHANNEL.close()
        _CHANNEL = None
    if torch_dist.is_initialized():
        torch_dist.destroy_process_group()
    _WORLD, _RANK, _CPU_GROUP = 1, 0, None


def tp_rank() -> int:
    return _RANK


def tp_size() -> int:
    return _WORLD


def is_driver() -> bool:
    """Rank 0 owns the scheduler, the sampler and the HTTP server."""
    return _RANK == 0


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over all ranks in place (the one collective after each mixer and each MoE/MLP): through the
    symmetric-memory workspace when there is one and the message fits, else the process group's (NCCL / gloo)."""
    if _WORLD > 1 and not allreduce.all_reduce_(x, allreduce.current()):
        torch_dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dim, in rank order (vocab-parallel logits)."""
    if _WORLD == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_WORLD)]
    torch_dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """Every rank's `x` (same shape and dtype everywhere), stacked in rank order: [tp, *x.shape]. For small
    messages (vocab-parallel sampling's candidates and histograms): through the symmetric-memory workspace when
    there is one and the message fits (no NCCL call inside the decode graphs), else the process group's."""
    if _WORLD == 1:
        return x[None]
    x = x.contiguous()
    out = torch.empty((_WORLD, *x.shape), dtype=x.dtype, device=x.device)
    if allreduce.all_gather_(x, out, allreduce.current()):  # through the symmetric-memory buffers
        return out
    if x.device.type == "cuda":
        torch_dist.all_gather_into_tensor(out, x)
    else:  # gloo has no all_gather_into_tensor
        torch_dist.all_gather(list(out.unbind(0)), x)
    return out


def gather_last_dim_to_driver(x: torch.Tensor) -> torch.Tensor | None:
    """Like all_gather_last_dim but only rank 0 receives the result (others get None)."""
    if _WORLD == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_WORLD)] if _RANK == 0 else None
    torch_dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=-1) if _RANK == 0 else None


def broadcast_object(obj=None, src: int = 0):
    """Send a picklable object from `src` to every rank over the CPU group; returns it on every rank. For setup
    (e.g. the model path), never per step."""
    if _WORLD == 1:
        return obj
    if _RANK == src:
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        header = torch.tensor([len(payload)], dtype=torch.int64)
    else:
        header = torch.zeros(1, dtype=torch.int64)
    torch_dist.broadcast(header, src=src, group=_CPU_GROUP)
    if _RANK == src:
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    else:
        buf = torch.empty(int(header.item()), dtype=torch.uint8)
    torch_dist.broadcast(buf, src=src, group=_CPU_GROUP)
    return obj if _RANK == src else pickle.loads(buf.numpy().tobytes())


def broadcast_ints(values: list[int] | None = None, src: int = 0) -> list[int]:
    """Send a list of int64 values from `src` to every rank; returns it on every rank (on the others a new list).
    From rank 0 through the shared-memory channel when there is one (a message too long for it follows over gloo),
    else over the host group: one collective when it holds fewer than INTS_FIRST values, two otherwise."""
    global _ints_buffer
    if _WORLD == 1:
        return values
    if _CHANNEL is not None and src == 0:
        if _RANK == 0:
            if _CHANNEL.send(values):
                return values
        else:
            got = _CHANNEL.recv()
            if got is not None:
                return got
    if _ints_buffer is None:
        _ints_buffer = torch.empty(INTS_FIRST, dtype=torch.int64)
    buf, head = _ints_buffer, INTS_FIRST - 1
    if _RANK == src:
        n = len(values)
        buf[0] = n
        buf[1:1 + min(n, head)] = torch.tensor(values[:head], dtype=torch.int64)
    torch_dist.broadcast(buf, src=src, group=_CPU_GROUP)
    if _RANK == src:
        if n > head:
            torch_dist.broadcast(torch.tensor(values[head:], dtype=torch.int64), src=src, group=_CPU_GROUP)
        return values
    n = int(buf[0])
    if n <= head:
        return buf[1:1 + n].tolist()
    rest = torch.empty(n - head, dtype=torch.int64)
    torch_dist.broadcast(rest, src=src, group=_CPU_GROUP)
    return buf[1:].tolist() + rest.tolist()


def barrier() -> None:
    if _WORLD > 1:
        torch_dist.barrier(group=_CPU_GROUP)


def all_reduce_min_int(value: int) -> int:
    """The smallest of every rank's `value` (e.g. how many KV blocks fit on every GPU)."""
    if _WORLD == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MIN, group=_CPU_GROUP)
    return int(t.item())
