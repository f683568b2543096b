"""Batched token sampling, decided on the device with no host sync: the gathered reference and the vocab-parallel path.

Per row: a temperature (0 = greedy: the argmax, ties to the lowest id), top_k (0 = off) and top_p (1 = off), a
64-bit stream key and a draw counter. A sampled row keeps its top-k, then its top-p tokens, and draws among them by
Gumbel-max: the token with the largest x + G, x = logit / temperature, G = -log(E), E ~ Exp(1) (the exponential
race argmax(p / E) in the log domain, exactly a draw from the renormalised distribution). Padded vocabulary
columns (ids >= num_real_tokens) and suppressed (row, id) pairs (stop ids before min_tokens) are never picked.

The noise is counter-based: E for (row, token id) is a function of (key, counter, id) alone, with no generator
state. A seeded request's key is its seed and its counter the index of the token being drawn, so its tokens depend
only on its seed and its own logits, never on what shares the batch; other requests get a key from the engine seed
and their admission number. The function uses only integer ops and float32 adds/multiplies in a fixed order (our
own log polynomial, no library transcendental), so the torch code here and the Triton kernel compute the same bits
for every element, wherever it sits in the vocabulary.

Two implementations, same signature, same tokens (tests/test_vocab_parallel_sampling.py):

    sample_torch  the reference: every rank gathers the whole logits row, then greedy / sort-based top-k and top-p /
                  Gumbel-max over the full vocabulary (on the CPU by gumbel_argmax: the same token from exact scores
                  of only the tokens that could win, as every score costs ~100 float and integer ops there).
    sample_fast   vocab-parallel: each rank works on its own vocabulary shard (one Triton pass: masked max and
                  Gumbel-max per block) and the ranks exchange a few candidates per row; no full-logit gather.

Vocab-parallel filtering. Top-k and top-p keep a prefix of the vocabulary in the order (x descending, id ascending).
Such a prefix is "every x above a threshold value tau, and the first c tokens (lowest ids) whose x equals tau";
sample_fast finds tau by a radix select over the order-preserving 32-bit key of x, one byte per round (4 rounds):
each rank histograms its members' weights and counts per byte value, the histograms are all-gathered and summed,
and every rank picks the same byte. Top-k weighs tokens by 1 (limit k); top-p by their probability mass (limit
top_p x the mass of the top-k set). Masses are fixed-point integers, floor(exp(x - max x) * 2^40) (our own exp:
again the same bits everywhere), so every sum is exact and independent of its order and of the sharding: the
reference's cumulative sums over its sorted row and the shards' histogram sums decide the same tokens. Tokens of
relative probability below 2^-40 weigh 0 (never inside a nucleus of top_p < 1). A kept set is found in 4 rounds
per filter; the exact tie count per rank comes with the last round.

Values come validated (scheduler/sampling_params.py); still, suppressed ids outside the vocabulary and top-k past
it are tolerated rather than trusted: an out-of-range index on a GPU is a device-side assert that kills the whole
process, not an exception.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Callable

import torch

from dist import parallel
from layers import backend
from layers.backend import pdl, prior_done, tl, triton
from layers.linear import even_split

NO_LIMIT = 1 << 62          # a top-k / top-p limit that keeps every token
MASS_BITS = 40              # fixed-point masses: the most likely token weighs 2^40; sums stay below 2^63
MAX_IDS = 1 << 24           # candidate ids travel as float32 with the scores: exact below 2^24
BLOCK = 1024                # vocabulary columns per program of the shard pass
_M32 = 0xFFFFFFFF


# ----------------------------------------------------------------------------- counter-based noise (torch twins)
def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for int64 x in [0, 2^32), without overflowing int64 (split c in 16-bit halves)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with full avalanche (Wellons' lowbias32) on int64 values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_seeds(key: torch.Tensor, counter: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two 32-bit seeds per row from its 64-bit key and counter (int64 [B] each)."""
    s1 = _mix32(_mix32(_mix32(_mix32(key & _M32) ^ ((key >> 32) & _M32)) ^ (counter & _M32))
                ^ ((counter >> 32) & _M32))
    return s1, _mix32(s1 ^ 0x9E3779B9)


def _log(v: torch.Tensor) -> torch.Tensor:
    """Natural log of positive normal float32 values (Cephes logf: frexp, then a polynomial; ~1 ulp), in float32
    adds and multiplies only, in the order the kernel's _log_k uses: bit-identical on any device."""
    bits = v.view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 126                       # v = m * 2^e, m in [0.5, 1)
    m = ((bits & 0x7FFFFF) | 0x3F000000).view(torch.float32)
    small = m < 0.70710677
    e = e - small.to(torch.int32)
    x = torch.where(small, (m + m) - 1.0, m - 1.0)        # exact (Sterbenz)
    fe = e.to(torch.float32)
    z = x * x
    y = x * 7.0376836292e-2 - 1.1514610310e-1
    y = y * x + 1.1676998740e-1
    y = y * x - 1.2420140846e-1
    y = y * x + 1.4249322787e-1
    y = y * x - 1.6668057665e-1
    y = y * x + 2.0000714765e-1
    y = y * x - 2.4999993993e-1
    y = y * x + 3.3333331174e-1
    y = (y * x) * z
    y = y + fe * -2.12194440e-4
    y = y - z * 0.5
    return (x + y) + fe * 0.693359375


def gumbel_scores(x: torch.Tensor, ids: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """x - log(E) per element: x [B, n] float32 (logits / temperature), ids [n] int64 global token ids, s1 / s2 [B]
    the rows' seeds. E = -log(1 - w), w = (hash + 1/2) / 2^32 in (0, 1): for w < 1/16 a series (the smallest E,
    which decide the winners, keep full precision), else through _log."""
    return _noise(x, ids[None, :], s1[:, None], s2[:, None])


def _noise(x: torch.Tensor, ids: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """gumbel_scores on operands of any broadcastable shapes (the same ops element by element, so the same bits)."""
    h = _mix32(_mix32(ids ^ s1) ^ s2)
    w = ((h.to(torch.float32) + 0.5) * 2.0 ** -32).clamp_max(0.99999994)
    t = w * (1.0 / 7.0) + (1.0 / 6.0)
    t = t * w + 0.2
    t = t * w + 0.25
    t = t * w + (1.0 / 3.0)
    t = t * w + 0.5
    t = t * w + 1.0
    e = torch.where(w < 0.0625, t * w, -_log(1.0 - w))
    return x - _log(e)


# The CPU draw (gumbel_argmax): an upper bound of every score, then the exact scores of the few tokens that could
# win. Chunks of fewer than NOISE_CHUNK elements keep each temporary in L2 (128 KB) and below ATen's grain size, so
# that every op runs on one thread: on 2 shared cores, handing ops of this size to two threads cost 10x more than
# the work (a [64, 256] max with indices 19 ms, 2026-11-27).
NOISE_CHUNK = 32767
# The bound is x - log(w) (E >= w) with log2(w) >= e + m - 1 read off w's float bits (w = 2^e m, m in [1, 2)):
# at most 0.06 nats high, and w rounded down (the hash's last bit dropped: up to ln 3 for the smallest hashes).
# A score lies below its bound by less than SCORE_GAP (log(E / w) <= 2.81 at the largest w, plus the 0.06) and
# above it by less than BOUND_ERR plus 2^-20 of its size (roundings of x, w and the logs).
SCORE_GAP = 3.0
BOUND_ERR = 1e-3
_LN2 = 0.6931471805599453


def _as_int32(v: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) as int32 with the same bits."""
    return (v - ((v >> 31) << 32)).to(torch.int32)


class _ScoreBounds:
    """Upper bounds of gumbel_scores for [B, <= width] blocks, in int32 and float32 buffers made once: the hash
    exactly (_mix32 in place on int32 holding the 32 bits: products wrap mod 2^32, shifts masked to be logical),
    then the bound above. Every constant is an int32 tensor: a Python int operand is wrapped and copied at every op."""

    def __init__(self, s1: torch.Tensor, s2: torch.Tensor, width: int):
        def const(v):
            return torch.tensor(v - (1 << 32) if v >= 1 << 31 else v, dtype=torch.int32, device=s1.device)
        self.m16, self.m17, self.m31 = const(0xFFFF), const(0x1FFFF), const(0x7FFFFFFF)
        self.c1, self.c2 = const(0x7FEB352D), const(0x846CA68B)
        self.one, self.fifteen, self.sixteen = const(1), const(15), const(16)
        self.s1, self.s2 = _as_int32(s1)[:, None], _as_int32(s2)[:, None]
        self.h, self.tmp = torch.empty(2, s1.shape[0], width, dtype=torch.int32, device=s1.device)
        self.half, self.log2 = torch.empty(2, s1.shape[0], width, device=s1.device)

    def _mix32(self, x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
        x ^= torch.bitwise_right_shift(x, self.sixteen, out=tmp).bitwise_and_(self.m16)
        x *= self.c1
        x ^= torch.bitwise_right_shift(x, self.fifteen, out=tmp).bitwise_and_(self.m17)
        x *= self.c2
        x ^= torch.bitwise_right_shift(x, self.sixteen, out=tmp).bitwise_and_(self.m16)
        return x

    def __call__(self, lg: torch.Tensor, inv_t: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [B, n] = the bounds of the scores of x = lg * inv_t[:, None] ([B, n]) at token ids [n] (int32)."""
        n = ids.shape[0]
        h, tmp, half, log2 = (t[:, :n] for t in (self.h, self.tmp, self.half, self.log2))
        self._mix32(torch.bitwise_xor(ids, self.s1, out=h), tmp)
        h ^= self.s2
        self._mix32(h, tmp)
        half.copy_(torch.bitwise_right_shift(h, self.one, out=tmp).bitwise_and_(self.m31)).clamp_(min=0.25)
        log2.copy_(half.view(torch.int32))  # (e + 127 + m - 1) 2^23 for hash / 2 = 2^e m: e + m - 1 <= log2
        torch.mul(lg, inv_t[:, None], out=out)
        return out.add_(log2.mul_(-_LN2 / (1 << 23)).add_((127 + 32 - 1) * _LN2))


def gumbel_argmax(lg: torch.Tensor, inv_t: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor,
                  keep: torch.Tensor | None = None, chunk: int = NOISE_CHUNK) -> torch.Tensor:
    """For x = lg * inv_t[:, None] + 0.0 ([B, n] float32), the argmax over each row of gumbel_scores(x, arange(n),
    s1, s2), only at `keep` [B, n] where given (the first maximum at ties; 0 for a row with nothing finite to keep):
    the same token, with exact scores only where it could be. The vocabulary in chunks of about `chunk` elements:
    each chunk's score bounds (_ScoreBounds) and its best bound per row; then, in the chunks whose best comes within
    SCORE_GAP of the row's, the (row, column) pairs that do (no other can beat the score of the token with the
    row's best bound), and their exact scores. A flat row keeps ~20 pairs, a peaked one fewer. Host syncs
    (nonzero): the CPU's draw."""
    B, n = lg.shape
    step = max(1, chunk // max(B, 1))
    chunks = -(-n // step)
    score_bounds = _ScoreBounds(s1, s2, step)
    ids = torch.arange(chunks * step, dtype=torch.int32, device=lg.device)
    bounds = torch.empty(chunks, B, step, device=lg.device)
    bounds[-1, :, n - (chunks - 1) * step:] = float("-inf")
    best = torch.empty(chunks, B, device=lg.device)
    for k in range(chunks):
        c0, c1 = k * step, min(n, (k + 1) * step)
        bound = score_bounds(lg[:, c0:c1], inv_t, ids[c0:c1], bounds[k, :, :c1 - c0])
        if keep is not None:
            bound.masked_fill_(~keep[:, c0:c1], float("-inf"))
        torch.amax(bound, dim=1, out=best[k])
    top = best.amax(dim=0)
    floor = torch.sub(top, top.abs(), alpha=2 ** -20).sub_(SCORE_GAP + BOUND_ERR + 128 * 2 ** -20)
    floor.clamp_(min=torch.finfo(torch.float32).min)  # a row with nothing finite keeps nothing
    k, row = (best >= floor).nonzero(as_tuple=True)
    pi, j = (bounds[k, row] >= floor[row, None]).nonzero(as_tuple=True)
    r, c = row[pi], k[pi] * step + j
    scores = _noise(lg[r, c] * inv_t[r] + 0.0, c, s1[r], s2[r])
    top = torch.full((B,), float("-inf"), device=lg.device).scatter_reduce_(0, r, scores, "amax")
    hit = scores == top[r]
    first = torch.full((B,), n, dtype=torch.int64, device=lg.device).scatter_reduce_(0, r[hit], c[hit], "amin")
    return torch.where(first < n, first, 0)


def masses(d: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """floor(exp(d) * 2^MASS_BITS) as int64 for d = x - max x <= 0 (0 where not valid): Cephes expf in float32 adds
    and multiplies, so every device gives the same integers and their sums do not depend on order."""
    d = torch.where(valid, d, -32.0).clamp(-32.0, 0.0)    # exp(-32) * 2^40 < 1: weighs 0
    n = torch.floor(d * 1.44269504088896341 + 0.5)
    r = d - n * 0.693359375
    r = r - n * -2.12194440e-4
    z = r * r
    y = r * 1.9875691500e-4 + 1.3981999507e-3
    y = y * r + 8.3334519073e-3
    y = y * r + 4.1665795894e-2
    y = y * r + 1.6666665459e-1
    y = y * r + 5.0000001201e-1
    y = (y * z + r) + 1.0
    scale = ((n.to(torch.int32) + (MASS_BITS + 127)) << 23).view(torch.float32)  # 2^(n + 40), exact
    return torch.where(valid, torch.floor(y * scale).to(torch.int64), 0)


# ----------------------------------------------------------------------------- the shard pass (Triton)
if triton is not None:
    @triton.jit
    def _mix32_k(x):
        x = x ^ (x >> 16)
        x = (x * 0x352D + (((x * 0x7FEB) & 0xFFFF) << 16)) & 0xFFFFFFFF
        x = x ^ (x >> 15)
        x = (x * 0xA68B + (((x * 0x846C) & 0xFFFF) << 16)) & 0xFFFFFFFF
        return x ^ (x >> 16)

    @triton.jit
    def _log_k(v):
        bits = v.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) - 126
        m = ((bits & 0x7FFFFF) | 0x3F000000).to(tl.float32, bitcast=True)
        small = m < 0.70710677
        e = e - small.to(tl.int32)
        x = tl.where(small, (m + m) - 1.0, m - 1.0)
        fe = e.to(tl.float32)
        z = x * x
        y = x * 7.0376836292e-2 - 1.1514610310e-1
        y = y * x + 1.1676998740e-1
        y = y * x - 1.2420140846e-1
        y = y * x + 1.4249322787e-1
        y = y * x - 1.6668057665e-1
        y = y * x + 2.0000714765e-1
        y = y * x - 2.4999993993e-1
        y = y * x + 3.3333331174e-1
        y = (y * x) * z
        y = y + fe * -2.12194440e-4
        y = y - z * 0.5
        return (x + y) + fe * 0.693359375

    @triton.jit
    def seeds_k(key, ctr):
        """row_seeds: a row's two 32-bit seeds from its key and counter (int64 scalars)."""
        s1 = _mix32_k(_mix32_k(_mix32_k(_mix32_k(key & 0xFFFFFFFF) ^ ((key >> 32) & 0xFFFFFFFF))
                               ^ (ctr & 0xFFFFFFFF)) ^ ((ctr >> 32) & 0xFFFFFFFF))
        return s1, _mix32_k(s1 ^ 0x9E3779B9)

    @triton.jit
    def log_noise_k(ids, s1, s2):
        """log(E) of gumbel_scores (a score is x - log(E)) at global token ids (int64), the same ops in order."""
        h = _mix32_k(_mix32_k(ids ^ s1) ^ s2)
        w = tl.minimum((h.to(tl.float32) + 0.5) * 2.3283064365386963e-10, 0.99999994)
        t = w * 0.14285714285714285 + 0.16666666666666666
        t = t * w + 0.2
        t = t * w + 0.25
        t = t * w + 0.3333333333333333
        t = t * w + 0.5
        t = t * w + 1.0
        e = tl.where(w < 0.0625, t * w, -_log_k(1.0 - w))
        return _log_k(e)

    @triton.jit
    def _shard_pass_kernel(logits_ptr, stride, n_valid, n_cols, start, inv_t_ptr, key_ptr, ctr_ptr,
                           val_ptr, idx_ptr, score_ptr, nb,
                           SAMPLED: tl.constexpr, WRITE_SCORES: tl.constexpr, BLOCK: tl.constexpr):
        """Program (row, block): the block's masked max logit and its first column, and with SAMPLED the same of
        the Gumbel scores (written out with WRITE_SCORES, for the filters). Same arithmetic as gumbel_scores."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        row = tl.program_id(0)
        blk = tl.program_id(1)
        cols = blk * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n_valid
        lg = tl.load(logits_ptr + row * stride + cols, mask=ok, other=float("-inf"))
        out = (row * nb + blk) * 2
        tl.store(val_ptr + out, tl.max(lg, 0))
        tl.store(idx_ptr + out, blk * BLOCK + tl.argmax(lg, 0, tie_break_left=True) + start)
        if SAMPLED:
            s1, s2 = seeds_k(tl.load(key_ptr + row), tl.load(ctr_ptr + row))
            s = lg * tl.load(inv_t_ptr + row) - log_noise_k((cols + start).to(tl.int64), s1, s2)
            s = tl.where(ok, s, float("-inf"))
            if WRITE_SCORES:
                tl.store(score_ptr + row * n_cols + cols, s, mask=cols < n_cols)
            tl.store(val_ptr + out + 1, tl.max(s, 0))
            tl.store(idx_ptr + out + 1, blk * BLOCK + tl.argmax(s, 0, tie_break_left=True) + start)


def shard_pass_torch(logits: torch.Tensor, n_valid: int, start: int, inv_t: torch.Tensor, key: torch.Tensor,
                     counter: torch.Tensor, sampled: bool, write_scores: bool):
    """The shard's per-row candidates: (values [B, 2], ids [B, 2]) = (masked max logit, Gumbel-max score) and their
    global ids, the first maximum at ties (column 1 only when sampled), and the scores [B, n] (write_scores) or
    None. The twin of shard_pass_fast, in torch ops (what the tests hold the kernel to)."""
    B, n = logits.shape
    valid = torch.arange(n, device=logits.device) < n_valid
    lg = logits.masked_fill(~valid, float("-inf"))
    vals = torch.zeros(B, 2, dtype=torch.float32, device=logits.device)
    ids = torch.zeros(B, 2, dtype=torch.int64, device=logits.device)
    vals[:, 0], ids[:, 0] = lg.max(dim=-1).values, torch.argmax(lg, dim=-1) + start
    scores = None
    if sampled:
        s1, s2 = row_seeds(key, counter)
        scores = gumbel_scores(lg * inv_t[:, None], torch.arange(start, start + n, device=logits.device), s1, s2)
        scores = scores.masked_fill(~valid, float("-inf"))
        vals[:, 1], ids[:, 1] = scores.max(dim=-1).values, torch.argmax(scores, dim=-1) + start
    return vals, ids, scores if write_scores else None


def shard_pass_fast(logits: torch.Tensor, n_valid: int, start: int, inv_t: torch.Tensor, key: torch.Tensor,
                    counter: torch.Tensor, sampled: bool, write_scores: bool):
    """shard_pass_torch in one launch: one program per (row, block of BLOCK columns), then the first best block."""
    B, n = logits.shape
    nb = max(1, triton.cdiv(n, BLOCK))
    vals = torch.empty(B, nb, 2, dtype=torch.float32, device=logits.device)
    idx = torch.empty(B, nb, 2, dtype=torch.int64, device=logits.device)
    scores = torch.empty(B, n, dtype=torch.float32, device=logits.device) if write_scores else vals
    if B:
        # no FMA contraction: each add and multiply rounds on its own, as in the torch twin
        _shard_pass_kernel[(B, nb)](logits, logits.stride(0), n_valid, n, start, inv_t, key, counter, vals, idx,
                                    scores, nb, SAMPLED=sampled, WRITE_SCORES=write_scores, BLOCK=BLOCK,
                                    enable_fp_fusion=False, **pdl())
    best = vals.argmax(dim=1, keepdim=True)  # the first best block: the lowest id at ties
    return (vals.gather(1, best)[:, 0], idx.gather(1, best)[:, 0], scores if write_scores else None)


# ----------------------------------------------------------------------------- shared steps
@dataclass
class SampleBatch:
    """One step's rows, on the device except the hints. suppress: (rows, ids) with global ids; the hints say what
    the host knows (every temperature is 0 / some row has top-k / some row has top-p), so that no work is spent
    finding out, and every rank runs the same collectives."""
    temperature: torch.Tensor                 # [B] float32; 0 = greedy
    top_k: torch.Tensor                       # [B] float32; 0 = off
    top_p: torch.Tensor                       # [B] float32; 1 = off
    key: torch.Tensor                         # [B] int64
    counter: torch.Tensor                     # [B] int64
    suppress: tuple[torch.Tensor, torch.Tensor] | None = None
    greedy_only: bool = False
    any_top_k: bool = True
    any_top_p: bool = True

    @property
    def inv_temperature(self) -> torch.Tensor:
        t = self.temperature
        return torch.where(t > 0, 1.0 / torch.where(t > 0, t, 1.0), 1.0)

    def k_limit(self) -> torch.Tensor:
        k = self.top_k.to(torch.int64)
        return torch.where(k > 0, k, NO_LIMIT)

    def p_limit(self, total: torch.Tensor) -> torch.Tensor:
        """ceil(top_p * total) for the rows with top-p: a token is kept while the mass before it is below this."""
        p = torch.ceil(self.top_p.double() * total.double()).to(torch.int64)
        return torch.where(self.top_p < 1, p, NO_LIMIT)


def _suppressed(logits: torch.Tensor, suppress, start: int) -> torch.Tensor:
    """A copy of logits [B, n] (columns start..start+n-1) with -inf at the suppressed (row, id) pairs; ids outside
    land in a spare column (a mask of them would cost a host sync)."""
    if suppress is None or not suppress[0].numel():
        return logits
    B, n = logits.shape
    rows, ids = suppress
    local = ids - start
    masked = torch.empty(B, n + 1, dtype=logits.dtype, device=logits.device)
    masked[:, :n] = logits
    # index_fill_ takes the value as a kernel argument: an indexed assignment of a Python float copies it to the
    # device first, a synchronizing copy (caught on an H200 by tests/test_engine.py's sync-debug GPU test)
    masked.view(-1).index_fill_(0, rows * (n + 1) + torch.where((local >= 0) & (local < n), local, n), float("-inf"))
    return masked[:, :n]


def _finish(greedy: torch.Tensor, sampled: torch.Tensor, batch: SampleBatch) -> torch.Tensor:
    return torch.where(batch.temperature > 0, sampled, greedy)


# ----------------------------------------------------------------------------- the gathered reference
@torch.inference_mode()
def sample_torch(logits: torch.Tensor, batch: SampleBatch, num_real_tokens: int, vocab_size: int) -> torch.Tensor:
    """logits: this rank's vocabulary shard [B, vocab_size / tp] (float32; left as they are). Every rank gathers
    the full rows and samples them whole; returns [B] int64 token ids, the same on every rank."""
    full = parallel.all_gather_last_dim(logits)
    V = min(num_real_tokens, vocab_size)
    lg = _suppressed(full[:, :V], batch.suppress, 0)
    if batch.greedy_only:
        return torch.argmax(lg, dim=-1)  # the first maximum (max's index is not promised to be)
    inv_t = batch.inv_temperature
    s1, s2 = row_seeds(batch.key, batch.counter)
    keep = None
    if batch.any_top_k or batch.any_top_p:
        x = lg * inv_t[:, None] + 0.0                      # + 0.0: -0.0 becomes 0.0, one key per value
        xs, order = torch.sort(x, dim=-1, descending=True, stable=True)  # x descending, then id ascending
        valid = xs > float("-inf")
        keep = valid
        if batch.any_top_k:
            keep = valid & (torch.arange(V, device=lg.device)[None, :] < batch.k_limit()[:, None])
        if batch.any_top_p:
            m = masses(xs - (lg.amax(dim=-1) * inv_t)[:, None], keep)
            limit = batch.p_limit(m.sum(dim=-1))
            keep &= (torch.cumsum(m, dim=-1) - m) < limit[:, None]
        keep = torch.zeros_like(keep).scatter_(1, order, keep)
    if lg.device.type == "cpu":  # the same tokens without every score (the GPU computes them all, sync-free)
        sampled = gumbel_argmax(lg, inv_t, s1, s2, keep)
        if bool((batch.temperature > 0).all()):  # no greedy row: no argmax over the rows (a free check here)
            return sampled
    else:
        scores = gumbel_scores(lg * inv_t[:, None] + 0.0, torch.arange(V, device=lg.device), s1, s2)
        sampled = torch.argmax(scores if keep is None else scores.masked_fill(~keep, float("-inf")), dim=-1)
    return _finish(torch.argmax(lg, dim=-1), sampled, batch)


# ----------------------------------------------------------------------------- vocab-parallel
def vocab_shard(n: int, num_real_tokens: int, vocab_size: int, op: str) -> tuple[int, int]:
    """This rank's vocabulary shard for logits of n columns: (its first global id, its columns of real tokens);
    ValueError naming `op` if n is not the shard's width or the vocabulary too large for float32 ids."""
    start, size = even_split(vocab_size, parallel.tp_rank(), parallel.tp_size())
    if n != size or vocab_size > MAX_IDS:
        raise ValueError(f"{op}: logits of {n} columns for a shard of {size} (vocab {vocab_size}, "
                         f"at most {MAX_IDS})")
    return start, max(0, min(num_real_tokens - start, n))


def _pick(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Every rank's candidates [tp, B] -> [B] the id of the best, the lowest rank (so the lowest id) at ties."""
    best = values.argmax(dim=0, keepdim=True)
    return ids.gather(0, best)[0]


def _exchange(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather per-row candidates (values [B, c] float32, ids [B, c] int64) in one message: [tp, B, c] each."""
    both = parallel.all_gather(torch.cat([values, ids.to(torch.float32)], dim=1))
    c = values.shape[1]
    return both[..., :c], both[..., c:].to(torch.int64)


def _order_key(x: torch.Tensor) -> torch.Tensor:
    """int64 in [0, 2^32) with the order of float32 x (x has no -0.0)."""
    bits = x.view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, -1 - bits, bits + (1 << 31))


def _radix_keep(key: torch.Tensor, weight: torch.Tensor, member: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """Collective over the ranks. The members ([B, n] bool, n columns of this rank's shard) of the prefix, in the
    order (key descending, global id ascending), whose tokens each have less than `limit` [B] weight before them
    (weight [B, n] int64; limit >= 1, so the first member is always kept). Radix select of the threshold key tau
    over 4 bytes; at tau, the first c tied members are kept, counted across ranks in rank order."""
    B = key.shape[0]
    prefix = torch.zeros(B, dtype=torch.int64, device=key.device)
    above = torch.zeros(B, dtype=torch.int64, device=key.device)  # weight of the members above the prefix range
    rows = torch.arange(B, device=key.device)
    weight = weight * member
    for shift in (24, 16, 8, 0):
        cand = member & ((key >> (shift + 8)) == prefix[:, None])
        digit = (key >> shift) & 0xFF
        hist = torch.zeros(2, B, 256, dtype=torch.int64, device=key.device)
        hist[0].scatter_add_(1, digit, weight * cand)
        hist[1].scatter_add_(1, digit, cand.to(torch.int64))
        per_rank = parallel.all_gather(hist)
        total_w, total_c = per_rank.sum(dim=0)
        # weight strictly above each byte value: keep the lowest non-empty byte whose first token is still kept
        before = above[:, None] + torch.flip(torch.cumsum(torch.flip(total_w, [1]), 1), [1]) - total_w
        b = torch.argmax(((before < limit[:, None]) & (total_c > 0)).to(torch.int32), dim=1)
        above = before[rows, b]
        prefix = prefix * 256 + b
    tied_w, n_tied = total_w[rows, b], total_c[rows, b]
    w_tau = tied_w // n_tied.clamp_min(1)  # every tied member has the same weight
    c = torch.where(w_tau > 0, torch.minimum(n_tied, (limit - above + w_tau - 1) // w_tau.clamp_min(1)), n_tied)
    lower = per_rank[:, 1, rows, b].cumsum(dim=0)[parallel.tp_rank()] - per_rank[parallel.tp_rank(), 1, rows, b]
    tied = member & (key == prefix[:, None])
    rank_in_tie = lower[:, None] + torch.cumsum(tied.to(torch.int64), dim=1) - 1
    return member & ((key > prefix[:, None]) | (tied & (rank_in_tie < c[:, None])))


@torch.inference_mode()
def sample_fast(logits: torch.Tensor, batch: SampleBatch, num_real_tokens: int, vocab_size: int) -> torch.Tensor:
    """sample_torch's tokens from this rank's vocabulary shard alone: a Triton pass over the shard, then an
    all-gather of [B, 4] candidates (plus the filters' rounds when some row has top-k / top-p). Collective: every
    rank calls it with its shard and the same batch; returns [B] int64, the same on every rank."""
    B, n = logits.shape
    start, n_valid = vocab_shard(n, num_real_tokens, vocab_size, "sample_fast")
    lg = _suppressed(logits.contiguous(), batch.suppress, start)
    inv_t = batch.inv_temperature
    filtered = not batch.greedy_only and (batch.any_top_k or batch.any_top_p)
    vals, ids, scores = shard_pass_fast(lg, n_valid, start, inv_t, batch.key, batch.counter,
                                        sampled=not batch.greedy_only, write_scores=filtered)
    if batch.greedy_only:
        v, i = _exchange(vals[:, :1], ids[:, :1])
        return _pick(v[..., 0], i[..., 0])
    if not filtered:
        v, i = _exchange(vals, ids)
        return _finish(_pick(v[..., 0], i[..., 0]), _pick(v[..., 1], i[..., 1]), batch)
    v, i = _exchange(vals[:, :1], ids[:, :1])
    greedy = _pick(v[..., 0], i[..., 0])
    x = lg * inv_t[:, None] + 0.0
    cols = torch.arange(n, device=lg.device)
    keep = (cols < n_valid)[None, :] & (x > float("-inf"))
    key = _order_key(x)
    if batch.any_top_k:
        keep = _radix_keep(key, torch.ones_like(key), keep, batch.k_limit())
    if batch.any_top_p:
        m = masses(x - (v[..., 0].max(dim=0).values * inv_t)[:, None], keep)
        total = parallel.all_gather(m.sum(dim=-1)).sum(dim=0)
        keep = _radix_keep(key, m, keep, batch.p_limit(total))
    scores = scores.masked_fill(~keep, float("-inf"))
    best = scores.argmax(dim=-1, keepdim=True)
    v, i = _exchange(scores.gather(1, best), best + start)
    return _finish(greedy, _pick(v[..., 0], i[..., 0]), batch)


# ----------------------------------------------------------------------------- the tokens to their slots and the host
def feed_tokens_torch(tokens: torch.Tensor, slots: torch.Tensor, slot_tokens: torch.Tensor,
                      host: torch.Tensor | None = None) -> None:
    """A step's sampled tokens ([n] int64 on the device, row order) become their slots' next input
    (slot_tokens[slots[i]] = tokens[i]) and, given `host` ([n] int64, pinned), are copied there without waiting.
    Queued, no host sync."""
    slot_tokens[slots] = tokens
    if host is not None:
        host.copy_(tokens, non_blocking=True)


FEED_BLOCK = 128  # rows per program of the feed kernel

if triton is not None:
    @triton.jit(do_not_specialize=["n"])
    def _feed_tokens_kernel(tok_ptr, slot_ptr, slot_tok_ptr, host_ptr, n, HOST: tl.constexpr, BLOCK: tl.constexpr):
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = rows < n
        tok = tl.load(tok_ptr + rows, mask=mask)
        tl.store(slot_tok_ptr + tl.load(slot_ptr + rows, mask=mask), tok, mask=mask)
        if HOST:  # pinned host memory, reached from the device under unified addressing (zero-copy)
            tl.store(host_ptr + rows, tok, mask=mask)


def feed_tokens_fast(tokens: torch.Tensor, slots: torch.Tensor, slot_tokens: torch.Tensor,
                     host: torch.Tensor | None = None) -> None:
    """feed_tokens_torch in one launch: the kernel stores each token into its slot's input and straight into the
    pinned host buffer, where the torch way takes an index_put and a copy (two launches; the copy alone cost the
    host ~13 us a step on an H200 host, 2026-11-26). The host reads the buffer after an event recorded behind
    this kernel, as it would after a copy."""
    n = tokens.numel()
    if not n:
        return
    _feed_tokens_kernel[(triton.cdiv(n, FEED_BLOCK),)](tokens, slots, slot_tokens, tokens if host is None else host,
                                                       n, HOST=host is not None, BLOCK=FEED_BLOCK, **pdl())


def bind_feed_tokens() -> Callable[..., None]:
    """feed_tokens_fast or feed_tokens_torch, as the kernel set chosen at start says (layers/backend.py): the runner
    binds it once, as the layers bind theirs."""
    return feed_tokens_fast if backend.use_fast() else feed_tokens_torch


# ----------------------------------------------------------------------------- per-slot state, every rank
def stream_key(seed: int | None, engine_seed: int, serial: int) -> int:
    """The noise key of a request (a signed 64-bit int): its seed, or for an unseeded one a mix of the engine seed
    and its admission number (splitmix64), so that every unseeded request has a stream of its own."""
    if seed is not None:
        return seed
    z = (engine_seed * 0x9E3779B97F4A7C15 + serial + 0x632BE59BD9B4E019) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    z ^= z >> 31
    return z - 2**64 if z >= 2**63 else z


def _f32_bits(v: float) -> int:
    return struct.unpack("<i", struct.pack("<f", v))[0]


@dataclass
class SamplingStep:
    """What every rank needs to sample one step, as rank 0 sends it beside the step plan: the hints, the newly
    admitted slots' settings, and the suppressed (row, id) pairs. encode / decode: a list of ints, exact."""
    greedy_only: bool = True
    any_top_k: bool = False
    any_top_p: bool = False
    admitted: list[tuple[int, tuple[float, float, float], int]] = field(default_factory=list)  # slot, row, key
    suppress: list[tuple[int, int]] = field(default_factory=list)

    def encode(self) -> list[int]:
        out = [self.greedy_only | self.any_top_k << 1 | self.any_top_p << 2, len(self.admitted), len(self.suppress)]
        for slot, (t, k, p), key in self.admitted:
            out += (slot, _f32_bits(t), int(k), _f32_bits(p), key)
        for pair in self.suppress:
            out += pair
        return out

    @classmethod
    def decode(cls, v: list[int]) -> "SamplingStep":
        flags, n_adm, n_sup = v[:3]
        if len(v) != 3 + 5 * n_adm + 2 * n_sup:
            raise ValueError(f"not a sampling step ({len(v)} values, header {v[:3]})")
        f32 = lambda bits: struct.unpack("<f", struct.pack("<i", bits))[0]  # noqa: E731
        a = v[3:3 + 5 * n_adm]
        admitted = [(a[i], (f32(a[i + 1]), float(a[i + 2]), f32(a[i + 3])), a[i + 4]) for i in range(0, len(a), 5)]
        s = v[3 + 5 * n_adm:]
        return cls(bool(flags & 1), bool(flags & 2), bool(flags & 4), admitted, list(zip(s[0::2], s[1::2])))


class Sampler:
    """One per rank. Per state slot, on the device: (temperature, top_k, top_p), the noise key of the request
    holding it (written at admission) and its draw counter (reset at admission, one up per token drawn: the same
    on every rank, so that no rank ever needs another's). Binds sample_fast or sample_torch once, by kernel set."""

    def __init__(self, num_real_tokens: int, vocab_size: int, num_slots: int, device: torch.device | str):
        self.num_real_tokens, self.vocab_size = num_real_tokens, vocab_size
        self.device = torch.device(device)
        self.params = torch.zeros(num_slots, 3, device=self.device)
        self.params[:, 2] = 1.0
        self.keys = torch.zeros(num_slots, dtype=torch.int64, device=self.device)
        self.draws = torch.zeros(num_slots, dtype=torch.int64, device=self.device)
        self.impl = sample_fast if backend.use_fast() else sample_torch
        self._pin = self.device.type == "cuda"

    def _to_device(self, values: list) -> torch.Tensor:
        host = torch.tensor(values, dtype=torch.int64, pin_memory=self._pin)
        return host.to(self.device, non_blocking=True)

    def admit(self, step: SamplingStep) -> None:
        """Write the admitted slots' settings, ahead of the step that first samples them (one copy)."""
        if not step.admitted:
            return
        rows = self._to_device([[s, _f32_bits(t), int(k), _f32_bits(p), key] for s, (t, k, p), key in step.admitted])
        slots = rows[:, 0]
        floats = rows[:, 1:4:2].to(torch.int32).view(torch.float32)  # temperature, top_p (float32 bits)
        self.params[slots] = torch.stack([floats[:, 0], rows[:, 2].to(torch.float32), floats[:, 1]], dim=1)
        self.keys[slots] = rows[:, 4]
        self.draws.index_fill_(0, slots, 0)  # (an indexed scalar assignment would sync: its value goes through the host)

    def warm_up(self) -> None:
        """Sample a row of zero logits once per kind of step (greedy only; sampled; sampled with top-k and top-p),
        so that the shard pass's kernel variants compile at start rather than when the first request of a kind
        arrives (~1 s each). Collective, like sample(); leaves every slot's state as it was."""
        size = even_split(self.vocab_size, parallel.tp_rank(), parallel.tp_size())[1]
        logits = torch.zeros(1, size, device=self.device)
        slots = torch.zeros(1, dtype=torch.int64, device=self.device)
        draws = self.draws.clone()
        for greedy_only, filtered in ((True, False), (False, False), (False, True)):
            self.sample(logits, slots, SamplingStep(greedy_only, filtered, filtered))
        self.draws.copy_(draws)

    def sample(self, logits: torch.Tensor, slots: torch.Tensor, step: SamplingStep) -> torch.Tensor:
        """logits: this rank's shard [B, vocab/tp] of the rows of `slots` ([B] int64 on the device, distinct).
        Collective; returns [B] int64 token ids on the device, the same on every rank."""
        params = self.params[slots]
        suppress = None
        if step.suppress:
            suppress = tuple(self._to_device(list(zip(*step.suppress))))
        counter = self.draws[slots]
        batch = SampleBatch(params[:, 0], params[:, 1], params[:, 2], self.keys[slots], counter, suppress,
                            step.greedy_only, step.any_top_k, step.any_top_p)
        tokens = self.impl(logits, batch, self.num_real_tokens, self.vocab_size)
        self.draws[slots] = counter + 1
        return tokens
