"""The Qwen3.5 text model (spec §2): embedding, decoder layers (Gated DeltaNet or gated attention mixer, then MoE or
dense MLP), final norm and LM head. Module names mirror the checkpoint's (minus its prefix), so that the loader maps
names one to one.

The dense LLaMA-likes (Llama, Qwen2, Qwen3) are this same decoder with every layer full attention and the config's
options switched (qwen35/config.py): no output gate, q/k norm or not, biases, plain norms, scaled RoPE. Their
checkpoint names are the same too (`model.layers.N.self_attn.q_proj.weight`, ...).

Each decoder layer does exactly two all-reduces under TP: after the mixer and after the feed-forward (both produce
partial sums of row-parallel projections / local experts). Each is fused with the residual add and the norm that
follows it (`RMSNorm.all_reduce_add`): the feed-forward's partial sums leave the layer as they are and the next
layer's input norm (or the final norm) sums them.
"""
from __future__ import annotations

import torch
from torch import nn

from dist import push
from layers import deltanet
from layers.attention import GatedAttention
from layers.deltanet import GatedDeltaNet
from layers.embedding import ParallelLMHead, VocabParallelEmbedding
from layers.forward_batch import ForwardBatch
from layers.mlp import MLP
from layers.moe import SparseMoE
from layers.norm import RMSNorm
from layers.rotary import RotaryEmbedding
from qwen35.config import LINEAR_ATTENTION, ModelConfig


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str, rotary: RotaryEmbedding, dtype=None, device=None):
        super().__init__()
        norm = dict(dtype=dtype, device=device, plain=not cfg.zero_centred_norms)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **norm)
        self.is_linear = layer_type == LINEAR_ATTENTION
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, dtype=dtype, device=device)
        else:
            self.self_attn = GatedAttention(cfg, rotary, dtype=dtype, device=device)
        if cfg.is_moe:
            self.mlp = SparseMoE(cfg, dtype=dtype, device=device)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, device=device, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch):
        """x: the previous layer's feed-forward output, this rank's partial sums (the embeddings, already whole, for
        the first layer, residual None); returns this layer's feed-forward partial sums and the residual stream
        before them. Each all-reduce and residual add is fused into the norm that follows it, and at decode sizes
        that norm into the GEMV that reads it (RMSNorm.boundary: the mixer's input projection, the router)."""
        h, residual = self.input_layernorm.boundary(x, residual)
        mixer = self.linear_attn if self.is_linear else self.self_attn
        h, residual = self.post_attention_layernorm.boundary(mixer(h, batch), residual)
        return self.mlp(h), residual


class Qwen35Model(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype=None, device=None, max_positions: int = 8192):
        super().__init__()
        self.config = cfg
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, max_positions, device=device,
                                      scaling=cfg.rope_scaling)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t, self.rotary, dtype=dtype, device=device)
                                    for t in cfg.layer_types)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device,
                            plain=not cfg.zero_centred_norms)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.mtp = None  # the multi-token-prediction head, when one is attached (qwen35/mtp.py attach_mtp)
        self.gdn_layers = [m for m in self.modules() if isinstance(m, GatedDeltaNet)]  # (a list: not submodules)
        for row, m in enumerate(self.gdn_layers):
            m.commit_row = row  # (layers/deltanet.py commit: the DeltaNet layers in model order)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Final-norm hidden states [N, H] of every token of the batch."""
        push.begin_step()  # (under TP, at decode sizes the boundaries go through inboxes: dist/push.py)
        x, residual = self.embed_tokens(batch.input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, batch)
        hidden = self.norm.all_reduce_add(x, residual)[0]
        push.end_step()  # (empties the last boundary's inbox slot, dist/push.py)
        deltanet.replayed(self.gdn_layers, batch)  # (speculation: the drafts the states took are no longer pending)
        return hidden

    def compute_logits(self, hidden: torch.Tensor, gather: str = "driver") -> torch.Tensor | None:
        return self.lm_head(hidden, gather=gather)
