"""Checkpoint loading: the release layout written by qwen35.synth (fused or per-expert experts, single file or
sharded with an index, mtp.* and model.visual.* to skip), checked against transformers loading the same files, and
the clear errors for missing, misshapen and non-float tensors."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from qwen35.config import ModelConfig
from qwen35.engine_config import EngineArgs
from qwen35.runner import ModelRunner
from qwen35.synth import write_checkpoint
from scheduler.plan import StepPlan

TOL = 1e-4


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for name, kw in {"fused": {}, "per_expert": {"per_expert": True},
                     "sharded": {"max_shard_bytes": 40 * 2**20}}.items():
        out[name] = str(root / name)
        write_checkpoint(out[name], "tiny", seed=3, tokenizer=False, **kw)
    return out


def runner_for(path, **kw):
    return ModelRunner(ModelConfig.from_dir(path), EngineArgs(model=path, device="cpu", max_num_seqs=2,
                                                              max_model_len=256, **kw), path)


def logits_of(runner, ids):
    return runner.execute(StepPlan([0], [ids], [0], [list(range(8))], [True]))[0]


def test_layouts_load_identically_and_match_transformers(ckpts):
    from transformers import Qwen3_5MoeForCausalLM
    ids = torch.randint(0, 248000, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    runners = {k: runner_for(p) for k, p in ckpts.items()}
    ref_params = dict(runners["fused"].model.named_parameters())
    for name in ("per_expert", "sharded"):
        for pname, p in runners[name].model.named_parameters():
            assert torch.equal(p, ref_params[pname]), (name, pname)
    assert os.path.exists(os.path.join(ckpts["sharded"], "model.safetensors.index.json"))
    hf = Qwen3_5MoeForCausalLM.from_pretrained(ckpts["fused"], dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    ours = logits_of(runners["fused"], ids)
    assert ref.abs().max() > 0.01
    assert (ours - ref).abs().max().item() <= TOL


def _edit_copy(src, dst, edit):
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)
    return path


def test_missing_tensor_is_named(ckpts, tmp_path):
    name = "model.language_model.layers.3.self_attn.o_proj.weight"
    _edit_copy(ckpts["fused"], tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=r"layers\.3\.self_attn\.o_proj\.weight"):
        runner_for(str(tmp_path / "m"))


def test_misshapen_tensor_names_tensor_and_file(ckpts, tmp_path):
    name = "model.language_model.layers.0.linear_attn.in_proj_z.weight"
    path = _edit_copy(ckpts["fused"], tmp_path / "s", lambda t: t.__setitem__(name, torch.zeros(3, 64)))
    with pytest.raises(ValueError, match=r"in_proj_z\.weight.*model\.safetensors.*expected"):
        runner_for(str(tmp_path / "s"))
    assert os.path.basename(path) == "model.safetensors"


def test_expert_outside_the_model_is_named(ckpts, tmp_path):
    """A per-expert tensor for expert 8 of a model with 8 experts (a config that does not fit the checkpoint)."""
    src = "model.language_model.layers.0.mlp.experts.7.down_proj.weight"
    name = src.replace(".7.", ".8.")
    _edit_copy(ckpts["per_expert"], tmp_path / "e", lambda t: t.__setitem__(name, t[src].clone()))
    with pytest.raises(ValueError, match=r"experts\.8\.down_proj\.weight.*expert 8, but the model has 8"):
        runner_for(str(tmp_path / "e"))


def test_integer_tensor_is_rejected(ckpts, tmp_path):
    name = "model.language_model.norm.weight"
    _edit_copy(ckpts["fused"], tmp_path / "d", lambda t: t.__setitem__(name, torch.zeros(64, dtype=torch.int32)))
    with pytest.raises(ValueError, match=r"norm\.weight.*dtype I32"):
        runner_for(str(tmp_path / "d"))


def test_fp32_tensors_stay_fp32_and_config_reads_nested(ckpts):
    runner = runner_for(ckpts["fused"], dtype="bfloat16")
    gdn = runner.model.layers[0].linear_attn
    assert gdn.A_log.dtype == torch.float32 and gdn.norm.weight.dtype == torch.float32
    assert gdn.in_proj_qkv.weight.dtype == torch.bfloat16
    with open(os.path.join(ckpts["fused"], "config.json")) as f:
        raw = json.load(f)
    cfg = ModelConfig.from_dict(raw)
    assert "text_config" in raw and cfg.weight_prefix == "model.language_model."
    assert cfg.full_attention_layers == [3] and cfg.rotary_dim == 8 and cfg.num_experts == 8


@pytest.mark.parametrize("layout", ["fused", "per_expert"])
def test_expert_shards_at_tp2_are_slices_of_the_intermediate_dimension(ckpts, layout, monkeypatch):
    """Under TP every rank holds all experts, each cut to its share of the intermediate rows (layers/moe/experts.py):
    ranks 0 and 1 of TP=2, loaded from either layout, put together give the TP=1 tensors (gate rows, then up rows;
    the down projection's columns)."""
    from dist import parallel
    from qwen35.checkpoint import load_checkpoint
    from qwen35.model import Qwen35Model
    cfg = ModelConfig.from_dir(ckpts[layout])

    def experts_at(rank, world):
        monkeypatch.setattr(parallel, "_RANK", rank)
        monkeypatch.setattr(parallel, "_WORLD", world)
        model = Qwen35Model(cfg, dtype=torch.float32, device="cpu", max_positions=64)
        load_checkpoint(model, ckpts[layout], "cpu")
        return model.layers[0].mlp.experts
    full, shards = experts_at(0, 1), [experts_at(r, 2) for r in range(2)]
    I = cfg.moe_intermediate_size
    assert all(s.start == 0 and s.num_local == cfg.num_experts for s in shards)
    assert all(s.gate_up_proj.shape == (cfg.num_experts, I, cfg.hidden_size) for s in shards)
    gate = torch.cat([s.gate_up_proj[:, :I // 2] for s in shards], 1)
    up = torch.cat([s.gate_up_proj[:, I // 2:] for s in shards], 1)
    assert torch.equal(torch.cat([gate, up], 1), full.gate_up_proj)
    assert torch.equal(torch.cat([s.down_proj for s in shards], 2), full.down_proj)


def test_tp_must_divide_the_expert_intermediate_dimension(ckpts):
    cfg = ModelConfig.from_dir(ckpts["fused"])
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        cfg.check_tp(cfg.moe_intermediate_size * 2)
