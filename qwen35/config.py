"""Model configuration, read from a Hugging Face `config.json`.

Accepts the multimodal wrapper (`Qwen3_5MoeForConditionalGeneration`, sizes under `text_config`) and flat text
configs, for the MoE (`qwen3_5_moe*`) and the dense (`qwen3_5*`) variants. Every model dimension used anywhere in
the engine comes from here.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: list[str]
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    # gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # feed-forward: MoE when num_experts > 0, else a dense SwiGLU MLP of intermediate_size
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    intermediate_size: int = 0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    eos_token_ids: list[int] = field(default_factory=list)
    # "model.language_model." for the multimodal wrapper, "model." for a text-only checkpoint
    weight_prefix: str = "model.language_model."
    model_type: str = "qwen3_5_moe"

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION]

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        text = raw.get("text_config") or raw
        model_type = raw.get("model_type", text.get("model_type", "qwen3_5_moe"))
        nested = "text_config" in raw
        n_layers = int(text["num_hidden_layers"])
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n_layers)]
        layer_types = list(layer_types)
        if len(layer_types) != n_layers or any(t not in (FULL_ATTENTION, LINEAR_ATTENTION) for t in layer_types):
            raise ValueError(f"config: layer_types must list {n_layers} entries of full_attention/linear_attention")
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        rope_theta = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
        head_dim = int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])
        partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0)))
        if rope.get("rope_type", "default") not in ("default", None):
            raise ValueError(f"config: rope_type {rope.get('rope_type')!r} is not supported (only 'default')")
        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        num_experts = int(text.get("num_experts", 0) or 0)
        tie = bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        return cls(
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            num_hidden_layers=n_layers,
            layer_types=layer_types,
            num_attention_heads=int(text["num_attention_heads"]),
            num_key_value_heads=int(text["num_key_value_heads"]),
            head_dim=head_dim,
            rotary_dim=int(head_dim * partial),
            rope_theta=rope_theta,
            linear_num_key_heads=int(text["linear_num_key_heads"]),
            linear_num_value_heads=int(text["linear_num_value_heads"]),
            linear_key_head_dim=int(text["linear_key_head_dim"]),
            linear_value_head_dim=int(text["linear_value_head_dim"]),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            num_experts=num_experts,
            num_experts_per_tok=int(text.get("num_experts_per_tok", 0) or 0) if num_experts else 0,
            moe_intermediate_size=int(text.get("moe_intermediate_size", 0) or 0),
            shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size", 0) or 0),
            intermediate_size=int(text.get("intermediate_size", 0) or 0),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=tie,
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            eos_token_ids=eos_ids,
            weight_prefix="model.language_model." if nested else "model.",
            model_type=model_type,
        )

    @classmethod
    def from_dir(cls, path: str) -> "ModelConfig":
        with open(os.path.join(path, "config.json")) as f:
            return cls.from_dict(json.load(f))

    def check_tp(self, tp: int) -> None:
        """Raise a clear error when the model cannot be split `tp` ways (see layers/ for each split)."""
        problems = []
        if self.num_attention_heads % tp:
            problems.append(f"num_attention_heads={self.num_attention_heads}")
        if tp % self.num_key_value_heads and self.num_key_value_heads % tp:
            problems.append(f"num_key_value_heads={self.num_key_value_heads}")
        if self.linear_num_key_heads % tp:
            problems.append(f"linear_num_key_heads={self.linear_num_key_heads}")
        if self.linear_num_value_heads % tp:
            problems.append(f"linear_num_value_heads={self.linear_num_value_heads}")
        if self.is_moe and self.num_experts % tp:
            problems.append(f"num_experts={self.num_experts}")
        if not self.is_moe and self.intermediate_size % tp:
            problems.append(f"intermediate_size={self.intermediate_size}")
        if problems:
            raise ValueError(f"tensor parallel size {tp} does not divide " + ", ".join(problems))
