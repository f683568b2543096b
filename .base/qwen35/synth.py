"""Synthetic Qwen3.5 checkpoints in the exact Hugging Face release layout (random weights), and dense LLaMA-like
ones (`tiny-llama`, `llama-1b`) in transformers' LlamaForCausalLM layout.

    python -m qwen35.synth --preset tiny --out /tmp/tiny [--seed 0] [--per-expert] [--mtp-fused] [--max-shard-size 5GB]

Real weights cannot be fetched everywhere we test, so we write checkpoints that a loader cannot tell from the
release: same config.json format, tensor names, shapes, dtypes (A_log / linear_attn.norm.weight in FP32),
fused experts, sharding + index, the MTP head (`mtp.*`, its experts per expert as in the 35B-A3B release; fused with
--mtp-fused, as Qwen3.6 ships it) and the vision tower (`model.visual.*`, which a text loader skips).
Every tensor is seeded from (seed, name), so the output does not depend on write order, sharding or layout;
tensors are generated one at a time and written one shard at a time (host memory stays bounded at full size).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import zlib
from dataclasses import dataclass

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from qwen35.config import LLAMA_LIKE, ModelConfig

FULL, LINEAR = "full_attention", "linear_attention"
FP32_ON_DISK = ("linear_attn.A_log", "linear_attn.norm.weight")  # as in the BF16 release (spec section 7)
INIT_STD = 0.02  # initializer_range of every Qwen3.5 config
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


def _layer_types(n: int, interval: int = 4) -> list[str]:
    return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]


def _rope(theta: float = 1e7) -> dict:
    return {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10], "mrope_interleaved": True}


def _text(model_type: str, dtype: str, **sizes) -> dict:
    """A text_config with the fields every Qwen3.5 release carries; `sizes` overrides/extends them."""
    n = sizes["num_hidden_layers"]
    cfg = {
        "model_type": model_type, "attention_bias": False, "attention_dropout": 0.0,
        "attn_output_gate": True, "bos_token_id": 248044, "eos_token_id": 248044, "pad_token_id": None,
        "dtype": dtype, "full_attention_interval": 4, "hidden_act": "silu", "initializer_range": INIT_STD,
        "layer_types": _layer_types(n), "linear_conv_kernel_dim": 4, "mamba_ssm_dtype": "float32",
        "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-6, "rope_parameters": _rope(), "use_cache": True, "vocab_size": 248320,
    }
    cfg.update(sizes)
    return cfg


def _wrapper(arch: str, model_type: str, text: dict, vision: dict) -> dict:
    return {
        "architectures": [arch], "model_type": model_type, "image_token_id": 248056, "video_token_id": 248057,
        "vision_start_token_id": 248053, "vision_end_token_id": 248054,
        "tie_word_embeddings": text["tie_word_embeddings"], "dtype": text["dtype"],
        "text_config": text, "vision_config": vision,
    }


def _vision(model_type: str, out_hidden: int, depth: int, hidden: int, inter: int, heads: int, npos: int) -> dict:
    return {"model_type": model_type, "depth": depth, "hidden_size": hidden, "intermediate_size": inter,
            "num_heads": heads, "out_hidden_size": out_hidden, "num_position_embeddings": npos,
            "hidden_act": "gelu_pytorch_tanh", "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2,
            "temporal_patch_size": 2, "deepstack_visual_indexes": [], "initializer_range": INIT_STD}


_TINY_TEXT = dict(
    hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=16, linear_value_head_dim=16,
    max_position_embeddings=4096, tie_word_embeddings=False,
)
_TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)

PRESETS: dict[str, dict] = {
    # The tests of the whole project rely on these two: do not change their sizes.
    "tiny": _wrapper(
        "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe",
        _text("qwen3_5_moe_text", "float32", **_TINY_TEXT, **_TINY_MOE),
        _vision("qwen3_5_moe_vision", 64, depth=1, hidden=32, inter=64, heads=2, npos=16),
    ),
    "tiny-dense": _wrapper(
        "Qwen3_5ForConditionalGeneration", "qwen3_5",
        _text("qwen3_5_text", "float32", **_TINY_TEXT, intermediate_size=128),
        _vision("qwen3_5_vision", 64, depth=1, hidden=32, inter=64, heads=2, npos=16),
    ),
    # Qwen/Qwen3.5-35B-A3B: every value from spec section 1 (corroborated by >= 3 public copies). The vision
    # tower (27 blocks, 1152 wide) reproduces the spec's 446,571,248 vision parameters and 1,811 tensors.
    "qwen3.5-35b-a3b": _wrapper(
        "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe",
        _text("qwen3_5_moe_text", "bfloat16", hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
              num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
              linear_key_head_dim=128, linear_value_head_dim=128, num_experts=256, num_experts_per_tok=8,
              moe_intermediate_size=512, shared_expert_intermediate_size=512, router_aux_loss_coef=0.001,
              output_router_logits=False, max_position_embeddings=262144, tie_word_embeddings=False),
        _vision("qwen3_5_moe_vision", 2048, depth=27, hidden=1152, inter=4304, heads=16, npos=2304),
    ),
    # Qwen/Qwen3.5-4B. Confirmed by 3 independent public config copies: hidden 2560, intermediate 9216,
    # 32 layers, 16 heads / 4 kv heads / head_dim 256, linear heads 16 k / 32 v of dim 128, vocab 248320,
    # max_position 262144, tie_word_embeddings TRUE, rope theta 1e7 / partial 0.25, mtp_num_hidden_layers 1,
    # eos 248044. NOT confirmed: the vision tower sizes (depth 24 / width 1024 from one fixture; 4096 MLP and
    # 16 heads assumed).
    "qwen3.5-4b": _wrapper(
        "Qwen3_5ForConditionalGeneration", "qwen3_5",
        _text("qwen3_5_text", "bfloat16", hidden_size=2560, intermediate_size=9216, num_hidden_layers=32,
              num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
              linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
              max_position_embeddings=262144, tie_word_embeddings=True),
        _vision("qwen3_5_vision", 2560, depth=24, hidden=1024, inter=4096, heads=16, npos=2304),
    ),
}


def _llama(dtype: str, **sizes) -> dict:
    """A LlamaForCausalLM config.json as transformers writes one (v4 field names, which it still reads)."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
           "attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": INIT_STD, "mlp_bias": False,
           "pretraining_tp": 1, "rms_norm_eps": 1e-5, "use_cache": True, "dtype": dtype}
    cfg.update(sizes)
    return cfg


PRESETS.update({
    # A tiny Llama for CPU runs of the LLaMA-like path end to end (LLM, server): the vocabulary covers the Qwen
    # tokenizer written beside it, so any text it encodes is in range.
    "tiny-llama": _llama("float32", vocab_size=248320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                         rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=248044,
                         eos_token_id=[248046, 248044]),
    # Llama-3.2-1B-shaped (1.24B parameters): sizes of the public meta-llama/Llama-3.2-1B config as commonly
    # quoted (hidden 2048, MLP 8192, 16 layers, 32 heads / 8 KV heads of 64, vocab 128256, tied, llama3 RoPE
    # factor 32 over 8192, theta 5e5); not checked against the hub here. For benchmarks with dummy weights.
    "llama-1b": _llama("bfloat16", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                       num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                       max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=True,
                       rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                       bos_token_id=128000, eos_token_id=128001),
    # Llama-3.2-3B-shaped (3.2B parameters): the same family's 3B sizes as commonly quoted (hidden 3072, MLP 8192,
    # 28 layers, 24 heads / 8 KV heads of 128, tied, the same vocabulary and RoPE); not checked against the hub here.
    # For benchmarks with dummy weights.
    "llama-3b": _llama("bfloat16", vocab_size=128256, hidden_size=3072, intermediate_size=8192,
                       num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=True,
                       rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                       bos_token_id=128000, eos_token_id=128001),
})
TINY_PRESETS = ("tiny", "tiny-dense", "tiny-llama")

GENERATION_CONFIG = {  # spec section 1; sampling values are the model-card ones, not confirmed for this repo
    "bos_token_id": 248044, "eos_token_id": [248046, 248044], "pad_token_id": 248044,
    "do_sample": True, "temperature": 1.0, "top_k": 20, "top_p": 0.95,
}


def preset_text(preset: str, layers: int = 0) -> dict:
    """A copy of a preset's text config with its first `layers` decoder layers only (0: all of them): the
    benchmarks' full-size models cut short."""
    text = dict(PRESETS[preset]["text_config"])
    if layers:
        text["num_hidden_layers"] = layers
        text["layer_types"] = text["layer_types"][:layers]
    return text


# ----------------------------------------------------------------------------------------------------------
# The random-init rule (shared with `--load-format dummy`)

# Zero-centred RMSNorms, computed as x * (1 + w): HF initialises their weights to zeros.
_ZERO_CENTRED_NORMS = {"input_layernorm", "post_attention_layernorm", "norm", "q_norm", "k_norm",
                       "pre_fc_norm_embedding", "pre_fc_norm_hidden"}


def init_tensor_(name: str, t: torch.Tensor, gen: torch.Generator, zero_centred_norms: bool = True) -> torch.Tensor:
    """Fill `t` in place as HF `Qwen3_5MoePreTrainedModel._init_weights` would initialise parameter `name` (with
    zero_centred_norms=False, as a LLaMA-like's: its RMSNorm weights are ones).

    `t` may be any dtype/device and may be one rank's shard of the full tensor; `gen` must live on t.device.
    """
    parts = name.split(".")
    module = parts[-2] if len(parts) > 1 else ""
    if name.endswith(".bias"):  # vision Linear/Conv3d/LayerNorm biases
        return t.zero_()
    if name.endswith("linear_attn.A_log"):  # log of uniform(0.01, 16), like HF (lower bound keeps log finite)
        a = torch.empty(t.shape, dtype=torch.float32, device=t.device).uniform_(0.01, 16, generator=gen)
        return t.copy_(a.log_())
    if name.endswith("linear_attn.dt_bias") or name.endswith("linear_attn.norm.weight"):
        return t.fill_(1.0)  # dt_bias: HF ones; gated norm multiplies by w directly (not zero-centred)
    if name.startswith("model.visual.") and "norm" in module:
        return t.fill_(1.0)  # vision LayerNorms (plain, not zero-centred)
    if module in _ZERO_CENTRED_NORMS and name.endswith(".weight"):
        return t.zero_() if zero_centred_norms else t.fill_(1.0)
    # Linear, embedding, router, fused/per-expert weights, conv1d (HF inits Conv1d like Linear), pos_embed
    return t.normal_(0.0, INIT_STD, generator=gen)


# ----------------------------------------------------------------------------------------------------------
# Checkpoint layout

@dataclass(frozen=True)
class TensorSpec:
    name: str                      # on-disk name
    shape: tuple[int, ...]
    dtype: torch.dtype
    source: str                    # tensor that is generated (seeded from its name); a fused one for per-expert
    source_shape: tuple[int, ...]
    index: tuple = ()              # indexing of the source tensor that gives this one

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _as_dtype(d) -> torch.dtype:
    return d if isinstance(d, torch.dtype) else getattr(torch, str(d))


def checkpoint_layout(raw: dict, per_expert: bool = False, mtp_per_expert: bool = True) -> list[TensorSpec]:
    """Every tensor of the checkpoint described by config dict `raw`, in write order: the main layers' experts fused
    (per expert with `per_expert`), the MTP layer's per expert (fused without `mtp_per_expert`)."""
    cfg = ModelConfig.from_dict(raw)
    text = raw.get("text_config", raw)
    dtype = _as_dtype(text.get("dtype", raw.get("dtype", "bfloat16")))
    specs: list[TensorSpec] = []

    def add(name, shape):
        shape = tuple(shape)
        specs.append(TensorSpec(name, shape, torch.float32 if name.endswith(FP32_ON_DISK) else dtype, name, shape))

    def experts(p, split):
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        gu, dn = (f"{p}mlp.experts.gate_up_proj", (e, 2 * i, h)), (f"{p}mlp.experts.down_proj", (e, h, i))
        if not split:
            return add(*gu), add(*dn)
        # HF conversion: per-expert gate/up are stacked on dim 0 and concatenated on dim 1 (gate first)
        for x in range(e):
            for proj, src, idx in (("gate_proj", gu, (x, slice(0, i))), ("up_proj", gu, (x, slice(i, 2 * i))),
                                   ("down_proj", dn, (x,))):
                shape = torch.empty(src[1], device="meta")[idx].shape
                specs.append(TensorSpec(f"{p}mlp.experts.{x}.{proj}.weight", tuple(shape), dtype, *src, idx))

    def layer(p, kind, split_experts):
        h = cfg.hidden_size
        if kind == LINEAR:
            kd, vd, nv = cfg.linear_key_dim, cfg.linear_value_dim, cfg.linear_num_value_heads
            add(f"{p}linear_attn.in_proj_qkv.weight", (2 * kd + vd, h))
            add(f"{p}linear_attn.in_proj_z.weight", (vd, h))
            add(f"{p}linear_attn.in_proj_b.weight", (nv, h))
            add(f"{p}linear_attn.in_proj_a.weight", (nv, h))
            add(f"{p}linear_attn.conv1d.weight", (2 * kd + vd, 1, cfg.linear_conv_kernel_dim))
            add(f"{p}linear_attn.A_log", (nv,))
            add(f"{p}linear_attn.dt_bias", (nv,))
            add(f"{p}linear_attn.norm.weight", (cfg.linear_value_head_dim,))
            add(f"{p}linear_attn.out_proj.weight", (h, vd))
        else:
            nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
            q_rows = (2 if cfg.attn_output_gate else 1) * nh * hd  # with the gate: per head [query | gate]
            for proj, rows in (("q_proj", q_rows), ("k_proj", nkv * hd), ("v_proj", nkv * hd)):
                add(f"{p}self_attn.{proj}.weight", (rows, h))
                if cfg.qkv_bias:
                    add(f"{p}self_attn.{proj}.bias", (rows,))
            add(f"{p}self_attn.o_proj.weight", (h, nh * hd))
            if cfg.o_bias:
                add(f"{p}self_attn.o_proj.bias", (h,))
            if cfg.qk_norm:
                add(f"{p}self_attn.q_norm.weight", (hd,))
                add(f"{p}self_attn.k_norm.weight", (hd,))
        if cfg.is_moe:
            add(f"{p}mlp.gate.weight", (cfg.num_experts, h))
            experts(p, split_experts)
            s = cfg.shared_expert_intermediate_size
            add(f"{p}mlp.shared_expert.gate_proj.weight", (s, h))
            add(f"{p}mlp.shared_expert.up_proj.weight", (s, h))
            add(f"{p}mlp.shared_expert.down_proj.weight", (h, s))
            add(f"{p}mlp.shared_expert_gate.weight", (1, h))
        else:
            add(f"{p}mlp.gate_proj.weight", (cfg.intermediate_size, h))
            add(f"{p}mlp.up_proj.weight", (cfg.intermediate_size, h))
            add(f"{p}mlp.down_proj.weight", (h, cfg.intermediate_size))
            if cfg.mlp_bias:
                for proj, n in (("gate_proj", cfg.intermediate_size), ("up_proj", cfg.intermediate_size),
                                ("down_proj", h)):
                    add(f"{p}mlp.{proj}.bias", (n,))
        add(f"{p}input_layernorm.weight", (h,))
        add(f"{p}post_attention_layernorm.weight", (h,))

    wp, h = cfg.weight_prefix, cfg.hidden_size
    add(f"{wp}embed_tokens.weight", (cfg.vocab_size, h))
    for i, kind in enumerate(cfg.layer_types):
        layer(f"{wp}layers.{i}.", kind, per_expert)
    add(f"{wp}norm.weight", (h,))
    if not cfg.tie_word_embeddings:
        add("lm_head.weight", (cfg.vocab_size, h))
    # MTP head: a full-attention layer whose experts are per-expert in the 35B-A3B release (spec section 7)
    n_mtp = int(text.get("mtp_num_hidden_layers", 0) or 0)
    if n_mtp:
        add("mtp.fc.weight", (h, 2 * h))
        for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            add(f"mtp.{norm}.weight", (h,))
        for j in range(n_mtp):
            layer(f"mtp.layers.{j}.", FULL, mtp_per_expert)
    if raw.get("vision_config"):
        specs += _vision_specs(raw["vision_config"], dtype)
    return specs


def _vision_specs(v: dict, dtype: torch.dtype) -> list[TensorSpec]:
    """The vision tower (`model.visual.*`): written so that multimodal loaders find it and text loaders skip it."""
    d, f, m = v["hidden_size"], v["intermediate_size"], v.get("spatial_merge_size", 2)
    shapes = {"model.visual.patch_embed.proj.weight": (d, v.get("in_channels", 3), v.get("temporal_patch_size", 2),
                                                      v.get("patch_size", 16), v.get("patch_size", 16)),
              "model.visual.patch_embed.proj.bias": (d,),
              "model.visual.pos_embed.weight": (v["num_position_embeddings"], d)}
    for b in range(v["depth"]):
        p = f"model.visual.blocks.{b}."
        for k, shape in (("norm1", (d,)), ("norm2", (d,))):
            shapes[f"{p}{k}.weight"] = shapes[f"{p}{k}.bias"] = shape
        for k, (o, i) in (("attn.qkv", (3 * d, d)), ("attn.proj", (d, d)), ("mlp.linear_fc1", (f, d)),
                          ("mlp.linear_fc2", (d, f))):
            shapes[f"{p}{k}.weight"], shapes[f"{p}{k}.bias"] = (o, i), (o,)
    dm = d * m * m
    shapes["model.visual.merger.norm.weight"] = shapes["model.visual.merger.norm.bias"] = (d,)
    for k, (o, i) in (("linear_fc1", (dm, dm)), ("linear_fc2", (v["out_hidden_size"], dm))):
        shapes[f"model.visual.merger.{k}.weight"], shapes[f"model.visual.merger.{k}.bias"] = (o, i), (o,)
    return [TensorSpec(n, s, dtype, n, s) for n, s in shapes.items()]


# ----------------------------------------------------------------------------------------------------------
# Writing

def tensor_seed(seed: int, name: str) -> int:
    """Per-tensor seed: stable across processes (crc32, not hash()) and independent of write order."""
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63)


def _resolve_config(preset: str | dict, dtype) -> dict:
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
        preset = PRESETS[preset]
    raw = copy.deepcopy(preset)
    if dtype is not None:
        name = str(_as_dtype(dtype)).removeprefix("torch.")
        raw["dtype"] = name
        raw.get("text_config", raw)["dtype"] = name
    return raw


def _plan_shards(specs: list[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    """Greedy split in write order; a tensor larger than max_bytes gets a shard of its own (as HF does)."""
    shards, size = [[]], 0
    for s in specs:
        if shards[-1] and size + s.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    return shards


def write_checkpoint(out_dir: str, preset: str | dict, seed: int = 0, per_expert: bool = False,
                     max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, dtype=None, tokenizer: bool = True,
                     weights: bool = True, mtp_per_expert: bool = True) -> str:
    """Write a full checkpoint (config, weights, generation config, tokenizer) to `out_dir`; return it.

    `preset`: a PRESETS name or a config dict. `dtype` overrides the config's dtype (A_log and
    linear_attn.norm.weight stay FP32). `tokenizer=False` skips the tokenizer files; `weights=False` writes
    everything but the weights (what `--load-format dummy` needs of a full-size preset).
    """
    raw = _resolve_config(preset, dtype)
    os.makedirs(out_dir, exist_ok=True)
    if weights:
        _write_weights(out_dir, raw, seed, per_expert, max_shard_bytes, mtp_per_expert)
    gen_config = GENERATION_CONFIG
    if raw.get("model_type") in LLAMA_LIKE:  # its own special tokens, greedy defaults
        gen_config = {k: raw[k] for k in ("bos_token_id", "eos_token_id") if raw.get(k) is not None}
    _write_json(os.path.join(out_dir, "generation_config.json"), gen_config)
    if tokenizer:
        try:
            from qwen35.tokenizer import write_tokenizer_files
        except ImportError as e:
            raise RuntimeError("qwen35.tokenizer.write_tokenizer_files is unavailable, cannot write the tokenizer "
                               f"files ({e}); pass tokenizer=False to write the weights only") from e
        write_tokenizer_files(out_dir)
    _write_json(os.path.join(out_dir, "config.json"), raw)  # last: a directory with config.json is complete
    return out_dir


def _write_weights(out_dir: str, raw: dict, seed: int, per_expert: bool, max_shard_bytes: int,
                   mtp_per_expert: bool) -> None:
    specs = checkpoint_layout(raw, per_expert, mtp_per_expert)
    shards = _plan_shards(specs, max_shard_bytes)
    n = len(shards)
    files = ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    zero_centred = ModelConfig.from_dict(raw).zero_centred_norms

    gen = torch.Generator()
    cached: tuple[str, torch.Tensor] | None = None  # last fused source, reused by its per-expert slices
    weight_map = {}
    with tqdm(total=sum(s.nbytes for s in specs), unit="B", unit_scale=True, desc="synth", leave=False) as bar:
        for fname, shard in zip(files, shards):
            tensors = {}
            for s in shard:
                if cached is None or cached[0] != s.source:
                    src = torch.empty(s.source_shape, dtype=torch.float32)  # fp32, then cast: same values per dtype
                    gen.manual_seed(tensor_seed(seed, s.source))
                    cached = (s.source, init_tensor_(s.source, src, gen, zero_centred_norms=zero_centred))
                tensors[s.name] = cached[1][s.index].to(s.dtype).contiguous()
                weight_map[s.name] = fname
                bar.update(s.nbytes)
            save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
            del tensors
    if n > 1:
        index = {"metadata": {"total_size": sum(s.nbytes for s in specs)}, "weight_map": weight_map}
        _write_json(os.path.join(out_dir, "model.safetensors.index.json"), index)


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def parse_size(size: str) -> int:
    """'5GB' -> 5e9, '500MiB' -> 500 * 2**20 (units as in transformers' max_shard_size)."""
    s = size.strip().upper()
    for unit, mult in (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("GB", 10**9), ("MB", 10**6),
                       ("KB", 10**3), ("B", 1)):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(s)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", required=True, choices=sorted(PRESETS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--per-expert", action="store_true", help="write experts.{e}.*_proj.weight instead of fused")
    ap.add_argument("--mtp-fused", action="store_true",
                    help="write the MTP layer's experts fused (Qwen3.6's layout) instead of per expert (35B-A3B's)")
    ap.add_argument("--max-shard-size", default="5GB")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None, help="default: the preset's")
    ap.add_argument("--no-tokenizer", action="store_true")
    a = ap.parse_args(argv)
    write_checkpoint(a.out, a.preset, seed=a.seed, per_expert=a.per_expert,
                     max_shard_bytes=parse_size(a.max_shard_size), dtype=a.dtype, tokenizer=not a.no_tokenizer,
                     mtp_per_expert=not a.mtp_fused)
    print(a.out)


if __name__ == "__main__":
    main()
