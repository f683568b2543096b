"""Small-message all-reduce through peer buffers (torch symmetric memory), without NVLink multicast.

Every rank owns one buffer that every other rank can load from and store to at a fixed address (the "workspace":
a data region, then the signal flags of the cross-rank barrier). Two algorithms, both Triton kernels that CUDA
graphs capture (the addresses never change, nothing waits for the host):

    one-shot   stage my part in my buffer; barrier; every rank sums all P buffers itself (small messages: one hop,
               P times the bytes read)
    two-shot   stage; barrier; rank r sums slice r of all buffers into its own buffer (reduce-scatter); barrier;
               every rank copies each slice from its owner (all-gather): 2 hops, about 2x the bytes read

The same pieces gather: `all_gather_` stages each rank's message in its buffer; after one barrier every rank reads
all P of them (the sampler's per-row candidates: a few KB, inside the decode step's CUDA graphs, where a captured
NCCL collective would cost more and keep destroy_process_group from returning, pytorch/pytorch#115388).

Both sum in rank order 0..P-1 in fp32 and round once, so every rank gets identical bits (the residual stream must
stay identical across ranks) whatever its own rank. Messages larger than the workspace go to the process group's
collective (NCCL; gloo on the CPU). `choose` decides from the message alone (size, dtype, layout), so every rank
takes the same path. layers/norm.py fuses the one-shot sum with the residual add and the next RMSNorm (one kernel
per layer boundary) from the same pieces: `peer_buffer`, `block_barrier`, `sum_peers`.

The barrier pairs block b of every rank with block b of every other rank: each sends a flag into every peer's pad
(compare-and-swap 0 -> 1, release, system scope) and waits for every peer's flag in its own pad (1 -> 0, acquire).
A flag is a one-slot semaphore, so pads never need resetting; separate channels keep the barriers of one kernel
apart. Blocks own the same elements in every phase and on every rank, so block-wise barriers are enough.
The flags live in our own buffer rather than torch's signal pads, whose default size is too small for
3 channels x 64 blocks x 8 ranks and whose layout torch's own ops use.

On the CPU the same kernels run through Triton's interpreter over any buffers with known addresses (tests: P
simulated peers in one process, or P processes sharing memory). The size thresholds below are first guesses until
benchmarks/bench_allreduce.py has measured the crossovers on the target machine.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - without triton every all-reduce is the process group's
    triton = None
    tl = None

MAX_BLOCKS = 64                    # blocks per kernel: the flag pads hold this many per channel
NUM_CHANNELS = 3                   # barriers per kernel (two-shot: after staging, after reducing, at the end)
ONE_SHOT_MAX_BYTES = 256 * 1024    # decode at batch 64 x hidden 2048 x bf16; above this two-shot reads fewer bytes
TWO_SHOT_MAX_BYTES = 4 * 1024 * 1024  # default data region; larger messages (prefill) go to NCCL
FLAT_BLOCK = 1024                  # elements per block step of the flat kernels
ENV = "QWEN35_ALLREDUCE"  # "auto" (default): symmetric memory where it fits, push at decode boundaries
                          # (dist/push.py); "oneshot": no push; "nccl": never symmetric memory


@dataclass
class Workspace:
    """One buffer per rank, at `ptrs[p]` in this process's address space: `data_bytes` of data, then the flags
    (int32 [NUM_CHANNELS, MAX_BLOCKS, world]). `keep` holds whatever owns the memory."""
    ptrs: list[int]
    rank: int
    data_bytes: int
    device: torch.device
    one_shot_max_bytes: int = ONE_SHOT_MAX_BYTES
    keep: object = None
    table: torch.Tensor = field(init=False)

    def __post_init__(self):
        if any(p % 16 for p in self.ptrs):
            raise ValueError("every buffer must start 16-byte aligned")
        if not 0 <= self.rank < len(self.ptrs):
            raise ValueError(f"rank {self.rank} outside the {len(self.ptrs)} buffers")
        if self.data_bytes % 16:
            raise ValueError(f"data_bytes must be a multiple of 16 (flags and vector loads stay aligned); "
                             f"got {self.data_bytes}")
        self.table = torch.tensor(self.ptrs, dtype=torch.int64, device=self.device)

    @property
    def world(self) -> int:
        return len(self.ptrs)

    @property
    def flag_offset(self) -> int:
        """Where the flags start, in int32 elements from the start of a buffer."""
        return self.data_bytes // 4


def buffer_bytes(data_bytes: int, world: int) -> int:
    """The size of one rank's buffer: the data region and the flags."""
    return data_bytes + NUM_CHANNELS * MAX_BLOCKS * world * 4


def two_shot_slice(numel: int, world: int) -> int:
    """Elements per rank's slice: numel / world rounded up to a multiple of 16, so that every slice starts aligned."""
    per_rank = -(-numel // world)
    return -(-per_rank // 16) * 16


def choose(x: torch.Tensor, ws: Workspace | None) -> str:
    """'one_shot', 'two_shot' or 'collective' (the process group's all-reduce) for summing `x` over the ranks.

    Depends only on the message (size, dtype, layout) and the workspace, which are the same on every rank."""
    if ws is None or ws.world == 1 or not x.is_floating_point() or not x.is_contiguous() or x.device != ws.device:
        return "collective"
    nbytes = x.numel() * x.element_size()
    if nbytes <= min(ws.one_shot_max_bytes, ws.data_bytes):
        return "one_shot"
    if ws.world * two_shot_slice(x.numel(), ws.world) * x.element_size() <= ws.data_bytes:
        return "two_shot"
    return "collective"


# ---------------------------------------------------------------------------------------------- the workspace
_workspace: Workspace | None = None
_retired: list[Workspace] = []  # replaced workspaces: CUDA graphs captured earlier may still address them


def current() -> Workspace | None:
    return _workspace


def install(ws: Workspace | None) -> None:
    """Make `ws` the workspace of every all-reduce of this process (None: the process group's collective only,
    and every earlier workspace released)."""
    global _workspace
    if ws is None:
        _retired.clear()
    elif _workspace is not None:
        _retired.append(_workspace)
    _workspace = ws


def check_fits(nbytes: int, ws: Workspace) -> None:
    if nbytes > ws.data_bytes:
        raise ValueError(f"a {nbytes}-byte message does not fit the {ws.data_bytes}-byte workspace")


def symmetric_workspace(data_bytes: int, device: torch.device, group=None,
                        one_shot_max_bytes: int = ONE_SHOT_MAX_BYTES) -> Workspace:
    """Allocate and exchange this rank's buffer with torch symmetric memory (collective: every rank calls it).

    The flags are zeroed before the rendezvous, so no rank can signal into a pad that is not zero yet."""
    import torch.distributed as torch_dist
    from torch.distributed import _symmetric_memory as symm_mem
    if os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST") != "1":
        raise RuntimeError("symmetric memory without TORCH_SYMM_MEM_DISABLE_MULTICAST=1 may map NVLink multicast")
    group = group if group is not None else torch_dist.group.WORLD
    data_bytes = -(-data_bytes // 16) * 16
    buf = symm_mem.empty(buffer_bytes(data_bytes, torch_dist.get_world_size(group)), dtype=torch.uint8,
                         device=device)
    buf.zero_()
    torch.cuda.synchronize(device)
    try:
        handle = symm_mem.rendezvous(buf, group)
    except RuntimeError:  # torch releases before rendezvous resolved the group by itself
        symm_mem.enable_symm_mem_for_group(group.group_name)
        handle = symm_mem.rendezvous(buf, group)
    return Workspace(list(handle.buffer_ptrs), handle.rank, data_bytes, torch.device(device), one_shot_max_bytes,
                     keep=(buf, handle))


# ---------------------------------------------------------------------------------------------- launches
def one_shot_(x: torch.Tensor, ws: Workspace) -> torch.Tensor:
    """Sum `x` (contiguous, at most ws.data_bytes) over the ranks in place, every rank reading every buffer."""
    n = x.numel()
    check_fits(n * x.element_size(), ws)
    if n:
        grid = min(triton.cdiv(n, FLAT_BLOCK), MAX_BLOCKS)
        _one_shot_kernel[(grid,)](x, ws.table, ws.flag_offset, ws.rank, n, P=ws.world,
                                  PP=triton.next_power_of_2(ws.world), MAX_BLOCKS=MAX_BLOCKS, BLOCK=FLAT_BLOCK,
                                  num_warps=4)
    return x


def two_shot_(x: torch.Tensor, ws: Workspace) -> torch.Tensor:
    """Sum `x` over the ranks in place: reduce-scatter then all-gather through the buffers."""
    n = x.numel()
    check_fits(ws.world * two_shot_slice(n, ws.world) * x.element_size(), ws)
    if n:
        s = two_shot_slice(n, ws.world)
        grid = min(triton.cdiv(s, FLAT_BLOCK), MAX_BLOCKS)
        _two_shot_kernel[(grid,)](x, ws.table, ws.flag_offset, ws.rank, n, s, P=ws.world,
                                  PP=triton.next_power_of_2(ws.world), MAX_BLOCKS=MAX_BLOCKS, BLOCK=FLAT_BLOCK,
                                  num_warps=4)
    return x


def all_reduce_(x: torch.Tensor, ws: Workspace | None) -> bool:
    """Sum `x` in place through the workspace when `choose` allows; False: the caller runs the collective."""
    method = choose(x, ws)
    if method == "one_shot":
        one_shot_(x, ws)
    elif method == "two_shot":
        two_shot_(x, ws)
    return method != "collective"


def all_gather_(x: torch.Tensor, out: torch.Tensor, ws: Workspace | None) -> bool:
    """out [P, *x.shape] = every rank's `x` in rank order, through the buffers (one hop, every rank reading every
    buffer), when x is small enough (one_shot_max_bytes) and contiguous on the workspace's device; False: the
    caller runs the process group's collective. Every rank passes the same shape and dtype, so all take one path."""
    nbytes = x.numel() * x.element_size()
    if (ws is None or ws.world == 1 or not x.is_contiguous() or not out.is_contiguous() or x.device != ws.device
            or nbytes > min(ws.one_shot_max_bytes, ws.data_bytes)):
        return False
    n = x.numel()
    if n:
        grid = min(triton.cdiv(n, FLAT_BLOCK), MAX_BLOCKS)
        _all_gather_kernel[(grid,)](x, out, ws.table, ws.flag_offset, ws.rank, n, P=ws.world,
                                    PP=triton.next_power_of_2(ws.world), MAX_BLOCKS=MAX_BLOCKS, BLOCK=FLAT_BLOCK,
                                    num_warps=4)
    return True


# ---------------------------------------------------------------------------------------------- kernels
if triton is not None:
    @triton.jit
    def peer_buffer(table, p, DTYPE: tl.constexpr):
        """Rank p's buffer as a pointer to DTYPE; 16-byte aligned (allocations are), which lets the compiler
        vectorize the loads and stores through it as it does through pointer arguments."""
        return tl.multiple_of(tl.load(table + p).to(tl.pointer_type(DTYPE)), 16)

    @triton.jit
    def block_barrier(table, flag_off, rank, CHANNEL: tl.constexpr, P: tl.constexpr, PP: tl.constexpr,
                      MAX_BLOCKS: tl.constexpr):
        """This block meets the block of the same index on every rank (itself included): every store before it,
        by any thread of the block, is visible to those blocks after it. PP: P rounded up to a power of two;
        the extra lanes compare-and-swap 2 -> 2 on a real flag, which never matches (no effect)."""
        base = (CHANNEL * MAX_BLOCKS + tl.program_id(0)) * P
        lanes = tl.arange(0, PP)
        real = lanes < P
        peers = tl.where(real, lanes, rank)
        send = tl.load(table + peers).to(tl.pointer_type(tl.int32)) + flag_off + base + rank
        recv = peer_buffer(table, rank, tl.int32) + flag_off + base + tl.where(real, lanes, 0)
        tl.debug_barrier()  # the whole block's stores happen before the signal
        done = lanes >= P
        while tl.sum((~done).to(tl.int32), 0) > 0:  # a slot still 1: that peer has not taken my last signal yet
            old = tl.atomic_cas(send, tl.where(done, 2, 0), tl.where(done, 2, 1), sem="release", scope="sys")
            done = done | (old == 0)
        done = lanes >= P
        while tl.sum((~done).to(tl.int32), 0) > 0:
            old = tl.atomic_cas(recv, tl.where(done, 2, 1), tl.where(done, 2, 0), sem="acquire", scope="sys")
            done = done | (old == 1)
        tl.debug_barrier()  # no thread reads a peer's buffer before the signals are in

    @triton.jit
    def sum_peers(table, offs, mask, P: tl.constexpr, DTYPE: tl.constexpr):
        """sum over p = 0..P-1, in that order, of buffer p at `offs` (elements of DTYPE), in fp32."""
        acc = tl.load(peer_buffer(table, 0, DTYPE) + offs, mask=mask, other=0.0).to(tl.float32)
        for p in tl.static_range(1, P):
            acc += tl.load(peer_buffer(table, p, DTYPE) + offs, mask=mask, other=0.0).to(tl.float32)
        return acc

    @triton.jit
    def stage_flat(x_ptr, mine, n, BLOCK: tl.constexpr):
        """This block's share of x[0:n] into my buffer: elements start..start+BLOCK for start = its index * BLOCK,
        stepping by the grid (the same elements it reads back from every buffer after the barrier)."""
        cols = tl.arange(0, BLOCK)
        for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
            i = start + cols
            tl.store(mine + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)

    @triton.jit
    def _one_shot_kernel(x_ptr, table, flag_off, rank, n, P: tl.constexpr, PP: tl.constexpr,
                         MAX_BLOCKS: tl.constexpr, BLOCK: tl.constexpr):
        dt = x_ptr.dtype.element_ty
        stage_flat(x_ptr, peer_buffer(table, rank, dt), n, BLOCK)
        block_barrier(table, flag_off, rank, 0, P, PP, MAX_BLOCKS)
        cols = tl.arange(0, BLOCK)
        for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
            i = start + cols
            tl.store(x_ptr + i, sum_peers(table, i, i < n, P, dt).to(dt), mask=i < n)
        block_barrier(table, flag_off, rank, 1, P, PP, MAX_BLOCKS)  # peers are done reading my buffer

    # one variant per dtype whatever the message length: the sampler's one-row warm-up compiles what later steps use
    @triton.jit(do_not_specialize=["n"])
    def _all_gather_kernel(x_ptr, out_ptr, table, flag_off, rank, n, P: tl.constexpr, PP: tl.constexpr,
                           MAX_BLOCKS: tl.constexpr, BLOCK: tl.constexpr):
        dt = x_ptr.dtype.element_ty
        stage_flat(x_ptr, peer_buffer(table, rank, dt), n, BLOCK)
        block_barrier(table, flag_off, rank, 0, P, PP, MAX_BLOCKS)
        cols = tl.arange(0, BLOCK)
        for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
            i = start + cols
            for p in tl.static_range(P):
                tl.store(out_ptr + p * n + i, tl.load(peer_buffer(table, p, dt) + i, mask=i < n), mask=i < n)
        block_barrier(table, flag_off, rank, 1, P, PP, MAX_BLOCKS)  # peers are done reading my buffer

    @triton.jit
    def _two_shot_kernel(x_ptr, table, flag_off, rank, n, S, P: tl.constexpr, PP: tl.constexpr,
                         MAX_BLOCKS: tl.constexpr, BLOCK: tl.constexpr):
        """Slice q = elements [q*S, (q+1)*S); this block owns the same columns of every slice in every phase."""
        dt = x_ptr.dtype.element_ty
        mine = peer_buffer(table, rank, dt)
        cols = tl.arange(0, BLOCK)
        step = tl.num_programs(0) * BLOCK
        for start in range(tl.program_id(0) * BLOCK, S, step):
            for q in tl.static_range(P):
                i = q * S + start + cols
                m = (start + cols < S) & (i < n)
                tl.store(mine + i, tl.load(x_ptr + i, mask=m), mask=m)
        block_barrier(table, flag_off, rank, 0, P, PP, MAX_BLOCKS)
        for start in range(tl.program_id(0) * BLOCK, S, step):  # reduce-scatter: my slice, into my buffer
            i = rank * S + start + cols
            m = (start + cols < S) & (i < n)
            tl.store(mine + i, sum_peers(table, i, m, P, dt).to(dt), mask=m)
        block_barrier(table, flag_off, rank, 1, P, PP, MAX_BLOCKS)
        for start in range(tl.program_id(0) * BLOCK, S, step):  # all-gather: slice q from rank q
            for q in tl.static_range(P):
                i = q * S + start + cols
                m = (start + cols < S) & (i < n)
                tl.store(x_ptr + i, tl.load(peer_buffer(table, q, dt) + i, mask=m), mask=m)
        block_barrier(table, flag_off, rank, 2, P, PP, MAX_BLOCKS)
