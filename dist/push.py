"""The layer-boundary all-reduce folded into the kernels on either side of it: producers push, consumers pull.

At decode sizes the all-reduce after each mixer and each MoE is latency: the one-shot kernel (dist/allreduce.py)
stages, meets every peer in a barrier, reads every peer's buffer over NVLink and meets them again, ~10 us a
boundary at TP=4. Here the kernel that computes this rank's partial sums (the out projection's GEMV, the MoE's
down + combine, or push_ after a GEMM that cannot) stores them straight into every rank's inbox, and the kernel
that needs the sum (the next GEMV with the norm folded in, or layers/norm.py's pull kernel) reads its own inbox.

No flags and no fences: an empty inbox holds an all-ones bit pattern (a NaN no arithmetic produces: a producer
stores any NaN as the canonical one), so the data is its own flag (the "Lamport" all-reduce of TensorRT-LLM). A
consumer polls each source's row until no element is empty, then sums the P sources in rank order in fp32 and
rounds once: identical bits on every rank, and the one-shot kernel's bits. A flag and its release/acquire at
system scope would cost every producer program a wait for its NVLink stores to be acknowledged (measured on 4x
H100: +8 us on the out projection, +6 us on down + combine, as much as the launch it saved).

Every rank owns one inbox in symmetric memory: [slots, P, max_rows, hidden] of the model dtype, region [i, p]
holding rank p's partial sums of boundary i. A forward numbers its boundaries 0, 1, ... in the order its
producers run (`claim`), the same on every rank (SPMD). Emptying, so that every slot is empty when a forward starts:
- the producer of boundary i (i > 0) empties slot i - 1 of its own inbox: its one reader (the consumer of i - 1)
  ran before it on this rank, and no peer stores there again before this rank pushes boundary i - 2 of the next
  forward, or (i - 1 = 0) this rank's last boundary of this one, both later in this rank's stream;
- end_step, after the forward's last consumer, empties the last slot: no peer stores there before this rank has
  pushed the boundary before it in the next forward.
So a forward has at least 2 boundaries (a decoder layer has 2).

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

MAX_ROWS = 256      # rows of the steps that push: decode steps (every graph-captured batch, up to 64) and verify
                    # steps (k + 1 rows a sequence, up to 64 x 4); the GEMVs and down + combine push from their
                    # epilogues up to their own row limits, push_ after the GEMMs past them
CLEAR_BLOCK = 1024  # elements per program step when emptying a slot


@dataclass
class Inbox:
    """Every rank's inbox, at ptrs[p] in this process's address space; `keep` holds what owns the memory."""
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
    rows: int = field(init=False, default=0)  # of this forward's boundaries (claim)

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
    def region_stride(self) -> int:
        """Elements of one (boundary, source rank) region."""
        return self.max_rows * self.hidden

    def claim(self, rows: int) -> int:
        """The next boundary of this forward, of `rows` rows (its producer claims it; the consumer reads its
        Pushed). Every boundary of a forward has the same rows: what a slot's emptying clears."""
        i = self.next_slot
        if i and rows != self.rows:
            raise RuntimeError(f"a forward pushed boundaries of {self.rows} and of {rows} rows")
        self.rows = rows
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
    return slots * world * max_rows * hidden * dtype.itemsize


def empty_inbox_(buf: torch.Tensor) -> torch.Tensor:
    """Every element empty (all bits set)."""
    return buf.fill_(255)


@dataclass(frozen=True)
class Pushed:
    """This rank's partial sums of boundary `slot`, [*shape] in `dtype`: pushed (or being pushed, in stream order)
    into every rank's inbox. Its consumer sums them (layers/norm.py: a GEMV's prologue or the pull + add + norm
    kernel; consume)."""
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
    """Allocate and exchange this rank's inbox with torch symmetric memory (collective: every rank calls it),
    emptied before the rendezvous."""
    import os

    import torch.distributed as torch_dist
    from torch.distributed import _symmetric_memory as symm_mem
    if os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST") != "1":
        raise RuntimeError("symmetric memory without TORCH_SYMM_MEM_DISABLE_MULTICAST=1 may map NVLink multicast")
    group = group if group is not None else torch_dist.group.WORLD
    world = torch_dist.get_world_size(group)
    buf = empty_inbox_(symm_mem.empty(inbox_bytes(slots, world, max_rows, hidden, dtype), dtype=torch.uint8,
                                      device=device))
    torch.cuda.synchronize(device)
    try:
        handle = symm_mem.rendezvous(buf, group)
    except RuntimeError:  # torch releases before rendezvous resolved the group by itself
        symm_mem.enable_symm_mem_for_group(group.group_name)
        handle = symm_mem.rendezvous(buf, group)
    return Inbox(list(handle.buffer_ptrs), handle.rank, slots, max_rows, hidden, dtype, torch.device(device),
                 keep=(buf, handle))


def begin_step(box: Inbox | None = None) -> None:
    """At the start of every forward, on every rank: boundaries numbered from 0 again (the installed inbox's, or
    `box`'s). The previous forward must have ended with end_step."""
    box = box or _inbox
    if box is not None:
        if box.next_slot:
            raise RuntimeError(f"a forward pushed {box.next_slot} boundaries and did not end_step")
        box.next_slot = 0


def end_step(box: Inbox | None = None) -> None:
    """After a forward's last consumer: empty its last slot (the producers emptied the others). A forward that
    pushed must have pushed at least 2 boundaries (the module's docstring says why)."""
    box = box or _inbox
    if box is None or box.next_slot == 0:
        return
    if box.next_slot < 2:
        raise RuntimeError("a forward that pushes must push at least 2 boundaries")
    used = box.rows * box.hidden
    _clear_kernel[(min(triton.cdiv(used, CLEAR_BLOCK), 64),)](box.table, box.rank, box.next_slot - 1, used,
                                                               box.region_stride, P=box.world,
                                                               DTYPE=_tl(box.dtype), BLOCK=CLEAR_BLOCK, num_warps=4)
    box.next_slot = 0


def pushes(x_shape, dtype: torch.dtype) -> Inbox | None:
    """The inbox when partial sums of this shape go by push (TP > 1, small enough), else None."""
    box = _inbox
    return box if box is not None and box.takes(x_shape, dtype) else None


def launch_args(box: Inbox) -> tuple:
    """The inbox's runtime arguments of every pushing / pulling kernel, in their order: table, rank,
    region_stride."""
    return box.table, box.rank, box.region_stride


def _tl(dtype: torch.dtype):
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


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
    rows, H = x2.shape
    slot = box.claim(rows)
    block = min(1024, triton.next_power_of_2(H))
    _push_kernel[(rows, triton.cdiv(H, block))](x2, x2.stride(0), H, slot, *launch_args(box), P=box.world,
                                                BLOCK=block, num_warps=4)
    return Pushed(box, slot, x.shape, x.dtype)


def consume(p: Pushed) -> torch.Tensor:
    """The boundary's plain sum [*shape] (for a reader that needs no norm)."""
    box = p.inbox
    H = p.shape[-1]
    out = torch.empty(p.shape, dtype=p.dtype, device=p.device)
    block = min(1024, triton.next_power_of_2(H))
    _consume_kernel[(p.rows, triton.cdiv(H, block))](out, H, p.slot, *launch_args(box), P=box.world, BLOCK=block,
                                                      num_warps=4)
    return out


# ---------------------------------------------------------------------------------------------- kernel pieces
if triton is not None:
    @triton.jit
    def push_rows(vals, row, cols, mask, slot, table, rank, region_stride, H, P: tl.constexpr):
        """Store vals (this rank's partial sums of `row`, columns `cols`) into region [slot, rank] of every inbox;
        a NaN goes as the canonical one (never the all-ones 'empty' pattern)."""
        vals = tl.where(vals != vals, float("nan"), vals.to(tl.float32)).to(vals.dtype)
        off = (slot * P + rank).to(tl.int64) * region_stride + row * H
        for p in tl.static_range(P):
            tl.store(peer_buffer(table, p, vals.dtype) + off + cols, vals, mask=mask)

    @triton.jit
    def clear_slot(slot, used, table, rank, region_stride, P: tl.constexpr, DTYPE: tl.constexpr,
                   BLOCK: tl.constexpr):
        """This program's share of slot `slot` of my inbox, emptied (programs split it by the grid): the first
        `used` elements (rows x hidden of the forward that filled it: every boundary of a forward has its rows) of
        each source's region, all that a forward can have written there."""
        IT: tl.constexpr = tl.int16 if DTYPE.primitive_bitwidth == 16 else tl.int32  # (read as bits: empty is -1)
        base = peer_buffer(table, rank, IT) + slot.to(tl.int64) * P * region_stride
        pid = tl.program_id(0) + tl.program_id(1) * tl.num_programs(0)
        step = tl.num_programs(0) * tl.num_programs(1) * BLOCK
        cols = tl.arange(0, BLOCK)
        for p in tl.static_range(P):
            for start in range(pid * BLOCK, used, step):
                tl.store(base + p * region_stride + start + cols, tl.full([BLOCK], -1, IT), mask=start + cols < used)

    @triton.jit
    def pull_sum(slot, row, cols, mask, table, rank, region_stride, H, P: tl.constexpr, DTYPE: tl.constexpr):
        """sum over p = 0..P-1, in that order, of region [slot, p] row `row` of my inbox in fp32 (not rounded),
        each source's row polled until none of its elements is empty."""
        IT: tl.constexpr = tl.int16 if DTYPE.primitive_bitwidth == 16 else tl.int32  # (read as bits: empty is -1)
        base = peer_buffer(table, rank, IT) + row * H + cols
        acc = tl.zeros(cols.shape, dtype=tl.float32)
        for p in tl.static_range(P):
            ptr = base + (slot * P + p).to(tl.int64) * region_stride
            bits = tl.load(ptr, mask=mask, other=0, volatile=True)
            while tl.max((bits == -1).to(tl.int32), 0) > 0:
                bits = tl.load(ptr, mask=mask, other=0, volatile=True)
            acc += bits.to(DTYPE, bitcast=True).to(tl.float32)
        return acc

    @triton.jit(do_not_specialize=["slot", "used"])
    def _clear_kernel(table, rank, slot, used, region_stride, P: tl.constexpr, DTYPE: tl.constexpr,
                      BLOCK: tl.constexpr):
        clear_slot(slot, used, table, rank, region_stride, P, DTYPE, BLOCK)

    @triton.jit(do_not_specialize=["slot"])
    def _push_kernel(x_ptr, sx, H, slot, table, rank, region_stride, P: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        vals = tl.load(x_ptr + row * sx + cols, mask=mask)
        push_rows(vals, row, cols, mask, slot, table, rank, region_stride, H, P)
        if slot > 0:
            clear_slot(slot - 1, tl.num_programs(0) * H, table, rank, region_stride, P, x_ptr.dtype.element_ty, BLOCK)

    @triton.jit(do_not_specialize=["slot"])
    def _consume_kernel(out_ptr, H, slot, table, rank, region_stride, P: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        dt = out_ptr.dtype.element_ty
        s = pull_sum(slot, row, cols, mask, table, rank, region_stride, H, P, dt)
        tl.store(out_ptr + row * H + cols, s.to(dt), mask=mask)
