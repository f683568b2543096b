"""The MTP head (qwen35/mtp.py): config fields, loading from both checkpoint layouts, the dummy loader, its forward
against a direct torch computation written from the spec (section 9 on sections 4 and 5), drafting (catch-up pass
and later drafts through its own paged KV cache) against that computation, TP=2 over gloo against TP=1; and the
synthetic-acceptance weights (qwen35/synth_spec.py) on the tiny model: greedy follows the permutation, the drafts
follow it two ahead, and at temperature 1 the acceptance that layers/spec_sampling.py measures is the requested one.

Module-level tests: the caches (the head's KV, the main model's) are allocated here, the batches built here.
fp32 throughout; TOL is the agreement of two computations of the same fp32 function."""
import dataclasses
import functools
import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from layers import backend
from layers.attention import GatedAttention
from layers.deltanet import GatedDeltaNet
from layers.forward_batch import ForwardBatch
from layers.sampler import SampleBatch, sample_torch
from layers.spec_sampling import at_positions, draft_sample, filtered_logits, verify_sampled
from qwen35 import synth
from qwen35.checkpoint import load_checkpoint
from qwen35.config import ModelConfig
from qwen35.model import Qwen35Model
from qwen35.mtp import attach_mtp, catch_up, propose
from qwen35.synth_spec import LAYER_SCALE, init_spec_weights, regular_tokens, successor_cycle
from tests.hf_reference import run_ranks

TOL = 1e-5
BLOCK = 16
NUM_BLOCKS = 512
SLOTS = 64
SMALL_VOCAB = 4096
ACCEPTANCE_TOL = 0.05  # |measured - requested| at temperature 1 on the tiny model (about 4 standard errors)


# ------------------------------------------------------------------------------------------------ helpers
def small_vocab(vocab: int = SMALL_VOCAB) -> dict:
    """The tiny preset's config with a `vocab`-token vocabulary (its last 64 ids special): for the tests whose
    cost is the vocabulary (Triton's interpreter over the LM head, the sampler's noise over every column)."""
    raw = json.loads(json.dumps(synth.PRESETS["tiny"]))
    raw["text_config"].update(vocab_size=vocab, eos_token_id=vocab - 64)
    return raw


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """The tiny preset in the release layout (MTP experts per expert) and with the MTP experts fused, same seed;
    and the release layout with a small vocabulary."""
    root = tmp_path_factory.mktemp("mtp")
    out = {name: str(root / name) for name in ("per_expert", "fused", "small")}
    synth.write_checkpoint(out["per_expert"], "tiny", seed=7, tokenizer=False)
    synth.write_checkpoint(out["fused"], "tiny", seed=7, tokenizer=False, mtp_per_expert=False)
    synth.write_checkpoint(out["small"], small_vocab(), seed=7, tokenizer=False)
    return out


def build(cfg: ModelConfig, kernels: str = "torch", path: str | None = None, dtype=torch.float32,
          device: str = "cpu") -> Qwen35Model:
    """The model with its MTP head, loaded from `path` if given, with every cache allocated."""
    with backend.use_kernels(kernels):
        model = Qwen35Model(cfg, dtype=dtype, device=device)
        attach_mtp(model)
    if path is not None:
        load_checkpoint(model, path, device)
    for m in model.modules():
        if isinstance(m, GatedAttention):
            m.k_cache = torch.zeros(NUM_BLOCKS + 1, BLOCK, m.num_kv_heads, m.head_dim, dtype=dtype, device=device)
            m.v_cache = torch.zeros_like(m.k_cache)
        if isinstance(m, GatedDeltaNet):
            m.conv_state = torch.zeros(SLOTS, m.conv_dim, m.kernel - 1, dtype=dtype, device=device)
            m.ssm_state = torch.zeros(SLOTS, m.num_v_heads, m.dk, m.dv, device=device)
    return model.eval()


def table(seq: int, width: int = NUM_BLOCKS // SLOTS) -> list[int]:
    """Disjoint, non-contiguous KV blocks per sequence (up to SLOTS sequences of width * BLOCK tokens)."""
    return [1 + seq + SLOTS * j for j in range(width)]


def batch_of(rows: list[tuple[int, list[int], int]], device: str = "cpu") -> ForwardBatch:
    """A step of rows (sequence index = state slot, tokens, start position), as the runner builds one."""
    ids, pos, slots, cu = [], [], [], [0]
    for seq, toks, start in rows:
        t = table(seq)
        ids += toks
        pos += list(range(start, start + len(toks)))
        slots += [t[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + len(toks))]
        cu.append(cu[-1] + len(toks))
    starts = [r[2] for r in rows]
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    i64 = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    return ForwardBatch(
        input_ids=i64(ids), positions=i64(pos), slot_mapping=i64(slots),
        cu_seqlens=i32(cu), start_pos=i32(starts), context_lens=i32([s + len(t) for _, t, s in rows]),
        block_tables=i32([table(seq) for seq, _, _ in rows]), state_slots=i64([r[0] for r in rows]),
        logits_indices=i64(cu[1:]) - 1, seq_lens_cpu=[len(t) for _, t, _ in rows], start_pos_cpu=starts,
        state_slots_cpu=[r[0] for r in rows], is_decode=all(len(t) == 1 and s > 0 for _, t, s in rows))


def rand_ids(gen, n: int, high: int = 248000) -> list[int]:
    return torch.randint(0, high, (n,), generator=gen).tolist()


# ------------------------------------------------------------------------------------ the spec, written out
def rms1p(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def reference_mtp(sd: dict, cfg: ModelConfig, next_ids: torch.Tensor, hidden: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
    """Spec section 9 on one sequence from position 0 (causal over its rows), straight from the checkpoint's
    tensors `sd` (release names, experts fused): the post-`mtp.norm` hidden [T, H]."""
    g = lambda n: sd[f"mtp.{n}"]  # noqa: E731
    emb = sd["model.language_model.embed_tokens.weight"][next_ids]
    x = torch.cat([rms1p(emb, g("pre_fc_norm_embedding.weight")), rms1p(hidden, g("pre_fc_norm_hidden.weight"))], -1)
    x = x @ g("fc.weight").T
    T, nh, nkv, D, rd = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim
    a = rms1p(x, g("layers.0.input_layernorm.weight"))
    qg = (a @ g("layers.0.self_attn.q_proj.weight").T).view(T, nh, 2 * D)
    q, gate = qg[..., :D], qg[..., D:]
    q = rms1p(q, g("layers.0.self_attn.q_norm.weight"))
    k = rms1p((a @ g("layers.0.self_attn.k_proj.weight").T).view(T, nkv, D), g("layers.0.self_attn.k_norm.weight"))
    v = (a @ g("layers.0.self_attn.v_proj.weight").T).view(T, nkv, D)
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, rd, 2).float() / rd)
    ang = positions.float()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]

    def rope(t):
        r, rest = t[..., :rd], t[..., rd:]
        rot = torch.cat([-r[..., rd // 2:], r[..., :rd // 2]], -1)
        return torch.cat([r * cos + rot * sin, rest], -1)

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / D ** 0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hts,shd->thd", scores.softmax(-1), v) * torch.sigmoid(gate)
    x = x + o.reshape(T, nh * D) @ g("layers.0.self_attn.o_proj.weight").T
    m = rms1p(x, g("layers.0.post_attention_layernorm.weight"))
    probs = torch.softmax(m @ g("layers.0.mlp.gate.weight").T, -1)
    w, idx = probs.topk(cfg.num_experts_per_tok, -1)
    w = w / w.sum(-1, keepdim=True)
    gu, dn = g("layers.0.mlp.experts.gate_up_proj"), g("layers.0.mlp.experts.down_proj")
    I = cfg.moe_intermediate_size
    routed = torch.zeros_like(m)
    for t in range(T):
        for slot in range(idx.shape[1]):
            e = idx[t, slot]
            hgu = gu[e] @ m[t]
            routed[t] += w[t, slot] * (dn[e] @ (F.silu(hgu[:I]) * hgu[I:]))
    se = lambda n: g(f"layers.0.mlp.shared_expert.{n}.weight")  # noqa: E731
    shared = (F.silu(m @ se("gate_proj").T) * (m @ se("up_proj").T)) @ se("down_proj").T
    x = x + routed + torch.sigmoid(m @ g("layers.0.mlp.shared_expert_gate.weight").T) * shared
    return rms1p(x, g("norm.weight"))


def fused_state_dict(path: str) -> dict:
    from safetensors.torch import load_file
    sd = load_file(os.path.join(path, "model.safetensors"))
    assert "mtp.layers.0.mlp.experts.gate_up_proj" in sd
    return sd


# -------------------------------------------------------------------------------------------- config, loading
def test_config_reads_the_mtp_fields(ckpts):
    cfg = ModelConfig.from_dir(ckpts["per_expert"])
    assert cfg.mtp_num_hidden_layers == 1 and not cfg.mtp_use_dedicated_embeddings
    text = dict(synth.PRESETS["tiny"]["text_config"])
    del text["mtp_num_hidden_layers"]
    assert ModelConfig.from_dict(text).mtp_num_hidden_layers == 0  # a config without the field: no head
    with pytest.raises(ValueError, match="no MTP head|mtp_num_hidden_layers is 0"):
        attach_mtp(Qwen35Model(ModelConfig.from_dict(text)))
    text["mtp_num_hidden_layers"], text["mtp_use_dedicated_embeddings"] = 1, True
    with pytest.raises(ValueError, match="dedicated_embeddings"):
        attach_mtp(Qwen35Model(ModelConfig.from_dict(text)))


def test_both_layouts_load_the_same_head(ckpts):
    cfg = ModelConfig.from_dir(ckpts["per_expert"])
    a, b = build(cfg, path=ckpts["per_expert"]), build(cfg, path=ckpts["fused"])
    head = dict(a.mtp.named_parameters())
    assert len(head) > 10
    for name, p in b.mtp.named_parameters():
        assert torch.equal(p, head[name]), name
    sd = fused_state_dict(ckpts["fused"])
    assert torch.equal(a.mtp.fc.weight, sd["mtp.fc.weight"])
    assert torch.equal(a.mtp.layers[0].mlp.experts.gate_up_proj, sd["mtp.layers.0.mlp.experts.gate_up_proj"])
    assert torch.equal(a.mtp.attn.q_proj.weight, sd["mtp.layers.0.self_attn.q_proj.weight"])
    assert a.mtp.attn.k_cache is not None  # the head's attention takes a KV cache like a main attention layer
    # the main model is unchanged by the head (same tensors as without it)
    plain = Qwen35Model(cfg, dtype=torch.float32)
    load_checkpoint(plain, ckpts["per_expert"], "cpu")
    for name, p in plain.named_parameters():
        assert torch.equal(p, dict(a.named_parameters())[name]), name


def test_release_layout_and_dense_head(ckpts, tmp_path):
    """The tiny preset is written in the release layout (MTP experts per expert), --mtp-fused fuses them; a dense
    preset's head has a dense MLP, and loads and runs too."""
    from safetensors import safe_open
    with safe_open(os.path.join(ckpts["per_expert"], "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "mtp.layers.0.mlp.experts.7.down_proj.weight" in names and "mtp.fc.weight" in names
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in names  # (main layers fused, as released)
    assert "mtp.layers.0.mlp.experts.gate_up_proj" in fused_state_dict(ckpts["fused"])
    d = synth.write_checkpoint(str(tmp_path / "dense"), "tiny-dense", tokenizer=False)
    model = build(ModelConfig.from_dir(d), path=d)
    assert model.mtp.layers[0].mlp.gate_up.shape == (256, 64)
    gen = torch.Generator().manual_seed(9)
    batch = batch_of([(0, rand_ids(gen, 5), 0)])
    with torch.inference_mode():
        d = propose(model, batch, model(batch), torch.tensor([3]), torch.tensor([4]), 2)
    assert d.tokens.shape == (1, 2)


def test_a_checkpoint_without_the_head_is_a_clear_error(ckpts, tmp_path):
    from safetensors.torch import load_file, save_file
    d = tmp_path / "no_mtp"
    shutil.copytree(ckpts["per_expert"], d)
    tensors = {k: v for k, v in load_file(str(d / "model.safetensors")).items() if not k.startswith("mtp.")}
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks tensors for: mtp\..*no MTP head"):
        build(ModelConfig.from_dir(str(d)), path=str(d))
    load_checkpoint(Qwen35Model(ModelConfig.from_dir(str(d))), str(d), "cpu")  # without a head: fine


def test_dummy_loader_makes_a_head(ckpts):
    from qwen35.engine_config import EngineArgs
    from qwen35.runner import ModelRunner
    args = dict(model="", device="cpu", dtype="float32", max_num_seqs=2, max_model_len=64)
    runner = ModelRunner(ModelConfig.from_dir(ckpts["per_expert"]), EngineArgs(load_format="dummy", mtp=True, **args))
    mtp = runner.model.mtp
    assert mtp.attn in runner.attn_layers and mtp.attn.k_cache is not None  # one more layer's KV cache
    for norm in (mtp.norm, mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.layers[0].input_layernorm):
        assert (norm.weight == 0).all()  # zero-centred norms: the identity, as HF initialises them
    for p in (mtp.fc.weight, mtp.layers[0].mlp.experts.down_proj, mtp.attn.q_proj.weight):
        assert abs(p.std().item() - synth.INIT_STD) < 0.1 * synth.INIT_STD
    # --load-format dummy-spec: the same, then made into the synthetic-acceptance weights
    spec = ModelRunner(ModelConfig.from_dict(small_vocab()),
                       EngineArgs(load_format="dummy-spec", spec_acceptance=0.7, **args)).model  # (implies mtp)
    H = spec.config.hidden_size
    assert torch.equal(spec.mtp.fc.weight[:, :H], torch.eye(H)) and (spec.mtp.norm.weight > 0).all()
    with pytest.raises(ValueError, match="dummy-spec"):
        ModelRunner(spec.config, EngineArgs(load_format="random", **args))


# ------------------------------------------------------------------------------------ forward and drafting
@pytest.mark.parametrize("kernels", ["torch", "fast"])
def test_forward_matches_the_spec(ckpts, kernels):
    """The head over a packed step of two sequences (one from 0, one continuing at 21 over its cached entries)
    against the spec written out on each whole sequence."""
    cfg = ModelConfig.from_dir(ckpts["fused"])
    model, sd = build(cfg, kernels, ckpts["fused"]), fused_state_dict(ckpts["fused"])
    gen = torch.Generator().manual_seed(1)
    lens = (33, 26)
    ids = [torch.tensor(rand_ids(gen, n)) for n in lens]  # the head's input tokens (each row's next token)
    hid = [torch.randn(n, cfg.hidden_size, generator=gen) for n in lens]

    def run(rows):  # rows: (sequence, first row, end row)
        b = batch_of([(s, ids[s][a:e].tolist(), a) for s, a, e in rows])
        return model.mtp(model.embed_tokens(b.input_ids), torch.cat([hid[s][a:e] for s, a, e in rows]), b)

    with torch.inference_mode():
        run([(1, 0, 21)])
        out = run([(0, 0, lens[0]), (1, 21, lens[1])])
    ref0 = reference_mtp(sd, cfg, ids[0], hid[0], torch.arange(lens[0]))
    ref1 = reference_mtp(sd, cfg, ids[1], hid[1], torch.arange(lens[1]))
    assert ref0.abs().max() > 0.5
    assert (out[:lens[0]] - ref0).abs().max().item() <= TOL
    assert (out[lens[0]:] - ref1[21:]).abs().max().item() <= TOL


def test_drafts_follow_the_spec_alignment(ckpts):
    """propose after a prefill step of two prompts: the catch-up pass (each prompt's tokens shifted left, the newest
    token last, the target's hidden), then drafts 2..k from the head's own hidden at the next positions, through
    its paged cache. Against the spec run once over the whole input sequence: [shifted prompt, newest, draft 1,
    ...] with hidden [target's, head's own outputs]. A verify-like step (last accepted row before the end) too."""
    cfg = ModelConfig.from_dir(ckpts["fused"])
    model, sd = build(cfg, path=ckpts["fused"]), fused_state_dict(ckpts["fused"])
    gen = torch.Generator().manual_seed(2)
    prompts = [rand_ids(gen, 19), rand_ids(gen, 7)]
    k = 3
    batch = batch_of([(0, prompts[0], 0), (1, prompts[1], 0)])
    with torch.inference_mode():
        hidden = model(batch)
        newest = torch.tensor(rand_ids(gen, 2))
        last = batch.cu_seqlens[1:].long() - 1
        drafts = propose(model, batch, hidden, newest, last, k)
        mtp_h = catch_up(model, batch_of([(2, prompts[0], 0), (3, prompts[1], 0)]), hidden, newest, last)
    assert drafts.tokens.shape == (2, k) and drafts.logits is None and drafts.lse is None
    for s, p in enumerate(prompts):
        rows = slice(int(batch.cu_seqlens[s]), int(batch.cu_seqlens[s + 1]))
        ids, h, toks = torch.tensor(p[1:] + [int(newest[s])]), hidden[rows], []
        for j in range(k):
            out = reference_mtp(sd, cfg, ids, h, torch.arange(len(ids)))
            if j == 0:
                assert (out[-1] - mtp_h[s]).abs().max().item() <= TOL
            logits = out[-1] @ sd["lm_head.weight"].T
            toks.append(int(logits.argmax()))
            ids, h = torch.cat([ids, torch.tensor(toks[-1:])]), torch.cat([h, out[-1:]])
        assert drafts.tokens[s].tolist() == toks, s
    # a verify-like step: sequence 0 continues with 4 rows of which 2 are accepted (last accepted row: its third)
    cont = rand_ids(gen, 4)
    step = batch_of([(0, cont, 19)])
    with torch.inference_mode():
        h2 = model(step)
        d2 = propose(model, step, h2, torch.tensor([5]), torch.tensor([2]), 2)
    ids = torch.tensor(prompts[0][1:] + [int(newest[0])] + cont[1:3] + [5])
    h = torch.cat([hidden[:19], h2[:3]])
    out = reference_mtp(sd, cfg, ids, h, torch.arange(len(ids)))
    assert int((out[-1] @ sd["lm_head.weight"].T).argmax()) == int(d2.tokens[0, 0])


def test_sampled_drafts_return_their_distribution(ckpts):
    cfg = ModelConfig.from_dir(ckpts["fused"])
    model = build(cfg, path=ckpts["fused"])
    gen = torch.Generator().manual_seed(3)
    batch = batch_of([(0, rand_ids(gen, 9), 0)])
    sampling = SampleBatch(torch.tensor([0.8]), torch.tensor([20.0]), torch.tensor([0.95]), torch.tensor([42]),
                           torch.tensor([9]), None, False, True, True)
    with torch.inference_mode():
        hidden = model(batch)
        d = propose(model, batch, hidden, torch.tensor([17]), torch.tensor([8]), 2, sampling)
    # q = exp(x - lse), x the filtered logits / temperature: a distribution over the row's top-k / top-p set
    assert d.logits.shape == (1, 2, cfg.vocab_size) and d.lse.shape == (1, 2)
    q = torch.exp(filtered_logits(d.logits[0], at_positions(sampling, 2)) - d.lse[0, :, None])[None]
    assert torch.allclose(q.sum(-1), torch.ones(1, 2)) and (q > 0).sum(-1).max() <= 20
    assert (q.gather(2, d.tokens[..., None]) > 0).all()


# ------------------------------------------------------------------------------------------------ TP=2
@torch.inference_mode()
def _drafting_run(path, kernels):
    """Prefill two prompts, draft 3 tokens each (greedy, then sampled): the head's hidden, drafts and q."""
    cfg = ModelConfig.from_dir(path)
    model = build(cfg, kernels, path)
    gen = torch.Generator().manual_seed(4)
    batch = batch_of([(0, rand_ids(gen, 21, SMALL_VOCAB - 64), 0), (1, rand_ids(gen, 5, SMALL_VOCAB - 64), 0)])
    hidden = model(batch)
    newest, last = torch.tensor([11, 12]), batch.cu_seqlens[1:].long() - 1
    greedy = propose(model, batch, hidden, newest, last, 3)
    mtp_h = catch_up(model, batch, hidden, newest, last)
    sampling = SampleBatch(torch.tensor([1.0, 0.7]), torch.tensor([0.0, 5.0]), torch.tensor([1.0, 0.9]),
                           torch.tensor([1, 2]), torch.tensor([0, 0]), None, False, True, True)
    sampled = propose(model, batch, hidden, newest, last, 3, sampling)
    return mtp_h, greedy.tokens, sampled.tokens, sampled.lse


def test_tensor_parallel_2_equals_1(ckpts, tmp_path):
    """(The fast kernels' TP=2 paths are the layers', which tests/test_model.py runs; the head's fast kernels at
    TP=1: test_forward_matches_the_spec.)"""
    single = _drafting_run(ckpts["small"], "torch")
    tp2 = run_ranks(2, functools.partial(_drafting_run, ckpts["small"], "torch"), str(tmp_path / "tp2.pt"))
    assert (single[0] - tp2[0]).abs().max().item() <= TOL
    assert torch.equal(single[1], tp2[1]) and torch.equal(single[2], tp2[2])
    assert (single[3] - tp2[3]).abs().max().item() <= TOL


# ------------------------------------------------------------------------------------ synthetic acceptance
def spec_weights_model(acceptance: float, vocab: int | None = None):
    """The tiny model (with a `vocab`-token vocabulary, its last 64 ids special, if given) with dummy weights made
    into the synthetic-acceptance ones; and the successor cycle of its regular tokens."""
    from qwen35.runner import init_dummy_weights
    cfg = ModelConfig.from_dict(synth.PRESETS["tiny"] if vocab is None else small_vocab(vocab))
    model = build(cfg)
    init_dummy_weights(model, seed=0)
    init_spec_weights(model, acceptance, seed=0)
    return model, successor_cycle(regular_tokens(cfg), 0)


def test_synthetic_target_and_drafts_follow_the_permutation():
    model, succ = spec_weights_model(0.6)
    assert len(succ) == 248044  # the tiny preset's regular ids: below <|endoftext|>
    gen = torch.Generator().manual_seed(5)
    prompts = [rand_ids(gen, n, len(succ)) for n in (13, 4, 30)]
    batch = batch_of([(i, p, 0) for i, p in enumerate(prompts)])
    with torch.inference_mode():
        hidden = model(batch)
        greedy = model.compute_logits(hidden).argmax(-1)
        assert torch.equal(greedy, succ[batch.input_ids])  # every position predicts its token's successor
        last = batch.cu_seqlens[1:].long() - 1
        newest = greedy[last]
        drafts = propose(model, batch, hidden, newest, last, 3)
    expected = torch.stack([succ[newest], succ[succ[newest]], succ[succ[succ[newest]]]], 1)
    assert torch.equal(drafts.tokens, expected)
    assert model.mtp.fc.weight[:, model.config.hidden_size:].abs().max() < LAYER_SCALE  # the hidden half: small


@pytest.mark.parametrize("requested", [0.6, 0.85])
def test_synthetic_acceptance_at_temperature_1(requested):
    """Sequences sampled from the target at temperature 1 (sample_torch), then at every position the target's
    distribution for the token after next, a draft drawn from the head's distribution for it (draft_sample) and
    verify_sampled with that one draft: the acceptance rate is the requested one within ACCEPTANCE_TOL (1856
    draws: 4 standard errors), and sum(min(p, q)) over the visited contexts within half of it. The tiny model
    with a SMALL_VOCAB-token vocabulary: the sampler's noise over the preset's 248k columns costs seconds per row batch
    on the CPU (the construction does not depend on the vocabulary's size)."""
    model, succ = spec_weights_model(requested, vocab=SMALL_VOCAB)
    V = model.config.vocab_size
    n_seq, prompt, steps = 64, 3, 30
    gen = torch.Generator().manual_seed(6)
    seqs = [rand_ids(gen, prompt, len(succ)) for _ in range(n_seq)]

    def params(counter):
        n = len(counter)
        return SampleBatch(torch.ones(n), torch.zeros(n), torch.ones(n), torch.arange(n) * 31 + 7,
                           torch.tensor(counter), None, False, False, False)

    with torch.inference_mode():
        b = batch_of([(i, s, 0) for i, s in enumerate(seqs)])
        logits = model.compute_logits(model(b)[b.logits_indices])
        for step in range(steps):
            tok = sample_torch(logits, params([step] * n_seq), V, V)
            for s, t in zip(seqs, tok.tolist()):
                s.append(t)
            b = batch_of([(i, [s[-1]], len(s) - 1) for i, s in enumerate(seqs)])
            logits = model.compute_logits(model(b))
        # teacher-forced: the target at every position, the head's first draft at every position
        b = batch_of([(i, s, 0) for i, s in enumerate(seqs)])
        hidden = model(b)
        target = model.compute_logits(hidden)
        draft = model.compute_logits(model.mtp(model.embed_tokens(torch.roll(b.input_ids, -1)), hidden, b))
    L = prompt + steps
    rows = torch.tensor([i * L + p for i in range(n_seq) for p in range(prompt - 1, L - 2)])
    n = len(rows)
    sampling = dataclasses.replace(params(list(range(n))), key=torch.full((n,), 1234))
    d, q = draft_sample(draft[rows], sampling)
    out = verify_sampled(target[rows + 1, None].expand(n, 2, V), d[:, None], q[:, None], sampling)
    measured = (out.num_emitted == 2).double().mean().item()
    expected = torch.minimum(torch.softmax(target[rows + 1], -1), q).sum(-1).mean().item()
    assert abs(measured - requested) <= ACCEPTANCE_TOL, (measured, expected)
    assert abs(expected - requested) <= ACCEPTANCE_TOL / 2, expected


@pytest.mark.gpu
def test_synthetic_weights_on_the_gpu_in_bf16():
    """The fast kernels in bf16 on CUDA: greedy still walks the cycle and the drafts run two ahead."""
    from qwen35.runner import init_dummy_weights
    cfg = ModelConfig.from_dict(synth.PRESETS["tiny"])
    model = build(cfg, "fast", dtype=torch.bfloat16, device="cuda")
    init_dummy_weights(model, seed=0)
    init_spec_weights(model, 0.6, seed=0)
    succ = successor_cycle(regular_tokens(cfg), 0).cuda()
    gen = torch.Generator().manual_seed(5)
    batch = batch_of([(i, rand_ids(gen, n, len(succ)), 0) for i, n in enumerate((13, 1, 30))], device="cuda")
    with torch.inference_mode():
        hidden = model(batch)
        greedy = model.compute_logits(hidden).argmax(-1)
        assert torch.equal(greedy, succ[batch.input_ids])
        last = batch.cu_seqlens[1:].long() - 1
        newest = greedy[last]
        drafts = propose(model, batch, hidden, newest, last, 3)
    assert torch.equal(drafts.tokens, torch.stack([succ[newest], succ[succ[newest]], succ[succ[succ[newest]]]], 1))
