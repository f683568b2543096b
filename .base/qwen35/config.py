"""Model configuration, read from a Hugging Face `config.json`.

Two families, one ModelConfig:
- Qwen3.5: the multimodal wrapper (`Qwen3_5MoeForConditionalGeneration`, sizes under `text_config`) and flat text
  configs, MoE (`qwen3_5_moe*`) and dense (`qwen3_5*`): DeltaNet + gated attention layers, zero-centred norms.
- dense LLaMA-likes (`llama`, `qwen2`, `qwen3`, as transformers writes them): every layer plain attention (no
  output gate), RoPE with the usual scalings, SwiGLU MLP, plain RMSNorm (`w * x`); Qwen2 adds q/k/v biases, Qwen3
  per-head q/k RMSNorm. They are the same decoder (qwen35/model.py) with the attention options switched.
Every model dimension used anywhere in the engine comes from here.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"

# the dense LLaMA-likes, as transformers builds them from their config: Qwen2's q/k/v projections always have biases
# (its o_proj never); Llama and Qwen3 have q/k/v/o biases only with attention_bias; Qwen3 norms q and k per head
# and defaults head_dim to 128 where the config has none (the others to hidden_size / heads)
LLAMA_LIKE = {  # bias None: as the config's attention_bias says
    "llama": {"qkv_bias": None, "o_bias": None, "qk_norm": False, "head_dim": None},
    "qwen2": {"qkv_bias": True, "o_bias": False, "qk_norm": False, "head_dim": None},
    "qwen3": {"qkv_bias": None, "o_bias": None, "qk_norm": True, "head_dim": 128},
}
ROPE_SCALINGS = ("linear", "dynamic", "llama3", "yarn")  # layers/rotary.py rope_frequencies
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe", "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
                 "Qwen3_5ForConditionalGeneration": "qwen3_5", "Qwen3_5ForCausalLM": "qwen3_5_text"}


def _eos(raw: dict, text: dict) -> list[int]:
    eos = text.get("eos_token_id", raw.get("eos_token_id"))
    return [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])


def _tie(raw: dict, text: dict) -> bool:
    return bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


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
    # gated DeltaNet (all 0 for a model without DeltaNet layers)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
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
    # attention and norm options: Qwen3.5 has all of the first three and no biases; see LLAMA_LIKE for the others
    attn_output_gate: bool = True   # q_proj rows per head [q | gate], output * sigmoid(gate) before o_proj
    qk_norm: bool = True            # per-head RMSNorm of q and k before RoPE
    zero_centred_norms: bool = True  # RMSNorm weights stored as a delta around 1: x * (1 + w); else plain x * w
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    # RoPE scaling: None for plain RoPE, else {"rope_type": linear|dynamic|llama3|yarn, "factor": ..., ...}
    # (layers/rotary.py reads it)
    rope_scaling: dict | None = None
    # multi-token-prediction head (spec section 9, `mtp.*`): its decoder layers (0: none), and whether it has an
    # embedding of its own (false in every Qwen3.5 release: it shares the main model's)
    mtp_num_hidden_layers: int = 0
    mtp_use_dedicated_embeddings: bool = False

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
        """The config of a `config.json` dict; the family comes from `model_type`, else from `architectures`."""
        text = raw.get("text_config") or raw
        model_type = raw.get("model_type", text.get("model_type"))
        if model_type is None:
            archs = raw.get("architectures") or []
            model_type = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
            if model_type is None and archs:
                raise ValueError(f"config: no model_type and unsupported architectures {archs}; supported: "
                                 f"{', '.join(ARCHITECTURES)}")
            model_type = model_type or "qwen3_5_moe"  # the flagship's text config written without a model_type
        if model_type in LLAMA_LIKE:
            return cls._llama_like(raw, model_type)
        if not str(model_type).startswith("qwen3_5"):
            raise ValueError(f"config: model_type {model_type!r} is not supported (Qwen3.5: qwen3_5, qwen3_5_moe; "
                             f"dense LLaMA-likes: {', '.join(LLAMA_LIKE)})")
        return cls._qwen35(raw, text, model_type)

    @classmethod
    def _qwen35(cls, raw: dict, text: dict, model_type: str) -> "ModelConfig":
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
        num_experts = int(text.get("num_experts", 0) or 0)
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
            tie_word_embeddings=_tie(raw, text),
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            eos_token_ids=_eos(raw, text),
            weight_prefix="model.language_model." if nested else "model.",
            model_type=model_type,
            mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", 0) or 0),
            mtp_use_dedicated_embeddings=bool(text.get("mtp_use_dedicated_embeddings", False)),
        )

    @classmethod
    def _llama_like(cls, raw: dict, model_type: str) -> "ModelConfig":
        family = LLAMA_LIKE[model_type]
        n_layers = int(raw["num_hidden_layers"])
        for t in raw.get("layer_types") or []:
            if t != FULL_ATTENTION:
                raise ValueError(f"config: layer type {t!r} is not supported (sliding-window attention is not "
                                 "implemented; only full_attention)")
        if raw.get("use_sliding_window") and raw.get("sliding_window"):
            raise ValueError("config: use_sliding_window is not supported (sliding-window attention is not "
                             "implemented)")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config: hidden_act {act!r} is not supported (only silu: the SwiGLU MLP)")
        heads = int(raw["num_attention_heads"])
        head_dim = int(raw.get("head_dim") or family["head_dim"] or raw["hidden_size"] // heads)
        # transformers 5 writes rope_parameters (theta inside); older configs rope_theta + rope_scaling ("type")
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type")) or "default"
        rope_theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        max_pos = int(raw.get("max_position_embeddings", 2048))
        scaling = None
        if rope_type not in ("default", *ROPE_SCALINGS):
            raise ValueError(f"config: rope_type {rope_type!r} is not supported (default, {', '.join(ROPE_SCALINGS)})")
        if rope_type != "default":
            scaling = {k: v for k, v in rope.items() if k not in ("type", "rope_theta", "partial_rotary_factor")}
            scaling["rope_type"] = rope_type
            # as transformers: the pretraining length defaults to max_position_embeddings, where dynamic reads it
            scaling.setdefault("original_max_position_embeddings", max_pos)
            if rope_type == "dynamic":
                scaling["original_max_position_embeddings"] = max_pos
            if rope_type == "yarn" and scaling.get("factor") is None:  # transformers' implicit factor
                scaling["factor"] = max_pos / scaling["original_max_position_embeddings"]
            if scaling.get("factor") is None:
                raise ValueError(f"config: rope_type {rope_type!r} needs a factor")
            missing = {"low_freq_factor", "high_freq_factor"} - scaling.keys() if rope_type == "llama3" else set()
            if missing:
                raise ValueError(f"config: rope_type 'llama3' needs {', '.join(sorted(missing))}")
        bias = bool(raw.get("attention_bias", False))
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            num_hidden_layers=n_layers,
            layer_types=[FULL_ATTENTION] * n_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rotary_dim=head_dim,  # transformers rotates whole heads for these (no partial rotary)
            rope_theta=rope_theta,
            intermediate_size=int(raw["intermediate_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=_tie(raw, raw),
            max_position_embeddings=max_pos,
            eos_token_ids=_eos(raw, raw),
            weight_prefix="model.",
            model_type=model_type,
            attn_output_gate=False,
            qk_norm=family["qk_norm"],
            zero_centred_norms=False,
            qkv_bias=bias if family["qkv_bias"] is None else family["qkv_bias"],
            o_bias=bias if family["o_bias"] is None else family["o_bias"],
            mlp_bias=bool(raw.get("mlp_bias", False)),
            rope_scaling=scaling,
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
        if self.is_moe:  # every expert split by its intermediate dimension (layers/moe/experts.py)
            problems += [f"{k}={getattr(self, k)}" for k in ("moe_intermediate_size", "shared_expert_intermediate_size")
                         if getattr(self, k) % tp]
        if not self.is_moe and self.intermediate_size % tp:
            problems.append(f"intermediate_size={self.intermediate_size}")
        if problems:
            raise ValueError(f"tensor parallel size {tp} does not divide " + ", ".join(problems))
