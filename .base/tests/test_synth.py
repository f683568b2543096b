"""Synthetic checkpoints (qwen35.synth) and model resolution (qwen35.hub).

The oracle is transformers 5.17: our checkpoints must load there with no missing/unexpected keys, to exactly the
tensors on disk, and our layout/init must match what HF builds from the same config.
"""
import importlib.util
import json
import math
import os
import threading

import pytest
import torch
from safetensors import safe_open
from transformers import (AutoConfig, Qwen3_5ForConditionalGeneration, Qwen3_5MoeForCausalLM,
                          Qwen3_5MoeForConditionalGeneration)

from qwen35 import hub, synth

HAS_TOKENIZER = importlib.util.find_spec("qwen35.tokenizer") is not None
SKIP = ("mtp.",)  # HF ignores the MTP head


def write(path, preset="tiny", **kw):
    return synth.write_checkpoint(str(path), preset, tokenizer=HAS_TOKENIZER, **kw)


def read_all(d):
    """{name: tensor} of a checkpoint directory, sharded or not."""
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(d, f), "pt") as sf:
                out.update({k: sf.get_tensor(k) for k in sf.keys()})
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny_tensors(tiny):
    return read_all(tiny)


def assert_loads_exactly(cls, d, disk, rename=lambda k: k):
    model, info = cls.from_pretrained(d, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    state = model.state_dict()
    for k, t in disk.items():
        if k.startswith(SKIP) or rename(k) is None:
            continue
        assert torch.equal(state[rename(k)], t.to(state[rename(k)].dtype)), k
    return state


def test_tiny_loads_in_transformers_with_both_prefixes(tiny, tiny_tensors):
    assert_loads_exactly(Qwen3_5MoeForConditionalGeneration, tiny, tiny_tensors)
    # the text-only class strips `language_model.` and skips model.visual.* / mtp.*
    causal = lambda k: None if k.startswith("model.visual.") else k.replace("model.language_model.", "model.")
    assert_loads_exactly(Qwen3_5MoeForCausalLM, tiny, tiny_tensors, causal)
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight"} <= tiny_tensors.keys()
    assert tiny_tensors["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    assert tiny_tensors["model.language_model.layers.0.mlp.experts.down_proj"].shape == (8, 64, 32)


def test_tiny_dense_loads_in_transformers(tmp_path):
    d = write(tmp_path, "tiny-dense")
    disk = read_all(d)
    assert_loads_exactly(Qwen3_5ForConditionalGeneration, d, disk)
    assert disk["model.language_model.layers.0.mlp.gate_proj.weight"].shape == (128, 64)
    assert not any(".experts." in k for k in disk)


def test_per_expert_loads_to_the_same_fused_tensors(tmp_path, tiny, tiny_tensors):
    d = write(tmp_path, per_expert=True)
    disk = read_all(d)
    assert "model.language_model.layers.3.mlp.experts.7.down_proj.weight" in disk
    assert not any(k.endswith("experts.gate_up_proj") and k.startswith("model.") for k in disk)
    per_expert = Qwen3_5MoeForConditionalGeneration.from_pretrained(d, output_loading_info=True)
    assert not any(per_expert[1][k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    fused = Qwen3_5MoeForConditionalGeneration.from_pretrained(tiny).state_dict()
    for k, t in per_expert[0].state_dict().items():
        assert torch.equal(t, fused[k]), k


def test_sharded_index_and_same_tensors(tmp_path, tiny_tensors):
    d = write(tmp_path, max_shard_bytes=20 * 2**20)
    index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    assert len(files) > 2 and not os.path.exists(os.path.join(d, "model.safetensors"))
    assert files == sorted(set(index["weight_map"].values()))
    assert all(f == f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, f in enumerate(files))
    seen = {}
    for f in files:
        with safe_open(os.path.join(d, f), "pt") as sf:
            for k in sf.keys():
                assert k not in seen and index["weight_map"][k] == f
                seen[k] = sf.get_tensor(k)
    assert seen.keys() == index["weight_map"].keys() == tiny_tensors.keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in seen.values())
    # a separate run with the same seed: determinism, independent of sharding
    assert all(torch.equal(seen[k], t) for k, t in tiny_tensors.items())


def test_dtypes_on_disk_and_seed(tmp_path, tiny_tensors):
    bf16 = read_all(write(tmp_path / "bf16", dtype="bfloat16"))
    fp32_names = {k for k in bf16 if k.endswith(("linear_attn.A_log", "linear_attn.norm.weight"))}
    assert len(fp32_names) == 6  # 3 GDN layers
    for k, t in bf16.items():
        assert t.dtype == (torch.float32 if k in fp32_names else torch.bfloat16), k
        assert torch.equal(t, tiny_tensors[k].to(t.dtype)), k  # same values, rounded
    assert json.load(open(tmp_path / "bf16" / "config.json"))["text_config"]["dtype"] == "bfloat16"
    other = read_all(write(tmp_path / "seed1", seed=1))
    assert not torch.equal(other["lm_head.weight"], tiny_tensors["lm_head.weight"])


def test_init_rule_statistics():
    g = torch.Generator().manual_seed(0)
    w = synth.init_tensor_("model.language_model.layers.0.mlp.experts.gate_up_proj", torch.empty(64, 128, 256), g)
    assert abs(w.std().item() - 0.02) < 2e-4 and abs(w.mean().item()) < 2e-4
    full = torch.full((8, 1000), 7.0, dtype=torch.bfloat16)  # a TP shard: a view of part of the tensor
    synth.init_tensor_("model.language_model.embed_tokens.weight", full[:, :500], g)
    assert (full[:, 500:] == 7).all() and abs(full[:, :500].float().std().item() - 0.02) < 2e-3
    for name in ("model.language_model.norm.weight", "model.language_model.layers.3.self_attn.q_norm.weight",
                 "model.language_model.layers.3.self_attn.k_norm.weight", "mtp.pre_fc_norm_embedding.weight",
                 "model.language_model.layers.0.input_layernorm.weight", "mtp.norm.weight",
                 "model.language_model.layers.0.post_attention_layernorm.weight"):
        assert (synth.init_tensor_(name, torch.full((16,), 5.0), g) == 0).all(), name
    for name in ("model.language_model.layers.0.linear_attn.norm.weight",
                 "model.language_model.layers.0.linear_attn.dt_bias"):
        assert (synth.init_tensor_(name, torch.zeros(16), g) == 1).all(), name
    a = synth.init_tensor_("model.language_model.layers.0.linear_attn.A_log", torch.zeros(10000), g).exp()
    assert a.min() >= 0.01 - 1e-6 and a.max() <= 16 + 1e-4 and abs(a.mean().item() - 8.005) < 0.3


def test_init_rule_matches_hf_init_weights():
    """Where HF initialises a parameter to a constant we must give the same constant; elsewhere the same scale."""
    cfg = AutoConfig.for_model(**{k: v for k, v in synth.PRESETS["tiny"].items() if k != "architectures"})
    hf = Qwen3_5MoeForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(0)
    for name, p in hf.named_parameters():
        ours = synth.init_tensor_(name, torch.empty_like(p, requires_grad=False), g)
        if p.numel() > 1 and (p == p.flatten()[0]).all():
            assert torch.equal(ours, p.detach()), name
        elif name.endswith("A_log"):
            assert ours.exp().min() >= 0.01 - 1e-6 and ours.exp().max() <= 16 + 1e-4
        else:
            assert abs(ours.std().item() / p.std().item() - 1) < 0.3, name


@pytest.mark.parametrize("preset,cls", [("tiny", Qwen3_5MoeForConditionalGeneration),
                                        ("qwen3.5-35b-a3b", Qwen3_5MoeForConditionalGeneration),
                                        ("tiny-dense", Qwen3_5ForConditionalGeneration),
                                        ("qwen3.5-4b", Qwen3_5ForConditionalGeneration)])
def test_layout_matches_hf_module_tree(preset, cls):
    """Names and shapes of every preset (full-size ones too) equal HF's parameters built from the same config."""
    raw = synth.PRESETS[preset]
    with torch.device("meta"):
        hf = cls(AutoConfig.for_model(**{k: v for k, v in raw.items() if k != "architectures"}))
    ours = {s.name: s.shape for s in synth.checkpoint_layout(raw) if not s.name.startswith(SKIP)}
    assert ours == {n: tuple(p.shape) for n, p in hf.named_parameters()}  # tied lm_head appears once


def test_full_size_preset_counts_match_the_release():
    specs = synth.checkpoint_layout(synth.PRESETS["qwen3.5-35b-a3b"])
    assert len(specs) == 1811  # spec section 7: 1,811 tensors in the release
    assert sum(math.prod(s.shape) for s in specs) == 35_951_822_704
    assert sum(s.dtype == torch.float32 for s in specs) == 60
    mtp_experts = [s.name for s in specs if s.name.startswith("mtp.") and ".experts." in s.name]
    assert len(mtp_experts) == 256 * 3 and all(n.endswith("_proj.weight") for n in mtp_experts)  # per-expert
    cfg = synth.PRESETS["qwen3.5-35b-a3b"]["text_config"]
    assert cfg["layer_types"].count("full_attention") == 10 and cfg["layer_types"][3] == "full_attention"
    assert synth.parse_size("5GB") == 5 * 10**9 and synth.parse_size("20MiB") == 20 * 2**20


@pytest.mark.skipif(not HAS_TOKENIZER, reason="qwen35.tokenizer has not landed yet")
def test_tokenizer_and_generation_config_written(tiny):
    assert os.path.isfile(os.path.join(tiny, "tokenizer.json"))
    gen = json.load(open(os.path.join(tiny, "generation_config.json")))
    assert gen["eos_token_id"] == [248046, 248044]


def test_resolve_local_dir_and_full_size_preset(tiny, tmp_path):
    assert hub.resolve_model(tiny) == os.path.abspath(tiny)
    with pytest.raises(FileNotFoundError, match="config.json"):
        hub.resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="--load-format dummy"):
        hub.resolve_model("qwen3.5-35b-a3b")


def test_resolve_tiny_preset_synthesizes_once(tmp_path, monkeypatch):
    monkeypatch.setenv("QWEN35_CACHE", str(tmp_path))
    d = hub.resolve_model("tiny")
    assert d == str(tmp_path / "synth" / "tiny") and os.path.isfile(os.path.join(d, "config.json"))
    stamp = os.stat(os.path.join(d, "model.safetensors")).st_mtime_ns
    assert hub.resolve_model("tiny") == d and os.stat(os.path.join(d, "model.safetensors")).st_mtime_ns == stamp
    assert sorted(os.listdir(tmp_path / "synth")) == [".tiny.lock", "tiny"]  # no temp dirs left behind


def test_resolve_concurrent_callers_synthesize_once(tmp_path, monkeypatch):
    calls = []

    def fake_write(out, preset, **kw):
        calls.append(preset)
        threading.Event().wait(0.3)  # long enough for the other caller to arrive
        open(os.path.join(out, "config.json"), "w").write("{}")

    monkeypatch.setattr(synth, "write_checkpoint", fake_write)
    results = []
    threads = [threading.Thread(target=lambda: results.append(hub.resolve_model("tiny-dense", str(tmp_path))))
               for _ in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert calls == ["tiny-dense"] and len(set(results)) == 1 and len(results) == 3


def test_resolve_hub_id_from_cache_or_clear_error(tmp_path, monkeypatch):
    import huggingface_hub.constants as c
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path))
    # a snapshot in the standard HF cache layout is found without network
    snap = tmp_path / "models--Qwen--Qwen3.5-35B-A3B" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (tmp_path / "models--Qwen--Qwen3.5-35B-A3B" / "refs").mkdir()
    (tmp_path / "models--Qwen--Qwen3.5-35B-A3B" / "refs" / "main").write_text("a" * 40)
    assert hub.resolve_model("Qwen/Qwen3.5-35B-A3B") == str(snap)
    with pytest.raises(RuntimeError, match="unreachable.*pass its path"):
        hub.resolve_model("Qwen/Qwen3.5-4B")


def test_full_size_preset_for_dummy_weights_is_config_only(tmp_path):
    from qwen35.hub import resolve_model
    path = resolve_model("qwen3.5-35b-a3b", cache_dir=str(tmp_path), load_format="dummy")
    files = set(os.listdir(path))
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= files
    assert not any(f.endswith(".safetensors") for f in files)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["text_config"]["num_experts"] == 256
    with pytest.raises(ValueError, match="load-format dummy"):
        resolve_model("qwen3.5-35b-a3b", cache_dir=str(tmp_path))
