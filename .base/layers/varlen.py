"""What the varlen Triton kernels share: mapping a program to (sequence, block of that sequence) in a packed batch.

A packed batch holds B sequences delimited by cu_seqlens [B+1] (int32). Kernels that work on blocks of BLOCK tokens
of one sequence each launch an upper bound of programs, cdiv(N, BLOCK) + B (N the packed tokens, a shape), so the
host never reads the lengths (no sync) and a fixed (N, B) gives a fixed grid; the programs past the last block exit.
"""
from __future__ import annotations

from layers.backend import tl, triton

if triton is not None:
    @triton.jit
    def block_of(cu_ptr, pid, B, BLOCK: tl.constexpr, BLOCK_B: tl.constexpr, AT_LEAST_ONE: tl.constexpr):
        """(sequence b, block index) of program `pid` when each sequence is cut into blocks of BLOCK tokens from
        its own start (AT_LEAST_ONE: empty sequences get one block too). b >= B: past the last block. BLOCK_B is a
        power of two > B (the cumulative block counts are summed in one tile)."""
        offs = tl.arange(0, BLOCK_B)
        inb = offs < B
        lo = tl.load(cu_ptr + offs, mask=inb, other=0)
        hi = tl.load(cu_ptr + offs + 1, mask=inb, other=0)
        nblk = (hi - lo + BLOCK - 1) // BLOCK
        if AT_LEAST_ONE:
            nblk = tl.maximum(nblk, 1)
        nblk = tl.where(inb, nblk, 0)
        cum = tl.cumsum(nblk, 0)
        b = tl.sum((cum <= pid).to(tl.int32), 0)
        first = tl.sum(tl.where(offs == b, cum - nblk, 0), 0)
        return b, pid - first
else:  # pragma: no cover
    block_of = None

SEQ_TILE = 16  # BLOCK_B floor: steps of up to 15 sequences share one compiled variant


def seq_tile(B: int) -> int:
    """BLOCK_B for block_of over B sequences: a power of two > B, at least SEQ_TILE. A step's sequence count picks
    the compiled variant: one for up to 15 sequences, then one per power of two (16-31, 32-63, ...), which the
    start-up warm-up meets (ModelRunner.warm_up_plans). A fixed 256 would need no warm-up but made every program
    sum 256 counts: the conv and the delta rule 8% and 5% slower at 8 x 1024 tokens (1x H200, 2026-11-25)."""
    return max(SEQ_TILE, triton.next_power_of_2(B + 1))
