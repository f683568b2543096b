"""Speculative decoding's token math, exact: drawing drafts from a distribution q, and verifying a step's k drafts
against the target's logits so that the emitted tokens follow the distribution non-speculative sampling draws from
(Leviathan et al. 2023, Chen et al. 2023). Pure tensor functions over whole-vocabulary rows, batched over sequences.

Greedy rows (temperature 0): the drafts are accepted while each equals the target's argmax at its position (ties to
the lowest id, as layers/sampler.py), then the target's argmax at the first mismatch, or after the last draft (the
bonus token): exactly the tokens greedy decoding gives.

Sampled rows: p_j is the target's distribution at position j as layers/sampler.py samples it (logits / temperature,
the top-k then top-p keep set by the same rule, renormalised), q_j the distribution draft j was drawn from. Draft j
is accepted with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection the token is drawn from
max(0, p_j - q_j) normalised; when every draft is accepted a bonus token is drawn from p_k. Each emitted token then
follows p given the tokens before it, whatever q is.

Noise is counter-based, as layers/sampler.py's: a row's key (its seed, or the engine's per request) and the draw
number of the output token a position stands for (position j of a step: `counter + j`), so a seeded request's
tokens depend on its seed, draw numbers and token ids alone. Three independent streams per (key, draw number), told
apart by the hashed id: a draft's Gumbel noise (token id + DRAFT_ID_OFFSET), the acceptance uniform (ACCEPT_ID),
and the residual's or bonus token's Gumbel noise (the token id itself: the noise sample_torch uses, so a position
with no draft emits sample_torch's token). A step that emits a + 1 tokens has used for them only the noise of draw
numbers counter .. counter + a; the next step starts at counter + a + 1, so no noise that decided an emitted token
is used again.

Suppressed ids (stop ids before min_tokens) depend on a position's draw number: the caller masks them (-inf) in the
logits of the positions they apply to; a SampleBatch with `suppress` set is refused. Logits cover the real vocabulary
only (the caller slices off padded columns).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from dist import parallel
from layers import backend
from layers.backend import pdl, prior_done, tl, triton
from layers.sampler import BLOCK, MAX_IDS, SampleBatch, gumbel_scores, masses, row_seeds, vocab_shard

if triton is not None:
    from layers.sampler import log_noise_k, seeds_k

DRAFT_ID_OFFSET = MAX_IDS  # a draft's noise for token id t hashes id t + DRAFT_ID_OFFSET (vocabularies are < MAX_IDS)
ACCEPT_ID = 2 * MAX_IDS    # the id whose noise gives a position's acceptance uniform


class Verdict(NamedTuple):
    tokens: torch.Tensor       # [B, k + 1] int64: the emitted tokens first (accepted drafts, then one more), -1 after
    num_emitted: torch.Tensor  # [B] int64: accepted drafts + 1


def _check(batch: SampleBatch) -> None:
    if batch.suppress is not None:
        raise ValueError("speculative sampling: mask suppressed ids in the logits of the positions they apply to "
                         "(a position's draw number decides them); SampleBatch.suppress is not supported here")


def filtered_logits(logits: torch.Tensor, batch: SampleBatch) -> torch.Tensor:
    """logits [R, V] float32 -> x = logits / temperature (1 for greedy rows) with -inf outside the row's top-k then
    top-p keep set: the set and the values layers/sampler.py sample_torch draws among, by the same rule (sorted by x
    descending then id ascending; top-p by fixed-point masses)."""
    x = logits * batch.inv_temperature[:, None] + 0.0  # + 0.0: -0.0 becomes 0.0, as in sample_torch
    if batch.greedy_only or not (batch.any_top_k or batch.any_top_p):
        return x
    xs, order = torch.sort(x, dim=-1, descending=True, stable=True)
    keep = xs > float("-inf")
    if batch.any_top_k:
        keep &= torch.arange(x.shape[-1], device=x.device)[None, :] < batch.k_limit()[:, None]
    if batch.any_top_p:
        m = masses(xs - xs[:, :1], keep)  # (the row's max: what sample_torch subtracts)
        keep &= (torch.cumsum(m, dim=-1) - m) < batch.p_limit(m.sum(dim=-1))[:, None]
    return x.masked_fill(~torch.zeros_like(keep).scatter_(1, order, keep), float("-inf"))


def at_positions(batch: SampleBatch, n: int) -> SampleBatch:
    """The rows of `batch` repeated for n positions each (row-major: [B * n]), position j at draw number counter + j."""
    def rep(t):
        return t.repeat_interleave(n)
    counter = rep(batch.counter) + torch.arange(n, device=batch.counter.device).repeat(batch.counter.shape[0])
    return dataclasses.replace(batch, temperature=rep(batch.temperature), top_k=rep(batch.top_k),
                               top_p=rep(batch.top_p), key=rep(batch.key), counter=counter)


def draft_sample(logits: torch.Tensor, batch: SampleBatch | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft per row from the draft model's logits [B, V] (float32): the argmax for greedy rows (batch None: all
    greedy), else a draw from q = softmax(filtered_logits) by Gumbel-max with the draft stream's noise at the row's
    draw number (batch.counter: the draw number of the output token the draft proposes). Returns tokens [B] int64
    and q [B, V] (one-hot at the argmax for greedy rows), or None when every row is greedy."""
    greedy = torch.argmax(logits, dim=-1)
    if batch is None or batch.greedy_only:
        return greedy, None
    _check(batch)
    x = filtered_logits(logits, batch)
    s1, s2 = row_seeds(batch.key, batch.counter)
    ids = torch.arange(x.shape[-1], device=x.device) + DRAFT_ID_OFFSET
    sampled = batch.temperature > 0
    tokens = torch.where(sampled, torch.argmax(gumbel_scores(x, ids, s1, s2), dim=-1), greedy)
    probs = torch.where(sampled[:, None], torch.softmax(x, dim=-1),
                        torch.nn.functional.one_hot(greedy, x.shape[-1]).to(x.dtype))
    return tokens, probs


def _drafted(drafts: torch.Tensor, num_drafts: torch.Tensor | None) -> torch.Tensor:
    """[B, k] bool: position j holds a draft of its row (j < num_drafts; every position when None)."""
    if num_drafts is None:
        return torch.ones_like(drafts, dtype=torch.bool)
    return torch.arange(drafts.shape[1], device=drafts.device)[None, :] < num_drafts[:, None]


def _accepted(ok: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor | None) -> torch.Tensor:
    """[B] the drafts accepted per row: the length of the prefix of `ok` [B, k] among the row's drafts."""
    return (ok & _drafted(drafts, num_drafts)).to(torch.int64).cumprod(dim=1).sum(dim=1)


def _emit(tokens: torch.Tensor, accepted: torch.Tensor) -> Verdict:
    after = torch.arange(tokens.shape[1], device=tokens.device)[None, :] > accepted[:, None]
    return Verdict(tokens.masked_fill(after, -1), accepted + 1)


def verify_greedy(target_logits: torch.Tensor, drafts: torch.Tensor,
                  num_drafts: torch.Tensor | None = None) -> Verdict:
    """target_logits [B, k + 1, V] (position j: the target's logits for the token draft j proposes; position k: the
    bonus token's), drafts [B, k] int64, num_drafts [B] (rows with fewer drafts; None: k each). The longest prefix
    of drafts equal to the target's argmax, then the target's argmax."""
    target = torch.argmax(target_logits, dim=-1)
    k = drafts.shape[1]
    return _emit(target, _accepted(drafts == target[:, :k], drafts, num_drafts))


def verify_sampled(target_logits: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor,
                   batch: SampleBatch, num_drafts: torch.Tensor | None = None) -> Verdict:
    """Rejection sampling (module docstring) for every row as sampled: target_logits [B, k + 1, V] float32, drafts
    [B, k], draft_probs [B, k, V] (q of each draft), batch: the rows' settings, counter = the draw number of the
    output token position 0 stands for."""
    _check(batch)
    B, n, V = target_logits.shape
    k = n - 1
    rows = at_positions(batch, n)
    x = filtered_logits(target_logits.reshape(B * n, V), rows)
    p = torch.softmax(x, dim=-1).view(B, n, V)
    x = x.view(B, n, V)
    s1, s2 = row_seeds(rows.key, rows.counter)
    # E ~ Exp(1) from the acceptance id's Gumbel score g = -log E, then u = exp(-E) ~ U(0, 1): accept iff u q < p
    accept_id = torch.full((1,), ACCEPT_ID, dtype=torch.int64, device=x.device)  # (no host copy: CUDA graphs)
    g = gumbel_scores(torch.zeros(B * n, 1, device=x.device), accept_id, s1, s2)
    u = torch.exp(-torch.exp(-g)).view(B, n)
    s1, s2 = s1.view(B, n), s2.view(B, n)
    d = drafts[..., None]
    accepted = _accepted(u[:, :k] * draft_probs.gather(2, d)[..., 0] < p[:, :k].gather(2, d)[..., 0], drafts,
                         num_drafts)
    i = torch.arange(B, device=x.device)
    scores_x = x[i, accepted]  # the bonus token's: p itself
    if k:
        # rejected at `accepted` (fewer than the row's drafts were accepted): the residual max(0, p - q) instead
        rejected = accepted < (k if num_drafts is None else num_drafts)
        residual = (p[i, accepted] - draft_probs[i, accepted.clamp(max=k - 1)]).clamp_min(0)
        # (p(d) < q(d) makes the residual's mass positive; should rounding leave none, p itself)
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p[i, accepted])
        scores_x = torch.where(rejected[:, None], residual.log(), scores_x)
    last = torch.argmax(gumbel_scores(scores_x, torch.arange(V, device=x.device), s1[i, accepted], s2[i, accepted]),
                        dim=-1)
    tokens = torch.cat([drafts, drafts.new_zeros(B, 1)], dim=1).scatter(1, accepted[:, None], last[:, None])
    return _emit(tokens, accepted)


def verify(target_logits: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None,
           batch: SampleBatch | None, num_drafts: torch.Tensor | None = None) -> Verdict:
    """A verify step's emitted tokens: verify_greedy for greedy rows (batch None: every row), verify_sampled for
    rows with a temperature (their draft_probs from draft_sample)."""
    greedy = verify_greedy(target_logits, drafts, num_drafts)
    if batch is None or batch.greedy_only:
        return greedy
    sampled = verify_sampled(target_logits, drafts, draft_probs, batch, num_drafts)
    rows = batch.temperature > 0
    return Verdict(torch.where(rows[:, None], sampled.tokens, greedy.tokens),
                   torch.where(rows, sampled.num_emitted, greedy.num_emitted))


# ----------------------------------------------------------------------------- on vocabulary shards (the engine's)
# The engine drafts and verifies from each rank's vocabulary shard of the logits ([rows, n] float32 columns
# start .. start + n - 1 of the padded vocabulary). Between a draft and its verification a slot keeps, per draft,
# the shard of the draft logits (raw: the filters and the temperature are applied again, the same way) and the
# log-sum-exp of the x they were drawn from; q(v) = exp(x_v - lse). Two implementations, same signature:
#   draft_torch / verify_torch  the reference: gather the whole rows, then draft_sample / verify above;
#   draft_fast / verify_fast    vocab-parallel: Triton kernels and all-gathers of a few floats per row
#                               (parallel.all_gather: inside a CUDA graph, no NCCL call), no torch op between.
#                               Rows with top-k / top-p go the reference way (their steps run eagerly anyway).
#     the stats pass  program (row, block): the block's max x, its first argmax, the sum of exp(x - max x), the best
#                     Gumbel score and its id; the row's last program to arrive (an arrival counter, which it resets
#                     for the next launch) merges the row's blocks into its STATS, in the all-gather's message;
#     a draft         the stats pass, the all-gather, _draw_kernel (the ranks' STATS merged: the token and lse);
#     a verify        the stats pass over every position (with the x of its draft under p and q, from the rank
#                     whose shard holds it), the all-gather, _accept_kernel (a program per sequence: the ranks'
#                     STATS merged, the drafts accepted, the verdict written; greedy rows are done); for sampled
#                     rows the token at the first rejected (or bonus) position: the residual pass, reading that
#                     position's rows in place (its blocks merged as the stats pass's), the all-gather,
#                     _last_token_kernel. Three launches (all-gathers included) per draft and per greedy verify,
#                     six per sampled verify.
# Parts merge as merge_stats / merge_residual do (the first part, so the lowest id, at ties; ranks in rank order).
# They draw the same tokens but for float rounding: the fast path's exp and log-sum-exp are Triton's and summed
# per block, so p and q differ from the reference's in the last bits, and a draw whose acceptance uniform falls
# within those bits of p/q (probability ~1e-7) may go the other way. Either path is exact in distribution.
STATS = 6      # per row: max x, its first id, sum exp(x - max x), best Gumbel score, its first id, and the log of
#                the row's acceptance noise (E at ACCEPT_ID: the uniform u = exp(-E), as verify_sampled)
PART = 5       # per row and block of the stats pass: STATS but the noise (drawn once per row, by the merging program)
DRAFT_X = 2    # a verify row's STATS are followed by x of its draft under p and under q (-inf off the draft's shard)
RESIDUAL = 5   # per row (and block): best residual score, its id, residual mass, best score of p itself, its id
POSITIONS = 16  # _accept_kernel's tile of a sequence's positions: k + 1 <= 16 (scheduler.speculation.MAX_K is 8)


class DraftDraw(NamedTuple):
    tokens: torch.Tensor  # [B] int64
    lse: torch.Tensor     # [B] float32: log-sum-exp of the row's x (sampled rows; 0 for greedy rows)


def _vocab(num_real_tokens: int, vocab_size: int) -> int:
    return min(num_real_tokens, vocab_size)


def draft_torch(logits: torch.Tensor, batch: SampleBatch | None, num_real_tokens: int,
                vocab_size: int) -> DraftDraw:
    """One draft per row from this rank's shard of the draft logits [B, n] (draft_sample on the gathered rows)."""
    full = parallel.all_gather_last_dim(logits)[:, :_vocab(num_real_tokens, vocab_size)]
    tokens, probs = draft_sample(full, batch)
    if probs is None:
        return DraftDraw(tokens, torch.zeros(full.shape[0], device=full.device))
    lse = torch.logsumexp(filtered_logits(full, batch), dim=-1)
    return DraftDraw(tokens, torch.where(batch.temperature > 0, lse, 0.0))


def verify_torch(logits: torch.Tensor, drafts: torch.Tensor, draft_logits: torch.Tensor, draft_lse: torch.Tensor,
                 batch: SampleBatch | None, num_drafts: torch.Tensor | None, num_real_tokens: int,
                 vocab_size: int) -> Verdict:
    """A verify step's emitted tokens from this rank's shards: logits [B, k + 1, n] (the target's), drafts [B, k],
    draft_logits [B, k, n] and draft_lse [B, k] (what the drafts were drawn from: DraftDraw), batch (None: every
    row greedy), num_drafts [B] (None: k each). verify on the gathered rows, q = exp(x - lse)."""
    B, T, n = logits.shape
    V = _vocab(num_real_tokens, vocab_size)
    full = parallel.all_gather_last_dim(logits.reshape(B * T, n))[:, :V].view(B, T, V)
    if batch is None or batch.greedy_only:
        return verify_greedy(full, drafts, num_drafts)
    k = T - 1
    xq = parallel.all_gather_last_dim(draft_logits.reshape(B * k, n))[:, :V]
    probs = torch.exp(filtered_logits(xq, at_positions(batch, k)) - draft_lse.reshape(B * k, 1)).view(B, k, V)
    return verify(full, drafts, probs, batch, num_drafts)


# The torch twins of the passes (what the tests hold the kernels to), and the merges of their parts.
def _best(v: torch.Tensor, ids: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest value along `dim` and its id, the first (lowest block / rank: lowest id) at ties."""
    i = v.argmax(dim=dim, keepdim=True)
    return v.gather(dim, i).squeeze(dim), ids.gather(dim, i).squeeze(dim)


def _merge_sum(m: torch.Tensor, s: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum of exp(x - max x) over parts along `dim`, from each part's own max and sum; empty parts (max -inf)
    add nothing."""
    M = m.amax(dim=dim, keepdim=True)
    return torch.where(m > float("-inf"), s * torch.exp(m - M), 0.0).sum(dim=dim)


def merge_stats(st: torch.Tensor, dim: int) -> torch.Tensor:
    """STATS of parts (blocks of a shard, or the ranks' shards) along `dim` -> STATS of the whole."""
    mx, am = _best(st[..., 0], st[..., 1], dim)
    s = _merge_sum(st[..., 0], st[..., 2], dim)
    sc, si = _best(st[..., 3], st[..., 4], dim)
    return torch.stack([mx, am, s, sc, si, st[..., 5].select(dim, 0)], dim=-1)  # (the same noise in every part)


def merge_residual(r: torch.Tensor, dim: int) -> torch.Tensor:
    rs, ri = _best(r[..., 0], r[..., 1], dim)
    bs, bi = _best(r[..., 3], r[..., 4], dim)
    return torch.stack([rs, ri, r[..., 2].sum(dim=dim), bs, bi], dim=-1)


def stats_torch(logits: torch.Tensor, n_valid: int, start: int, id_offset: int, inv_t: torch.Tensor,
                key: torch.Tensor, counter: torch.Tensor, sampled: bool, accept: bool = False) -> torch.Tensor:
    """[R, STATS] of a shard's rows [R, n] (columns past n_valid are padding), each row with its own inv_t, key
    and counter: the twin of stats_fast."""
    R, n = logits.shape
    valid = torch.arange(n, device=logits.device) < n_valid
    x = (logits * inv_t[:, None] + 0.0).masked_fill(~valid, float("-inf"))
    out = torch.zeros(R, STATS, device=logits.device)
    out[:, 0], out[:, 1] = x.max(dim=-1).values, (torch.argmax(x, dim=-1) + start).float()
    out[:, 2] = torch.where(valid, torch.exp(x - out[:, :1]), 0.0).sum(dim=-1)
    out[:, 3] = float("-inf")
    s1, s2 = row_seeds(key, counter) if sampled or accept else (None, None)
    if sampled:
        sc = gumbel_scores(x, torch.arange(start, start + n, device=x.device) + id_offset, s1, s2)
        sc = sc.masked_fill(~valid, float("-inf"))
        out[:, 3], out[:, 4] = sc.max(dim=-1).values, (torch.argmax(sc, dim=-1) + start).float()
    if accept:
        accept_id = torch.full((1,), ACCEPT_ID, dtype=torch.int64, device=logits.device)
        out[:, 5] = -gumbel_scores(torch.zeros(R, 1, device=logits.device), accept_id, s1, s2)[:, 0]
    return out


def residual_torch(p_logits: torch.Tensor, q_logits: torch.Tensor, n_valid: int, start: int, inv_t: torch.Tensor,
                   lse_p: torch.Tensor, lse_q: torch.Tensor, key: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """[R, RESIDUAL] of the rows [R, n] of the target's and the draft's logits: the twin of residual_fast."""
    R, n = p_logits.shape
    valid = torch.arange(n, device=p_logits.device) < n_valid
    xp = (p_logits * inv_t[:, None] + 0.0).masked_fill(~valid, float("-inf"))
    xq = (q_logits * inv_t[:, None] + 0.0).masked_fill(~valid, float("-inf"))
    r = (torch.exp(xp - lse_p[:, None]) - torch.exp(xq - lse_q[:, None])).clamp_min(0.0).masked_fill(~valid, 0.0)
    s1, s2 = row_seeds(key, counter)
    ids = torch.arange(start, start + n, device=xp.device)
    rs = gumbel_scores(torch.where(r > 0, r.log(), float("-inf")), ids, s1, s2)
    bs = gumbel_scores(xp, ids, s1, s2).masked_fill(~valid, float("-inf"))
    out = torch.empty(R, RESIDUAL, device=xp.device)
    out[:, 0], out[:, 1] = rs.max(dim=-1).values, (torch.argmax(rs, dim=-1) + start).float()
    out[:, 2] = r.sum(dim=-1)
    out[:, 3], out[:, 4] = bs.max(dim=-1).values, (torch.argmax(bs, dim=-1) + start).float()
    return out


if triton is not None:
    @triton.jit
    def _best_k(v, ids, parts, AXIS: tl.constexpr):
        """_best in a kernel: the largest of v along AXIS and the id of the first part holding it (parts: each
        element's part index, broadcastable to v)."""
        first = tl.argmax(v, AXIS, tie_break_left=True)
        return tl.max(v, AXIS), tl.sum(tl.where(parts == tl.expand_dims(first, AXIS), ids, 0.0), AXIS)

    @triton.jit
    def _merge_k(at, ok, parts, AXIS: tl.constexpr, SUM_OF_EXP: tl.constexpr):
        """merge_stats' first five fields (SUM_OF_EXP: field 2 sums exp(x - max x), _merge_sum) or merge_residual
        over the parts along AXIS, each part's fields at `at` (where `ok`). The parts were stored by other programs
        of this kernel or by the kernels before: read from L2 (.cg)."""
        m = tl.load(at, mask=ok, other=float("-inf"), cache_modifier=".cg")
        v0, i0 = _best_k(m, tl.load(at + 1, mask=ok, other=0.0, cache_modifier=".cg"), parts, AXIS)
        s = tl.load(at + 2, mask=ok, other=0.0, cache_modifier=".cg")
        if SUM_OF_EXP:
            top = tl.expand_dims(tl.where(v0 > float("-inf"), v0, 0.0), AXIS)  # (no finite part: no -inf - -inf)
            s = tl.sum(tl.where(m > float("-inf"), s * tl.exp(m - top), 0.0), AXIS)
        else:
            s = tl.sum(s, AXIS)
        v3, i3 = _best_k(tl.load(at + 3, mask=ok, other=float("-inf"), cache_modifier=".cg"),
                         tl.load(at + 4, mask=ok, other=0.0, cache_modifier=".cg"), parts, AXIS)
        return v0, i0, s, v3, i3

    @triton.jit
    def _merge_blocks(parts, nb, out, PW: tl.constexpr, NB: tl.constexpr, SUM_OF_EXP: tl.constexpr):
        """A row's nb block parts (PW floats each, at `parts`) merged into the five fields at `out`."""
        i = tl.arange(0, NB)
        v0, i0, s, v3, i3 = _merge_k(parts + i * PW, i < nb, i, 0, SUM_OF_EXP)
        tl.store(out, v0)
        tl.store(out + 1, i0)
        tl.store(out + 2, s)
        tl.store(out + 3, v3)
        tl.store(out + 4, i3)

    @triton.jit
    def _inv_temperature_k(temp_ptr, t_stride, b):
        """SampleBatch.inv_temperature of sequence b: 1 / t rounded to nearest (as torch divides), 1 if greedy."""
        t = tl.load(temp_ptr + b * t_stride)
        return tl.where(t > 0, tl.div_rn(1.0, tl.where(t > 0, t, 1.0)), 1.0)

    @triton.jit
    def _num_drafts_k(num_ptr, has_num, b, K):
        """Sequence b's drafts: num_drafts[b] (has_num), else K."""
        return tl.where(has_num, tl.load(num_ptr + b, mask=has_num, other=0), K)

    @triton.jit(do_not_specialize=["T", "t_stride"])
    def _stats_kernel(lg_ptr, stride, T, n_valid, start, id_offset, accept_id, temp_ptr, t_stride, key_ptr, ctr_ptr,
                      drafts_ptr, q_ptr, stride_q, part_ptr, count_ptr, out_ptr, nb, W: tl.constexpr,
                      PW: tl.constexpr, SAMPLED: tl.constexpr, ACCEPT: tl.constexpr, BLOCK: tl.constexpr,
                      NB: tl.constexpr):
        """Program (row, block), row = b T + j: position j of sequence b (b's temperature and key, draw number
        counter[b] + j; with neither SAMPLED nor ACCEPT x = logit). PART of x = logit * inv_t over the block's
        valid columns (Gumbel scores with the noise of ids + id_offset, with SAMPLED). The row's last program to
        arrive merges the blocks into out[row]: STATS (the acceptance noise with ACCEPT), with ACCEPT followed
        by x of draft j (drafts [B, K = T - 1]) under p (this row) and q (row b K + j of q_ptr), on this shard."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        row = tl.program_id(0)
        blk = tl.program_id(1)
        b = row // T
        cols = blk * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n_valid
        if SAMPLED or ACCEPT:
            inv_t = _inv_temperature_k(temp_ptr, t_stride, b)
            s1, s2 = seeds_k(tl.load(key_ptr + b), tl.load(ctr_ptr + b) + row % T)
        else:
            inv_t = 1.0
        x = tl.load(lg_ptr + row * stride + cols, mask=ok, other=float("-inf")) * inv_t + 0.0
        mx = tl.max(x, 0)
        part = part_ptr + (row * nb + blk) * PW
        tl.store(part, mx)
        tl.store(part + 1, (blk * BLOCK + tl.argmax(x, 0, tie_break_left=True) + start).to(tl.float32))
        # (a block of -inf or padding only: sum 0, with no -inf - -inf)
        tl.store(part + 2, tl.sum(tl.where(ok, tl.exp(x - tl.where(mx > float("-inf"), mx, 0.0)), 0.0), 0))
        if SAMPLED:
            sc = tl.where(ok, x - log_noise_k((cols + start + id_offset).to(tl.int64), s1, s2), float("-inf"))
            tl.store(part + 3, tl.max(sc, 0))
            tl.store(part + 4, (blk * BLOCK + tl.argmax(sc, 0, tie_break_left=True) + start).to(tl.float32))
        else:
            tl.store(part + 3, float("-inf"))
            tl.store(part + 4, 0.0)
        # arrive: the barrier orders every thread's stores above before the (one-thread) release
        tl.debug_barrier()
        count = count_ptr + row
        if tl.atomic_add(count, 1, sem="acq_rel") == nb - 1:
            out = out_ptr + row * W
            _merge_blocks(part_ptr + row * nb * PW, nb, out, PW, NB, True)
            if ACCEPT:
                tl.store(out + 5, log_noise_k(s1 * 0 + accept_id, s1, s2))
                K = T - 1
                j = row % T
                local = tl.load(drafts_ptr + b * K + j, mask=j < K, other=-1) - start
                own = (j < K) & (local >= 0) & (local < n_valid)
                at = tl.where(own, local, 0)
                xp = tl.load(lg_ptr + row * stride + at, mask=own, other=0.0) * inv_t + 0.0
                xq = tl.load(q_ptr + (b * K + j) * stride_q + at, mask=own, other=0.0) * inv_t + 0.0
                tl.store(out + 6, tl.where(own, xp, float("-inf")))
                tl.store(out + 7, tl.where(own, xq, float("-inf")))
            else:
                tl.store(out + 5, 0.0)
            tl.store(count, 0)

    @triton.jit(do_not_specialize=["B", "t_stride"])
    def _draw_kernel(parts_ptr, B, temp_ptr, t_stride, tokens_ptr, lse_ptr, P: tl.constexpr, PP: tl.constexpr,
                     W: tl.constexpr, SAMPLED: tl.constexpr):
        """Program b: a draft from the ranks' STATS of row b (parts [P, B, W]): for a sampled row (SAMPLED and
        temperature > 0) the Gumbel-max token and the log-sum-exp of x, else the argmax and 0."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        b = tl.program_id(0)
        r = tl.arange(0, PP)
        mx, am, total, _, si = _merge_k(parts_ptr + (r * B + b) * W, r < P, r, 0, True)
        if SAMPLED:
            sampled = tl.load(temp_ptr + b * t_stride) > 0
            tl.store(tokens_ptr + b, tl.where(sampled, si, am).to(tl.int64))
            tl.store(lse_ptr + b, tl.where(sampled, mx + tl.log(total), 0.0))
        else:
            tl.store(tokens_ptr + b, am.to(tl.int64))
            tl.store(lse_ptr + b, 0.0)

    @triton.jit(do_not_specialize=["R", "T", "t_stride"])
    def _accept_kernel(parts_ptr, R, T, drafts_ptr, num_ptr, has_num, temp_ptr, t_stride, lse_q_ptr, tokens_ptr,
                       emitted_ptr, lse_ptr, P: tl.constexpr, PP: tl.constexpr, W: tl.constexpr,
                       SAMPLED: tl.constexpr, POS: tl.constexpr):
        """Program b: sequence b's verdict from the ranks' STATS of its positions (parts [P, R, W], rows b T + j).
        Its drafts (drafts [B, K = T - 1], the first num_drafts[b] with has_num) are accepted while equal to the
        position's argmax, or for a sampled row (SAMPLED and temperature > 0) while u q(d) < p(d) (q(d) =
        exp(xq - lse_q[b, j])). Writes tokens[b] (the accepted drafts, then the argmax, -1 after: a sampled row's
        last token is _last_token_kernel's), emitted[b] = accepted + 1 and, with SAMPLED, lse[b]: p's log-sum-exp
        at position `accepted` (the residual pass's)."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        b = tl.program_id(0)
        K = T - 1
        j = tl.arange(0, POS)
        row = b * T + tl.minimum(j, T - 1)  # (the tile's positions past T repeat the last: no empty rows)
        r = tl.arange(0, PP)[:, None]
        at = parts_ptr + (r * R + row[None, :]) * W
        ok = r < P
        mx, target, total, _, _ = _merge_k(at, ok, r, 0, True)
        target = target.to(tl.int64)
        d = tl.load(drafts_ptr + b * K + j, mask=j < K, other=-1)
        drafted = (j < K) & (j < _num_drafts_k(num_ptr, has_num, b, K))
        accept = drafted & (d == target)
        if SAMPLED:
            lse_p = mx + tl.log(total)
            # E from rank 0's row (every rank draws the same); x of a draft is finite on the rank that holds it
            u = tl.exp(-tl.exp(tl.load(parts_ptr + row * W + 5)))
            xp = tl.max(tl.load(at + 6, mask=ok, other=float("-inf")), 0)
            xq = tl.max(tl.load(at + 7, mask=ok, other=float("-inf")), 0)
            q_d = tl.exp(xq - tl.load(lse_q_ptr + b * K + j, mask=j < K, other=0.0))
            sampled = tl.load(temp_ptr + b * t_stride) > 0
            accept = tl.where(sampled, drafted & (u * q_d < tl.exp(xp - lse_p)), accept)
        acc = tl.min(tl.where(accept, POS, j), 0)  # the first position not accepted (position K never is)
        tokens = tl.where(j < acc, d, target)
        tl.store(tokens_ptr + b * T + j, tl.where(j <= acc, tokens, -1), mask=j < T)
        tl.store(emitted_ptr + b, acc + 1)
        if SAMPLED:
            tl.store(lse_ptr + b, tl.sum(tl.where(j == acc, lse_p, 0.0), 0))

    @triton.jit(do_not_specialize=["T", "t_stride"])
    def _residual_kernel(p_ptr, q_ptr, stride_p, stride_q, T, n_valid, start, temp_ptr, t_stride, key_ptr, ctr_ptr,
                         emitted_ptr, lse_p_ptr, lse_q_ptr, part_ptr, count_ptr, out_ptr, nb, RW: tl.constexpr,
                         HAS_Q: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr):
        """Program (b, block) at sequence b's position a = emitted[b] - 1 (its first rejected or bonus one):
        RESIDUAL over the block of p's row b T + a and (HAS_Q) q's row b K + min(a, K - 1), K = T - 1:
        r = max(0, p - q), p = exp(xp - lse_p[b]), q = exp(xq - lse_q at q's row); scores log(r) - log(E) and
        xp - log(E) with the noise of the token ids at b's key and draw number counter[b] + a. The row's last
        program to arrive merges the blocks into out[b]."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        b = tl.program_id(0)
        blk = tl.program_id(1)
        a = tl.load(emitted_ptr + b) - 1
        cols = blk * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n_valid
        inv_t = _inv_temperature_k(temp_ptr, t_stride, b)
        xp = tl.load(p_ptr + (b * T + a) * stride_p + cols, mask=ok, other=float("-inf")) * inv_t + 0.0
        p = tl.exp(xp - tl.load(lse_p_ptr + b))
        if HAS_Q:
            qrow = b * (T - 1) + tl.minimum(a, T - 2)
            xq = tl.load(q_ptr + qrow * stride_q + cols, mask=ok, other=float("-inf")) * inv_t + 0.0
            r = tl.where(ok, tl.maximum(p - tl.exp(xq - tl.load(lse_q_ptr + qrow)), 0.0), 0.0)
        else:
            r = tl.zeros_like(p)
        s1, s2 = seeds_k(tl.load(key_ptr + b), tl.load(ctr_ptr + b) + a)
        ln = log_noise_k((cols + start).to(tl.int64), s1, s2)
        rs = tl.where(r > 0, tl.log(tl.where(r > 0, r, 1.0)) - ln, float("-inf"))
        bs = tl.where(ok, xp - ln, float("-inf"))
        part = part_ptr + (b * nb + blk) * RW
        tl.store(part, tl.max(rs, 0))
        tl.store(part + 1, (blk * BLOCK + tl.argmax(rs, 0, tie_break_left=True) + start).to(tl.float32))
        tl.store(part + 2, tl.sum(r, 0))
        tl.store(part + 3, tl.max(bs, 0))
        tl.store(part + 4, (blk * BLOCK + tl.argmax(bs, 0, tie_break_left=True) + start).to(tl.float32))
        # arrive: the barrier orders every thread's stores above before the (one-thread) release
        tl.debug_barrier()
        count = count_ptr + b
        if tl.atomic_add(count, 1, sem="acq_rel") == nb - 1:
            _merge_blocks(part_ptr + b * nb * RW, nb, out_ptr + b * RW, RW, NB, False)
            tl.store(count, 0)

    @triton.jit(do_not_specialize=["B", "T", "t_stride"])
    def _last_token_kernel(parts_ptr, B, T, num_ptr, has_num, temp_ptr, t_stride, emitted_ptr, tokens_ptr,
                           P: tl.constexpr, PP: tl.constexpr, RW: tl.constexpr):
        """Program b, for a sampled sequence (temperature > 0): tokens[b, a] at its position a = emitted[b] - 1,
        from the ranks' RESIDUAL of it (parts [P, B, RW]): the residual's draw where a held a rejected draft and
        the residual has mass (should rounding leave none, p's), else p's (the bonus token)."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        b = tl.program_id(0)
        r = tl.arange(0, PP)
        _, ri, mass, _, bi = _merge_k(parts_ptr + (r * B + b) * RW, r < P, r, 0, False)
        a = tl.load(emitted_ptr + b) - 1
        rejected = a < _num_drafts_k(num_ptr, has_num, b, T - 1)
        tl.store(tokens_ptr + b * T + a, tl.where(rejected & (mass > 0), ri, bi).to(tl.int64),
                 mask=tl.load(temp_ptr + b * t_stride) > 0)


def _blocks(n: int) -> tuple[int, int]:
    """The passes' blocks of BLOCK columns per row of n, and their power of two (the merge's tile)."""
    nb = max(1, triton.cdiv(n, BLOCK))
    return nb, triton.next_power_of_2(nb)


def _settings(batch: SampleBatch | None, like: torch.Tensor):
    """The rows' (temperature, its stride, key, counter) as the kernels read them; without a batch, placeholders
    that no kernel variant for greedy rows reads."""
    if batch is None:
        return like, 0, like, like
    return batch.temperature, batch.temperature.stride(0), batch.key.contiguous(), batch.counter.contiguous()


def stats_fast(logits: torch.Tensor, n_valid: int, start: int, id_offset: int, batch: SampleBatch | None,
               positions: int = 1, sampled: bool = False, drafts: torch.Tensor | None = None,
               draft_logits: torch.Tensor | None = None) -> torch.Tensor:
    """stats_torch of rows [R, n] of sequences' positions in one launch (row r: position j = r % positions of
    sequence b = r // positions, x = logits * b's inv_temperature, noise at b's key and draw number counter[b] + j;
    batch None: x = logits, no noise), merged over the blocks: [R, STATS]. With drafts [B, k = positions - 1]
    (their draft logits [B * k, n]): the acceptance noise too, and [R, STATS + DRAFT_X]: each row then x of its
    position's draft under p and q (-inf where the draft is not in this shard, and at position k)."""
    R, n = logits.shape
    nb, NB = _blocks(n)
    accept = drafts is not None
    W = STATS + DRAFT_X * accept
    out = torch.empty(R, W, device=logits.device)
    if R:
        temp, t_stride, key, counter = _settings(batch, logits)
        q = logits if draft_logits is None else draft_logits
        parts = torch.empty(R, nb, PART, device=logits.device)
        _stats_kernel[(R, nb)](logits, logits.stride(0), positions, n_valid, start, id_offset, ACCEPT_ID, temp,
                               t_stride, key, counter, logits if drafts is None else drafts, q, q.stride(0), parts,
                               backend.arrival_counters(R, logits.device), out, nb, W=W, PW=PART, SAMPLED=sampled,
                               ACCEPT=accept, BLOCK=BLOCK, NB=NB, enable_fp_fusion=False, **pdl())
    return out


def residual_fast(logits: torch.Tensor, draft_logits: torch.Tensor, n_valid: int, start: int, batch: SampleBatch,
                  emitted: torch.Tensor, lse_p: torch.Tensor, draft_lse: torch.Tensor) -> torch.Tensor:
    """residual_torch of each sequence's rows at its position a = emitted - 1, read in place in one launch: p's
    logits[b, a] ([B, T, n]) with lse_p [B], q's draft_logits[b, min(a, k - 1)] ([B, k, n]) with draft_lse
    [B, k] there (k = 0: q = 0); b's inv_temperature, key and draw number counter + a. [B, RESIDUAL]."""
    B, T, n = logits.shape
    nb, NB = _blocks(n)
    out = torch.empty(B, RESIDUAL, device=logits.device)
    if B:
        temp, t_stride, key, counter = _settings(batch, logits)
        p, q = logits.reshape(B * T, n), draft_logits.reshape(B * (T - 1), n)
        parts = torch.empty(B, nb, RESIDUAL, device=logits.device)
        _residual_kernel[(B, nb)](p, q, p.stride(0), q.stride(0), T, n_valid, start, temp, t_stride, key, counter,
                                  emitted, lse_p, draft_lse.contiguous(), parts,
                                  backend.arrival_counters(B, logits.device), out, nb, RW=RESIDUAL, HAS_Q=T > 1,
                                  BLOCK=BLOCK, NB=NB, enable_fp_fusion=False, **pdl())
    return out


def _draw(parts: torch.Tensor, batch: SampleBatch | None) -> DraftDraw:
    """Every rank's STATS [P, B, STATS] -> the drafts (_draw_kernel)."""
    P, B, W = parts.shape
    tokens = torch.empty(B, dtype=torch.int64, device=parts.device)
    lse = torch.empty(B, device=parts.device)
    if B:
        temp, t_stride, _, _ = _settings(batch, parts)
        _draw_kernel[(B,)](parts, B, temp, t_stride, tokens, lse, P=P, PP=triton.next_power_of_2(P), W=W,
                           SAMPLED=batch is not None, enable_fp_fusion=False, **pdl())
    return DraftDraw(tokens, lse)


def _accept(parts: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor | None, batch: SampleBatch | None,
            draft_lse: torch.Tensor | None) -> tuple[Verdict, torch.Tensor]:
    """Every rank's STATS of the positions [P, B * (k + 1), W] -> the verdict (_accept_kernel; a sampled row's
    token after its accepted drafts is still to come) and p's log-sum-exp [B] there."""
    P, R, W = parts.shape
    B, k = drafts.shape
    tokens = torch.empty(B, k + 1, dtype=torch.int64, device=parts.device)
    emitted = torch.empty(B, dtype=torch.int64, device=parts.device)
    lse = torch.empty(B, device=parts.device)
    if B:
        temp, t_stride, _, _ = _settings(batch, parts)
        _accept_kernel[(B,)](parts, R, k + 1, drafts, drafts if num_drafts is None else num_drafts.contiguous(),
                             num_drafts is not None, temp, t_stride,
                             parts if draft_lse is None else draft_lse.contiguous(), tokens, emitted, lse, P=P,
                             PP=triton.next_power_of_2(P), W=W, SAMPLED=batch is not None, POS=POSITIONS,
                             enable_fp_fusion=False, **pdl())
    return Verdict(tokens, emitted), lse


def _last_token(parts: torch.Tensor, verdict: Verdict, num_drafts: torch.Tensor | None, batch: SampleBatch) -> None:
    """Every rank's RESIDUAL [P, B, RESIDUAL] -> each sampled row's token after its accepted drafts, written into
    the verdict (_last_token_kernel)."""
    P, B, _ = parts.shape
    if B:
        tokens = verdict.tokens
        _last_token_kernel[(B,)](parts, B, tokens.shape[1], tokens if num_drafts is None else num_drafts.contiguous(),
                                 num_drafts is not None, batch.temperature, batch.temperature.stride(0),
                                 verdict.num_emitted, tokens, P=P, PP=triton.next_power_of_2(P), RW=RESIDUAL,
                                 **pdl())


def _filtered(batch: SampleBatch | None) -> bool:
    return batch is not None and not batch.greedy_only and (batch.any_top_k or batch.any_top_p)


def _sampled(batch: SampleBatch | None) -> SampleBatch | None:
    """The batch if some row may sample (checked), None when every row is greedy."""
    if batch is None or batch.greedy_only:
        return None
    _check(batch)
    return batch


def draft_fast(logits: torch.Tensor, batch: SampleBatch | None, num_real_tokens: int, vocab_size: int) -> DraftDraw:
    """draft_torch from the shard (module comment): the stats pass, an all-gather of [B, STATS], _draw_kernel."""
    if _filtered(batch):
        return draft_torch(logits, batch, num_real_tokens, vocab_size)
    start, n_valid = vocab_shard(logits.shape[1], num_real_tokens, vocab_size, "speculative sampling")
    batch = _sampled(batch)
    st = stats_fast(logits, n_valid, start, DRAFT_ID_OFFSET, batch, sampled=batch is not None)
    return _draw(parallel.all_gather(st), batch)


def verify_fast(logits: torch.Tensor, drafts: torch.Tensor, draft_logits: torch.Tensor, draft_lse: torch.Tensor,
                batch: SampleBatch | None, num_drafts: torch.Tensor | None, num_real_tokens: int,
                vocab_size: int) -> Verdict:
    """verify_torch from the shards (module comment): the stats pass over the target's rows, an all-gather of
    [B * (k + 1), STATS (+ DRAFT_X with sampled rows)], _accept_kernel; with sampled rows then the residual pass
    at each row's first rejected (or bonus) position, an all-gather of [B, RESIDUAL], _last_token_kernel."""
    if _filtered(batch):
        return verify_torch(logits, drafts, draft_logits, draft_lse, batch, num_drafts, num_real_tokens, vocab_size)
    B, T, n = logits.shape
    if T > POSITIONS:
        raise ValueError(f"verify_fast: {T - 1} drafts per row, at most {POSITIONS - 1}")
    start, n_valid = vocab_shard(n, num_real_tokens, vocab_size, "speculative sampling")
    batch = _sampled(batch)
    drafts = drafts.contiguous()
    if batch is None:
        st = stats_fast(logits.reshape(B * T, n), n_valid, start, 0, None, T)
        return _accept(parallel.all_gather(st), drafts, num_drafts, None, None)[0]
    st = stats_fast(logits.reshape(B * T, n), n_valid, start, 0, batch, T, drafts=drafts,
                    draft_logits=draft_logits.reshape(B * (T - 1), n))
    verdict, lse_p = _accept(parallel.all_gather(st), drafts, num_drafts, batch, draft_lse)
    res = residual_fast(logits, draft_logits, n_valid, start, batch, verdict.num_emitted, lse_p, draft_lse)
    _last_token(parallel.all_gather(res), verdict, num_drafts, batch)
    return verdict


def bind_spec_sampling():
    """(draft, verify): the fast pair or the reference, by the kernel set (chosen once, as the sampler's)."""
    return (draft_fast, verify_fast) if backend.use_fast() else (draft_torch, verify_torch)
