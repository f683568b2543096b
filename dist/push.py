"""The layer-boundary all-reduce folded into the kernels on either side of it: producers push, consumers pull.

At decode sizes the all-reduce after each mixer and each MoE is latency: the one-shot kernel (dist/allreduce.py)
stages, meets every peer in a barrier, reads every peer's buffer over NVLink and meets them again, ~10 us a
boundary at TP=4. Here the kernel that computes this rank's partial sums (the out projection's GEMV, the MoE's
down + combine, or push_ after a GEMM that cannot) writes them straight into every rank's inbox and raises a flag
there; the kernel that needs the sum (the next GEMV with the norm folded in, or layers/norm.py's pull kernel) waits for the
flags of its own inbox and sums locally. One one-way NVLink latency on the path, no barrier, no extra launch.

Every rank owns one inbox in symmetric memory (every rank can store into every inbox):

    [0, 16)       the epoch: int32, this rank's count of forwards (begin_step bumps it)
    flags         [slots, P] int32: flag [i, p] = the epoch in which rank p pushed boundary i
    counters      [slots] int32: the producers' arrival counters (local; zero between launches)
    regions       [slots, P, max_rows, hidden] of the model dtype: rank p's partial sums of boundary i

A forward numbers its boundaries 0, 1, ... in the order its producers run (`claim`), the same on every rank (SPMD).
Producer of boundary i on rank r: each program stores its tile into region [i, r] of every inbox, then counts
itself in (acq_rel, system scope: its stores are visible everywhere before its count); the last program resets
the counter and stores the epoch into flag [i, r] of every inbox (release, system scope).
Consumer of boundary i: waits until flag [i, p] of its own inbox equals its epoch for every p (acquire), then sums
region [i, 0..P-1] in rank order in fp32 and rounds once: identical bits on every rank, and the same bits as the
one-shot kernel's sum.

Why no barrier after the reads: rank p rewrites region [i, p] only in the next forward, after it has consumed that
forward's boundaries up to i, so after every peer has pushed boundary i - 1 or later of that forward, which each
did only after consuming boundary i of this one (its kernels run in stream order). A flag from an earlier forward
never equals the current epoch; every rank runs the same forwards, so the epochs agree.

On the CPU the same kernels run through Triton's interpreter over any buffers with known addresses (tests: P
simulated inboxes in one process, P processes sharing memory).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dist.allreduce import peer_buffer

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

MAX_ROWS = 8        # rows of the decode steps that push (batch <= 8: the GEMVs and down + combine push themselves)
HEADER_BYTES = 16


def _align16(n: int) -> int:
    return -(-n // 16) * 16


@dataclass
class Inbox:
    """Every rank's inbox, at ptrs[p] in this process's address space; `keep` holds what owns the memory.
    Offsets are in elements of the type read there (int32 for flags and counters, `dtype` for the regions)."""
    ptrs: list[int]
    rank: int
    slots: int
    max_rows: int
    hidden: int
    dtype: torch.dtype
    device: torch.device
    keep: object = None
    table: torch.Tensor = field(init=False)
    next_slot: int = field(init=False, default=0)

    def __post_init__(self):
        if any(p % 16 for p in self.ptrs):
            raise ValueError("every inbox must start 16-byte aligned")
        if not 0 <= self.rank < len(self.ptrs):
            raise ValueError(f"rank {self.rank} outside the {len(self.ptrs)} inboxes")
        self.table = torch.tensor(self.ptrs, dtype=torch.int64, device=self.device)

    @property
    def world(self) -> int:
        return len(self.ptrs)

    @property
    def flags_off(self) -> int:
        return HEADER_BYTES // 4

    @property
    def counters_off(self) -> int:
        return self.flags_off + self.slots * self.world

    @property
    def regions_byte_off(self) -> int:
        return _align16(HEADER_BYTES + 4 * self.slots * (self.world + 1))

    @property
    def regions_off(self) -> int:
        return self.regions_byte_off // self.dtype.itemsize

    @property
    def region_stride(self) -> int:
        """Elements of one (boundary, source rank) region."""
        return self.max_rows * self.hidden

    def claim(self) -> int:
        """The next boundary of this forward (its producer claims it; the consumer reads its Pushed)."""
        i = self.next_slot
        if i >= self.slots:
            raise RuntimeError(f"a forward pushed more than the inbox's {self.slots} boundaries")
        self.next_slot += 1
        return i

    def takes(self, x_shape, dtype: torch.dtype) -> bool:
        """Whether rows of this shape and dtype fit a region (checked by the producer: shapes only)."""
        rows = 1
        for d in x_shape[:-1]:
            rows *= d
        return 0 < rows <= self.max_rows and x_shape[-1] == self.hidden and dtype == self.dtype


def inbox_bytes(slots: int, world: int, max_rows: int, hidden: int, dtype: torch.dtype) -> int:
    return _align16(HEADER_BYTES + 4 * slots * (world + 1)) + slots * world * max_rows * hidden * dtype.itemsize


@dataclass(frozen=True)
class Pushed:
    """This rank's partial sums of boundary `slot`, [*shape] in `dtype`: pushed (or being pushed, in stream order)
    into every rank's inbox. Its consumer sums them (layers/norm.py: a GEMV's prologue or the pull + add + norm kernel; consume)."""
    inbox: Inbox
    slot: int
    shape: torch.Size
    dtype: torch.dtype

    @property
    def rows(self) -> int:
        return self.shape.numel() // self.shape[-1]

    @property
    def device(self) -> torch.device:
        return self.inbox.device


# ---------------------------------------------------------------------------------------------- the inbox
_inbox: Inbox | None = None
_retired: list[Inbox] = []  # CUDA graphs captured earlier may still address them


def current() -> Inbox | None:
    return _inbox


def install(inbox: Inbox | None) -> None:
    global _inbox
    if inbox is None:
        _retired.clear()
    elif _inbox is not None:
        _retired.append(_inbox)
    _inbox = inbox


def symmetric_inbox(slots: int, max_rows: int, hidden: int, dtype: torch.dtype, device: torch.device,
                    group=None) -> Inbox:
    """Allocate and exchange this rank's inbox with torch symmetric memory (collective: every rank calls it).
    Zeroed before the rendezvous: no flag can hold an epoch yet (epochs start at 1)."""
    import os

    import torch.distributed as torch_dist
    from torch.distributed import _symmetric_memory as symm_mem
    if os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST") != "1":
        raise RuntimeError("symmetric memory without TORCH_SYMM_MEM_DISABLE_MULTICAST=1 may map NVLink multicast")
    group = group if group is not None else torch_dist.group.WORLD
    world = torch_dist.get_world_size(group)
    buf = symm_mem.empty(inbox_bytes(slots, world, max_rows, hidden, dtype), dtype=torch.uint8, device=device)
    buf.zero_()
    torch.cuda.synchronize(device)
    try:
        handle = symm_mem.rendezvous(buf, group)
    except RuntimeError:  # torch releases before rendezvous resolved the group by itself
        symm_mem.enable_symm_mem_for_group(group.group_name)
        handle = symm_mem.rendezvous(buf, group)
    return Inbox(list(handle.buffer_ptrs), handle.rank, slots, max_rows, hidden, dtype, torch.device(device),
                 keep=(buf, handle))


def begin_step(box: Inbox | None = None) -> None:
    """At the start of every forward, on every rank: a new epoch, boundaries numbered from 0 again (the installed
    inbox's, or `box`'s)."""
    box = box or _inbox
    if box is not None:
        box.next_slot = 0
        _begin_kernel[(1,)](box.table, box.rank)


def pushes(x_shape, dtype: torch.dtype) -> Inbox | None:
    """The inbox when partial sums of this shape go by push (TP > 1, small enough), else None."""
    box = _inbox
    return box if box is not None and box.takes(x_shape, dtype) else None


def launch_args(box: Inbox) -> tuple:
    """The inbox's runtime arguments of every pushing / pulling kernel, in their order: table, rank, flags_off,
    counters_off, regions_off, region_stride."""
    return box.table, box.rank, box.flags_off, box.counters_off, box.regions_off, box.region_stride


# ---------------------------------------------------------------------------------------------- launches
def push_(x: torch.Tensor, box: Inbox | None = None) -> Pushed:
    """Push x [rows, hidden] (this rank's partial sums) for the next boundary, by a kernel of its own (after a
    GEMM that cannot push from its epilogue)."""
    box = box or _inbox
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if not box.takes(x.shape, x.dtype):
        raise ValueError(f"push_: {tuple(x.shape)} {x.dtype} does not fit the inbox "
                         f"({box.max_rows} rows of {box.hidden}, {box.dtype})")
    slot = box.claim()
    rows, H = x2.shape
    block = min(1024, triton.next_power_of_2(H))
    grid = (rows, triton.cdiv(H, block))
    _push_kernel[grid](x2, x2.stride(0), H, slot, *launch_args(box), P=box.world,
                       PP=triton.next_power_of_2(box.world), BLOCK=block, num_warps=4)
    return Pushed(box, slot, x.shape, x.dtype)


def consume(p: Pushed) -> torch.Tensor:
    """The boundary's plain sum [*shape] (for a reader that needs no norm)."""
    box = p.inbox
    H = p.shape[-1]
    out = torch.empty(p.shape, dtype=p.dtype, device=p.device)
    block = min(1024, triton.next_power_of_2(H))
    _consume_kernel[(p.rows, triton.cdiv(H, block))](out, H, p.slot, *launch_args(box), P=box.world,
                                                      PP=triton.next_power_of_2(box.world), BLOCK=block, num_warps=4)
    return out


# ---------------------------------------------------------------------------------------------- kernel pieces
if triton is not None:
    @triton.jit
    def push_rows(vals, row, cols, mask, slot, table, rank, regions_off, region_stride, H, P: tl.constexpr):
        """Store vals (this rank's partial sums of `row`, columns `cols`) into region [slot, rank] of every inbox."""
        dt = vals.dtype
        off = regions_off + (slot * P + rank).to(tl.int64) * region_stride + row * H
        for p in tl.static_range(P):
            tl.store(peer_buffer(table, p, dt) + off + cols, vals, mask=mask)

    @triton.jit
    def push_done(slot, table, rank, flags_off, counters_off, programs, P: tl.constexpr, PP: tl.constexpr):
        """This program has pushed its share of boundary `slot`; the last of `programs` raises the flags."""
        tl.debug_barrier()  # every thread's stores before the count
        me = peer_buffer(table, rank, tl.int32)
        if tl.atomic_add(me + counters_off + slot, 1, sem="acq_rel", scope="sys") == programs - 1:
            tl.atomic_xchg(me + counters_off + slot, 0)
            epoch = tl.load(me)
            lanes = tl.arange(0, PP)
            peers = tl.where(lanes < P, lanes, 0)
            flag = tl.load(table + peers).to(tl.pointer_type(tl.int32)) + flags_off + slot * P + rank
            tl.atomic_xchg(flag, tl.zeros([PP], dtype=tl.int32) + epoch, mask=lanes < P, sem="release", scope="sys")

    @triton.jit
    def pull_wait(slot, table, rank, flags_off, P: tl.constexpr, PP: tl.constexpr):
        """Wait until every rank has pushed boundary `slot` in this epoch (its flag in my inbox)."""
        me = peer_buffer(table, rank, tl.int32)
        epoch = tl.load(me)
        lanes = tl.arange(0, PP)
        flag = me + flags_off + slot * P + tl.where(lanes < P, lanes, 0)
        want = tl.zeros([PP], dtype=tl.int32) + epoch  # (a vector: the interpreter mishandles scalar cas operands)
        done = lanes >= P
        while tl.sum((~done).to(tl.int32), 0) > 0:
            seen = tl.atomic_cas(flag, want, want, sem="acquire", scope="sys")  # (a read: equal stays equal)
            done = done | (seen == epoch)
        tl.debug_barrier()  # no thread reads a region before the flags are in

    @triton.jit
    def pull_sum(slot, row, cols, mask, table, rank, regions_off, region_stride, H, P: tl.constexpr,
                 DTYPE: tl.constexpr):
        """sum over p = 0..P-1, in that order, of region [slot, p] row `row` in fp32 (not rounded)."""
        base = peer_buffer(table, rank, DTYPE) + regions_off + row * H + cols
        acc = tl.load(base + (slot * P).to(tl.int64) * region_stride, mask=mask, other=0.0).to(tl.float32)
        for p in tl.static_range(1, P):
            acc += tl.load(base + (slot * P + p).to(tl.int64) * region_stride, mask=mask, other=0.0).to(tl.float32)
        return acc

    @triton.jit
    def _begin_kernel(table, rank):
        me = peer_buffer(table, rank, tl.int32)
        tl.store(me, tl.load(me) + 1)

    @triton.jit(do_not_specialize=["slot"])
    def _push_kernel(x_ptr, sx, H, slot, table, rank, flags_off, counters_off, regions_off, region_stride,
                     P: tl.constexpr, PP: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        vals = tl.load(x_ptr + row * sx + cols, mask=mask)
        push_rows(vals, row, cols, mask, slot, table, rank, regions_off, region_stride, H, P)
        push_done(slot, table, rank, flags_off, counters_off, tl.num_programs(0) * tl.num_programs(1), P, PP)

    @triton.jit(do_not_specialize=["slot"])
    def _consume_kernel(out_ptr, H, slot, table, rank, flags_off, counters_off, regions_off, region_stride,
                        P: tl.constexpr, PP: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        pull_wait(slot, table, rank, flags_off, P, PP)
        dt = out_ptr.dtype.element_ty
        s = pull_sum(slot, row, cols, mask, table, rank, regions_off, region_stride, H, P, dt)
        tl.store(out_ptr + row * H + cols, s.to(dt), mask=mask)
