"""Synthetic weights with a chosen speculative acceptance (`--load-format dummy-spec --spec-acceptance A`), at any
size and TP, made on the device from the model's own parameters (applied after the dummy initialiser).

Random weights accept no drafts, so speculative decoding cannot be measured on them. These make the model a noisy
permutation automaton whose per-draft acceptance at temperature 1 is set by one logit scale:

* The regular token ids (below the first special id: the lowest EOS id, else the vocabulary size) form one random
  cycle sigma. Token t's embedding is e_t = [1, g_t], g_t ~ N(0, I); the final norm makes y_t = e_t / rms(e_t) of it.
  The LM head row of sigma(t) is [0, y'_t / |y'_t|^2] (y' = y past its first coordinate), so logit(sigma(t) | t) = 1
  exactly and the others' are cosines of independent Gaussians (~N(0, 1/H)). Special and padded ids' rows are
  -SPECIAL_LOGIT on the first coordinate only: far below every regular token at any scale.
* Every layer's output projection (attention o_proj, DeltaNet out_proj, routed and shared experts' down projections,
  a dense MLP's down_proj) is scaled by LAYER_SCALE: the layers do all the work of a real step (random routing
  included) but barely move the residual stream, so the final hidden state at token t stays ~y_t.
* The LM head's rows are scaled by `a` (the final norm is the identity): the target is p(. | t) = softmax(a z_t),
  whose argmax is sigma(t), so greedy decoding walks the cycle. The MTP head passes the next token's normed
  embedding through fc = [I | small] (the hidden half, scaled by LAYER_SCALE, keeps the [embedding, hidden] order
  observable: swapped, the head would predict sigma(t) instead), and mtp.norm scales by b / a: the draft is
  q(. | t + 1) = softmax(b z_{t+1}), whose argmax sigma(t + 1) is the successor's successor of t. (The scales sit
  in the LM head's rows and in a norm weight near 1, where bf16 rounds them least.)
* b: the draft's mass on its argmax averages DRAFT_CONFIDENCE over CALIBRATION_TOKENS tokens (a near-greedy draft).
  a: by bisection, the mean of sum_u min(p, q) over the same tokens is the requested acceptance; that sum is the
  probability that a draft drawn from q at temperature 1 is accepted (layers/spec_sampling.py). At temperature 1
  the chain visits regular tokens about uniformly (an accepted draft is a successor, a rejection a residual draw
  spread over the rest), so the mean is the per-draft acceptance; the engine measures it, never assumes it
  (tests/test_mtp.py checks the tiny model within a stated tolerance).

Every rank makes the same cycle (CPU generator) and the same embedding table (one device generator per chunk of
rows, the same device type everywhere), keeps its vocabulary rows, and takes rank 0's a and b.
"""
from __future__ import annotations

import torch

from dist import parallel
from qwen35.model import Qwen35Model

LAYER_SCALE = 1e-2
SPECIAL_LOGIT = 2.0
DRAFT_CONFIDENCE = 0.99
CALIBRATION_TOKENS = 16
CHUNK_ROWS = 16384
OUTPUT_PROJECTIONS = ("self_attn.o_proj.weight", "linear_attn.out_proj.weight", "mlp.experts.down_proj",
                      "mlp.shared_expert.down_proj.weight", "mlp.down_proj.weight")


def regular_tokens(cfg) -> int:
    """How many ids from 0 are regular tokens: up to the first EOS id (where Qwen's special tokens start)."""
    return min([cfg.vocab_size, *cfg.eos_token_ids])


def successor_cycle(n: int, seed: int) -> torch.Tensor:
    """succ [n] int64: one random cycle through 0..n-1 (no token is its own successor), the same on every rank."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    succ = torch.empty(n, dtype=torch.int64)
    succ[order] = order.roll(-1)
    return succ


def _embedding_rows(start: int, n: int, hidden: int, seed: int, device) -> torch.Tensor:
    """Rows start..start+n-1 of the embedding table [1, g_t] (fp32), from the generator of their chunk."""
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + start // CHUNK_ROWS)
    rows = torch.randn(n, hidden, generator=gen, device=device)
    rows[:, 0] = 1.0
    return rows


def _local_rows(param) -> tuple[int, int]:
    """(start, size) of the vocabulary rows this rank holds of an embedding / LM head parameter."""
    return param.shard[0][0]


@torch.no_grad()
def init_spec_weights(model: Qwen35Model, acceptance: float, seed: int = 0) -> tuple[float, float]:
    """Overwrite `model`'s embedding, LM head, final norm, output projections and MTP head (module docstring) so
    that its per-draft acceptance at temperature 1 is ~`acceptance`; returns the logit scales (a, b): the target's
    and the draft's."""
    cfg = model.config
    if not 0 < acceptance <= 1:
        raise ValueError(f"spec acceptance must be in (0, 1], got {acceptance}")
    if cfg.tie_word_embeddings:
        raise ValueError("synthetic-acceptance weights need an LM head of its own (this model ties it to the "
                         "embedding)")
    V, H = cfg.vocab_size, cfg.hidden_size
    regular = regular_tokens(cfg)
    succ = successor_cycle(regular, seed)
    emb, head = model.embed_tokens.weight, model.lm_head.weight
    device = emb.device
    (e0, en), (h0, hn) = _local_rows(emb), _local_rows(head)
    succ_d = succ.to(device)
    head.data.zero_()
    head.data[max(regular, h0) - h0:, 0] = -SPECIAL_LOGIT  # special and padded ids (rows >= regular)
    n_cal = min(CALIBRATION_TOKENS, regular)
    z = torch.full((n_cal, V), -SPECIAL_LOGIT, dtype=torch.float32, device=device)  # logits / scale of cal tokens
    y_cal = None
    for start in range(0, V, CHUNK_ROWS):
        n = min(CHUNK_ROWS, V - start)
        rows = _embedding_rows(start, n, H, seed, device)
        lo, hi = max(start, e0), min(start + n, e0 + en)
        if lo < hi:
            emb.data[lo - e0:hi - e0] = rows[lo - start:hi - start].to(emb.dtype)
        y = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
        if y_cal is None:  # the first chunk holds the calibration tokens 0..n_cal-1 (exchangeable: iid rows)
            y_cal = y[:n_cal]
            z *= y_cal[:, :1]
        m = max(0, min(n, regular - start))  # regular tokens of this chunk
        if not m:
            continue
        y = y[:m]
        w = y.clone()
        w[:, 0] = 0.0
        w /= w.pow(2).sum(-1, keepdim=True)
        to = succ_d[start:start + m]
        mine = (to >= h0) & (to < h0 + hn)
        head.data[to[mine] - h0] = w[mine].to(head.dtype)
        z[:, to] = y_cal @ w.T
    a, b = _calibrate(z, acceptance, succ_d[:n_cal])
    a, b = parallel.broadcast_object((a, b))
    head.data.mul_(a)
    zero_centred = cfg.zero_centred_norms
    model.norm.weight.data.fill_(0.0 if zero_centred else 1.0)
    for name, p in model.named_parameters():
        if name.endswith(OUTPUT_PROJECTIONS):
            p.data.mul_(LAYER_SCALE)
    if model.mtp is not None:
        mtp = model.mtp
        mtp.norm.weight.data.fill_(b / a - 1 if zero_centred else b / a)
        for norm in (mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden):
            norm.weight.data.fill_(0.0 if zero_centred else 1.0)
        fc = mtp.fc.weight.data  # [H, 2H], replicated
        fc[:, H:].mul_(LAYER_SCALE)
        fc[:, :H] = torch.eye(H, dtype=fc.dtype, device=fc.device)
    return a, b


def _calibrate(z: torch.Tensor, acceptance: float, successors: torch.Tensor, iterations: int = 20
               ) -> tuple[float, float]:
    """(a, b) for unit logits z [n, V] of n tokens whose argmax column is their successor: b with mean
    softmax(b z)[successor] = DRAFT_CONFIDENCE, then a in [0, b] with mean sum(min(softmax(a z), softmax(b z))) =
    acceptance (1 at a = b)."""
    rows = torch.arange(z.shape[0], device=z.device)

    def confidence(b):
        return torch.softmax(b * z, dim=-1)[rows, successors].mean().item()

    def accept(a, q):
        return torch.minimum(torch.softmax(a * z, dim=-1), q).sum(-1).mean().item()

    lo, hi = 0.0, 1.0
    while confidence(hi) < DRAFT_CONFIDENCE:
        lo, hi = hi, 2 * hi
    for _ in range(iterations):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if confidence(mid) < DRAFT_CONFIDENCE else (lo, mid)
    b = hi
    q = torch.softmax(b * z, dim=-1)
    lo, hi = 0.0, b
    for _ in range(iterations):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if accept(mid, q) < acceptance else (lo, mid)
    return hi, b
