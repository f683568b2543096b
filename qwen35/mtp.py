"""The multi-token-prediction head (spec section 9, `mtp.*` in the checkpoint) and drafting with it.

    e = pre_fc_norm_embedding(embed_tokens(token t + 1))   # the main model's embedding (shared)
    h = pre_fc_norm_hidden(hidden_t)                        # the main model's post-final-norm hidden at t
    x = fc([e, h])                                          # order: [embedding, hidden]
    x = decoder layer at position t                         # gated full attention (own paged KV cache) + MoE
    logits = lm_head(mtp.norm(x))                           # the main model's LM head: token t + 2

attach_mtp puts the head on a Qwen35Model as `model.mtp`, so that its parameters carry the checkpoint's names: the
loader (both expert layouts) and the dummy initialiser fill them like any other, and the runner finds its attention
layer among the model's GatedAttention modules (one more layer's KV cache, same block tables).

TP: the decoder layer is split as the main layers are (qwen35/model.py DecoderLayer). fc ([H, 2H]: 16 MiB in bf16
at full size) and the norms are replicated: every rank holds whole embeddings and hidden states, so fc needs no
collective, where a column split would add an all-gather to every draft step.

KV cache entry p holds the layer's K/V for the input pair (token p + 1, hidden p), at the main model's positions
and block table. Draft alignment (vLLM's MTP proposer): after a target step, a catch-up pass runs over the step's
rows, each row's input token being the row's next token (the step's tokens shifted left by one, the newest token in
the sequence's last accepted row) and its hidden the target's; its output at the last accepted row gives draft 1.
Draft j >= 2 is one position further (that row's position + j - 1), input [embedding of draft j - 1, the MTP's own
post-norm hidden]. Rows past the last accepted one (rejected drafts) write stale entries, which every later pass
rewrites before reading them: a pass writes a position's K/V before its queries read it, and queries read only
earlier positions. Since entry p depends on token p + 1, a prefix-cache hit ending at position n - 1 may carry an
entry written for another token n: drafts only (verification is exact), and the catch-up can start at n - 1.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
from torch import nn

from dist import push
from layers.forward_batch import ForwardBatch
from layers.linear import Linear
from layers.norm import RMSNorm
from layers.sampler import SampleBatch
from layers.spec_sampling import bind_spec_sampling
from qwen35.config import FULL_ATTENTION, ModelConfig
from qwen35.model import DecoderLayer, Qwen35Model


class MTPHead(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary, dtype=None, device=None):
        super().__init__()
        if cfg.mtp_num_hidden_layers == 0:
            raise ValueError("config: the model has no MTP head (mtp_num_hidden_layers is 0)")
        if cfg.mtp_num_hidden_layers != 1:
            raise ValueError(f"config: mtp_num_hidden_layers is {cfg.mtp_num_hidden_layers}; the MTP head supports "
                             "exactly 1 layer (every Qwen3.5 release has 1)")
        if cfg.mtp_use_dedicated_embeddings:
            raise ValueError("config: mtp_use_dedicated_embeddings is not supported (the MTP head shares the main "
                             "model's embedding in every Qwen3.5 release)")
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        norm = dict(dtype=dtype, device=device, plain=not cfg.zero_centred_norms)
        self.pre_fc_norm_embedding = RMSNorm(H, eps, **norm)
        self.pre_fc_norm_hidden = RMSNorm(H, eps, **norm)
        self.fc = Linear(2 * H, H, dtype=dtype, device=device)  # replicated (module docstring)
        self.layers = nn.ModuleList([DecoderLayer(cfg, FULL_ATTENTION, rotary, dtype=dtype, device=device)])
        self.norm = RMSNorm(H, eps, **norm)

    def fc_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's input [N, H]: fc over [the normed embeddings, the normed hidden states] (forward's arguments)."""
        return self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))

    @property
    def attn(self):
        """The attention layer, whose k_cache / v_cache the runner allocates as for a main attention layer."""
        return self.layers[0].self_attn

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """embeds [N, H]: embeddings of each row's next token; hidden [N, H]: post-final-norm hidden states (the main
        model's, or the head's own); batch: the rows' positions and KV metadata. Returns the post-`mtp.norm` hidden
        [N, H], whole on every rank."""
        x = self.fc_input(embeds, hidden)
        push.begin_step()  # (a forward of its own: under TP its 2 boundaries may go by push, dist/push.py)
        x, residual = self.layers[0](x, None, batch)
        out = self.norm.all_reduce_add(x, residual)[0]
        push.end_step()
        return out


def attach_mtp(model: Qwen35Model) -> MTPHead:
    """Give `model` an MTP head (`model.mtp`) of its dtype and device, before its weights are loaded."""
    w = model.embed_tokens.weight
    model.mtp = MTPHead(model.config, model.rotary, dtype=w.dtype, device=w.device)
    return model.mtp


class Drafts(NamedTuple):
    tokens: torch.Tensor             # [B, k] int64
    # what each draft was drawn from (layers/spec_sampling.py): this rank's shard of the head's logits [B, k, n]
    # (float32) and the log-sum-exp of their x [B, k]; None when every row is greedy
    logits: torch.Tensor | None
    lse: torch.Tensor | None


def draft_batch(block_tables: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor,
                state_slots: torch.Tensor, block_size: int) -> ForwardBatch:
    """A decode batch of one row per sequence at `positions` [B] (int64) over the sequences' block tables [B, W]:
    device tensors only, so that no step of drafting waits for the host. The host lists are placeholders: the MTP
    layer (attention and MoE) reads none of them on a decode batch."""
    B = positions.shape[0]
    blocks = block_tables.gather(1, (positions // block_size)[:, None])[:, 0]
    return ForwardBatch(
        input_ids=tokens, positions=positions, slot_mapping=blocks.long() * block_size + positions % block_size,
        cu_seqlens=None, start_pos=None, context_lens=(positions + 1).to(torch.int32), block_tables=block_tables,
        state_slots=state_slots, logits_indices=None, seq_lens_cpu=[1] * B, start_pos_cpu=[1] * B,
        state_slots_cpu=[0] * B, is_decode=True)


def next_ids(batch: ForwardBatch, newest: torch.Tensor, last_rows: torch.Tensor) -> torch.Tensor:
    """Each row's next token, the head's input beside the row's hidden: the step's tokens shifted left by one, the
    newest token (the one the step emitted) at each sequence's last accepted row (module docstring)."""
    return torch.roll(batch.input_ids, -1).index_put((last_rows,), newest)


@torch.inference_mode()
def catch_up(model: Qwen35Model, batch: ForwardBatch, hidden: torch.Tensor, newest: torch.Tensor,
             last_rows: torch.Tensor) -> torch.Tensor:
    """The catch-up pass (module docstring): writes the head's KV at the step's positions and returns its post-norm
    hidden at `last_rows` [B, H], draft 1's input. Arguments as propose's."""
    return model.mtp(model.embed_tokens(next_ids(batch, newest, last_rows)), hidden, batch)[last_rows]


@torch.inference_mode()
def write_kv(model: Qwen35Model, positions: torch.Tensor, slot_mapping: torch.Tensor, hidden: torch.Tensor,
             ids: torch.Tensor) -> None:
    """The head's KV at `positions` / `slot_mapping` alone, for a step that drafts nothing: entry p from (ids, the
    rows' next tokens; hidden [N, H], the main model's post-final-norm hidden at p). The catch-up's KV without its
    queries, attention and MoE: fc, the layer's input norm and the K/V projection (GatedAttention.write_kv). The
    runner writes it on every step of an engine that speculates and does not propose, so that drafts after a
    stretch of plain steps (auto at k = 0, prompt chunks that sample nothing) attend to the entries of every
    position before them."""
    layer = model.mtp.layers[0]
    x = model.mtp.fc_input(model.embed_tokens(ids), hidden)
    layer.self_attn.write_kv(layer.input_layernorm(x), positions, slot_mapping)


@torch.inference_mode()
def propose(model: Qwen35Model, batch: ForwardBatch, hidden: torch.Tensor, newest: torch.Tensor,
            last_rows: torch.Tensor, k: int, sampling: SampleBatch | None = None,
            block_tables: torch.Tensor | None = None, num_real_tokens: int | None = None,
            max_positions: torch.Tensor | None = None, draft=None) -> Drafts:
    """k draft tokens per sequence of a target step (module docstring: draft alignment).

    batch: the target step's ForwardBatch; hidden [N, H]: its post-final-norm hidden states (every row); newest [B]:
    each sequence's newest token (the one the step emitted); last_rows [B]: each sequence's last accepted row in
    the step (its last row, or for a verify step its first row + accepted drafts). sampling: the sequences'
    settings, counter = the draw number of the token draft 1 proposes (None: greedy drafts). block_tables [B, W]:
    the sequences' block tables covering positions up to last + k - 1 (default: the batch's). Logits columns past
    num_real_tokens are never drafted. draft: spec_sampling's draft_fast or draft_torch (default: the kernel set's);
    each draws from this rank's shard of the head's logits. max_positions [B]: the last position each sequence has a
    KV block for; draft positions past it are clamped to it (no block, or no RoPE row, lies past it; a draft there
    is never verified, the sequence ends first, and the entry the clamped one overwrites feeds drafts only). Writes
    the head's KV at the step's positions and the draft positions."""
    if model.mtp is None:
        raise ValueError("the model has no MTP head (attach_mtp)")
    if k < 1:
        raise ValueError(f"propose: k must be at least 1, got {k}")
    mtp = model.mtp
    tables = batch.block_tables if block_tables is None else block_tables
    h = catch_up(model, batch, hidden, newest, last_rows)
    positions = batch.positions[last_rows]
    block_size = mtp.attn.k_cache.shape[1]
    draft = draft or bind_spec_sampling()[0]
    vocab = model.config.vocab_size
    greedy = sampling is None or sampling.greedy_only
    tokens, shards, lses = [], [], []
    for j in range(k):
        logits = model.compute_logits(h, gather="none")  # this rank's vocabulary shard
        d = draft(logits, None if greedy else dataclasses.replace(sampling, counter=sampling.counter + j),
                  vocab if num_real_tokens is None else num_real_tokens, vocab)
        token = d.tokens
        tokens.append(token)
        shards.append(logits)
        lses.append(d.lse)
        if j + 1 < k:
            positions = positions + 1
            if max_positions is not None:
                positions = torch.minimum(positions, max_positions)
            step = draft_batch(tables, positions, token, batch.state_slots, block_size)
            h = mtp(model.embed_tokens(token), h, step)
    if greedy:
        return Drafts(torch.stack(tokens, dim=1), None, None)
    return Drafts(torch.stack(tokens, dim=1), torch.stack(shards, dim=1), torch.stack(lses, dim=1))
