"""The fast kernels with the LLaMA-likes' options (layers/norm.py plain RMSNorm; layers/attention.py without the
output gate, with no / plain / zero-centred q/k norm, full rotary dims, q/k/v and o biases) against their torch
oracles, at head dims that are not powers of two (24, 80, 96) beside the usual ones.

CPU (fp32, tiny shapes, Triton through the interpreter): max |diff| <= 1e-5 (the residual sum exact, V rows
bit-exact), the same tolerances as tests/test_kernels_attention.py and tests/test_kernels_norm.py for Qwen3.5.
GPU (`-m gpu`, bf16, Llama-3.2-1B / Qwen3-like shapes: 32 q / 8 KV heads of 64 at TP=1, 4 / 1 at TP=8; 16 / 4
of 128 with q/k norm; the decode kernel also at head dims 64-256, GQA 1, 4, 8): plain norm within one bf16 ulp
(>= 99% bit-equal); norm + RoPE + cache >= 99% bit-equal and <= 0.05 max abs; ungated decode relative L2 <= 1e-2
at every split count; the whole Llama model, CUDA graph replay vs eager over a changing decode batch (fp32 <= 1e-3,
bf16 <= 3e-2, as tests/test_fast_paths.py argues).
"""
import math
from types import SimpleNamespace

import pytest
import torch

from layers import attention as A
from layers.backend import triton
from layers.norm import add_rms_norm_fast, add_rms_norm_torch, rms_norm_fast, rms_norm_torch
from layers.rotary import RotaryEmbedding
from tests.compare import max_diff, rel
from tests.test_kernels_attention import build_layer, decode_batch, decode_inputs, norm_rope_case

pytestmark = pytest.mark.skipif(triton is None, reason="needs triton")
TOL = 1e-5


# ------------------------------------------------------------------------------------------------ plain norm
@pytest.mark.parametrize("rows,n", [(1, 64), (5, 48), (3, 2048)])
def test_plain_rms_norm_fast_equals_torch(rows, n):
    gen = torch.Generator().manual_seed(n)
    x, r = torch.randn(rows, n, generator=gen), torch.randn(rows, n, generator=gen)
    w = 1 + torch.randn(n, generator=gen) * 0.2
    y0, s0 = add_rms_norm_torch(x, r, w, 1e-5, plain=True)
    y1, s1 = add_rms_norm_fast(x, r, w, 1e-5, plain=True)
    assert torch.equal(s0, s1)
    assert max_diff(y0, y1) <= TOL
    assert max_diff(rms_norm_torch(x, w, 1e-5, plain=True), rms_norm_fast(x, w, 1e-5, plain=True)) <= TOL
    # the plain norm is x / rms(x) * w: not the zero-centred one
    assert max_diff(rms_norm_torch(x, w, 1e-5, plain=True), rms_norm_torch(x, w - 1, 1e-5)) <= TOL
    assert max_diff(rms_norm_torch(x, w, 1e-5, plain=True), rms_norm_torch(x, w, 1e-5)) > 0.1


# ------------------------------------------------------------------------------ q/k (norm) + RoPE + cache write
def ungated_case(H, KV, D, RD, T, gen, **kw):
    """norm_rope_case's inputs with the fused projection laid out without gate rows: [T, H*D + 2*KV*D]."""
    qkv, pos, slots, qw, kw_, cos, sin, cache = norm_rope_case(H, KV, D, RD, T, gen, **kw)
    q = qkv[:, : H * 2 * D].view(T, H, 2 * D)[..., :D].reshape(T, H * D)
    return torch.cat([q, qkv[:, H * 2 * D:]], 1).contiguous(), pos, slots, qw, kw_, cos, sin, cache


NORMS = {"none": (False, False), "plain": (True, True), "zero-centred": (True, False)}


@pytest.mark.parametrize("H,KV,D,RD", [(5, 1, 16, 16), (6, 2, 8, 8), (4, 1, 24, 24), (3, 3, 32, 8), (4, 1, 80, 80),
                                       (8, 1, 96, 96)])
@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("T", [1, 7])
def test_ungated_norm_rope_cache_fast_equals_torch(H, KV, D, RD, norm, T):
    """Llama/Qwen2 (no q/k norm), Qwen3 (plain q/k norm) and an ungated zero-centred case; full rotary dims,
    a head_dim that is not a power of two, MHA, and a partial rotary once more."""
    has_norm, plain = NORMS[norm]
    gen = torch.Generator().manual_seed(H * 100 + D + T)
    qkv, pos, slots, qw, kw, cos, sin, cache = ungated_case(H, KV, D, RD, T, gen)
    if not has_norm:
        qw = kw = None
    elif plain:
        qw, kw = qw + 1, kw + 1
    caches = [(cache.clone(), -cache.clone()) for _ in range(2)]
    q_ref = A.qk_norm_rope_cache_torch(qkv, pos, slots, qw, kw, cos, sin, *caches[0], 1e-6, False, plain)
    q_fast = A.qk_norm_rope_cache_fast(qkv, pos, slots, qw, kw, cos, sin, *caches[1], 1e-6, False, plain)
    assert q_fast.shape == q_ref.shape == (T, H, D)
    assert max_diff(q_fast, q_ref) <= TOL and max_diff(caches[1][0], caches[0][0]) <= TOL
    assert torch.equal(caches[1][1], caches[0][1])
    # the oracle reads the ungated layout: q is the rotated head, V the last rows
    q_raw = qkv[:, : H * D].view(T, H, D)
    if not has_norm:
        assert torch.equal(q_ref[..., RD:], q_raw[..., RD:])
        assert max_diff(q_ref.norm(dim=-1), q_raw.norm(dim=-1)) <= 1e-4  # a rotation keeps the norm
    v_rows = qkv[:, H * D + KV * D:].view(T, KV, D)
    assert torch.equal(caches[0][1].view(-1, KV, D)[slots], v_rows)


# -------------------------------------------------------------------------------------- ungated decode
@pytest.mark.parametrize("heads,kv,D,block_size", [(5, 1, 16, 4), (6, 2, 8, 8), (3, 3, 24, 4), (4, 1, 80, 4),
                                                    (8, 1, 96, 8)])
@pytest.mark.parametrize("lens", [[37], [3, 40, 1, 17, 8]])
def test_ungated_decode_fast_equals_torch(heads, kv, D, block_size, lens):
    gen = torch.Generator().manual_seed(heads * 7 + len(lens))
    width = math.ceil(max(lens) / block_size) + 2
    q, kc, vc, tables, ctx, _ = decode_inputs(heads, kv, D, block_size, lens, width, 48, gen)
    ref = A.paged_decode_attention_torch(q, kc, vc, tables, ctx, D ** -0.5, None)
    batch = decode_batch(lens, tables, block_size)
    assert max_diff(ref, A.paged_prefill_attention_torch(q, kc, vc, batch, D ** -0.5, None)) <= TOL
    for splits, min_tiles in [(1, 1), (2, 1), (3, 2), (7, 1)]:
        out = A.paged_decode_launch(q, kc, vc, tables, ctx, D ** -0.5, None, splits, tile=16, min_tiles=min_tiles)
        assert max_diff(out, ref) <= TOL, (splits, min_tiles)


# ----------------------------------------------------------------------------------------------------- layer
def llama_cfg(H=6, KV=2, D=16, qk_norm=False, bias=True):
    return SimpleNamespace(num_attention_heads=H, num_key_value_heads=KV, head_dim=D, hidden_size=48,
                           rms_norm_eps=1e-6, attn_output_gate=False, qk_norm=qk_norm, zero_centred_norms=False,
                           qkv_bias=bias, o_bias=bias)


@pytest.mark.parametrize("rank,tp", [(0, 1), (1, 2), (2, 3)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_llama_layer_fast_equals_torch(rank, tp, qk_norm, monkeypatch):
    """The layer with every LLaMA-like option, at TP=1, 2 and 3 (rank 2 of 3 holds 2 q heads and a replicated KV
    head of 2); an ungated prefill, then an ungated decode step. The o bias is added by rank 0 only."""
    cfg, bs, n_blocks = llama_cfg(qk_norm=qk_norm), 4, 16
    rot = RotaryEmbedding(cfg.head_dim, 1e4, 128)
    layers = [build_layer(k, cfg, rank, tp, rot, n_blocks, bs, monkeypatch) for k in ("torch", "fast")]
    layers[1].k_cache, layers[1].v_cache = layers[0].k_cache.clone(), layers[0].v_cache.clone()
    assert layers[0].qkv_bias is not None and layers[0].o_proj.adds_bias == (rank == 0)
    assert layers[0].qkv_weight.shape[0] == (layers[0].num_heads + 2 * layers[0].num_kv_heads) * cfg.head_dim
    gen = torch.Generator().manual_seed(rank)
    tables = torch.tensor([[3, 7, 1, 9, 0], [2, 5, 11, 4, 0]], dtype=torch.int32)
    lens = [6, 14]
    dec = decode_batch(lens, tables, bs)
    x = torch.randn(2, cfg.hidden_size, generator=gen)
    outs = [m(x, dec) for m in layers]
    assert outs[0].abs().max() > 0.1 and max_diff(outs[1], outs[0]) <= TOL
    import dataclasses
    outs = [m(x, dataclasses.replace(dec, is_decode=False)) for m in layers]  # the prefill path on one token each
    assert max_diff(outs[1], outs[0]) <= TOL


# ------------------------------------------------------------------------------------------------------- GPU
LLAMA_1B = {1: (32, 8), 8: (4, 1)}  # TP degree -> local (q heads, KV heads); head_dim 64


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64, 8192])
def test_gpu_plain_rms_norm_bf16(rows):
    gen = torch.Generator().manual_seed(rows)
    x, r = (torch.randn(rows, 2048, generator=gen).bfloat16().cuda() for _ in range(2))
    w = (1 + torch.randn(2048, generator=gen) * 0.2).bfloat16().cuda()
    y0, s0 = add_rms_norm_torch(x, r, w, 1e-5, plain=True)
    y1, s1 = add_rms_norm_fast(x, r, w, 1e-5, plain=True)
    assert torch.equal(s0, s1)
    assert max_diff(y0, y1) <= 2 ** -7 * 8
    assert (y0 == y1).float().mean().item() >= 0.99


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(32, 8, 64, False), (4, 1, 64, False), (16, 4, 128, True)])
@pytest.mark.parametrize("T", [1, 64, 1000])
def test_gpu_ungated_norm_rope_cache_bf16(shape, T):
    H, KV, D, plain = shape
    gen = torch.Generator().manual_seed(T + H)
    qkv, pos, slots, qw, kw, cos, sin, cache = ungated_case(H, KV, D, D, T, gen, dtype=torch.bfloat16,
                                                            device="cuda", n_blocks=200, block_size=16,
                                                            max_pos=32768)
    qw, kw = (qw + 1, kw + 1) if plain else (None, None)
    caches = [(cache.clone(), -cache.clone()) for _ in range(2)]
    q_ref = A.qk_norm_rope_cache_torch(qkv, pos, slots, qw, kw, cos, sin, *caches[0], 1e-6, False, plain)
    q_fast = A.qk_norm_rope_cache_fast(qkv, pos, slots, qw, kw, cos, sin, *caches[1], 1e-6, False, plain)
    k_fast, k_ref = (c[0].view(-1, KV, D)[slots] for c in (caches[1], caches[0]))
    for fast, ref in ((q_fast, q_ref), (k_fast, k_ref)):
        assert max_diff(fast, ref) <= 0.05
        assert (fast == ref).float().mean().item() >= 0.99
    assert torch.equal(caches[1][1], caches[0][1])


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 8])
@pytest.mark.parametrize("lens", [[8192], [8192, 1], [1, 15, 16, 17, 300, 1024, 33], [1024] * 64])
def test_gpu_ungated_decode_attention_bf16(tp, lens):
    heads, kv = LLAMA_1B[tp]
    gen = torch.Generator().manual_seed(len(lens) + tp)
    width = math.ceil(max(lens) / 16)
    q, kc, vc, tables, ctx, _ = decode_inputs(heads, kv, 64, 16, lens, width, max(width, 2 * len(lens) + 8) + 1,
                                              gen, torch.bfloat16, "cuda")
    ref = A.paged_decode_attention_torch(q, kc, vc, tables, ctx, 64 ** -0.5, None)
    assert rel(A.paged_decode_attention_fast(q, kc, vc, tables, ctx, 64 ** -0.5, None), ref) <= 1e-2
    for splits in (1, 5, 64):
        assert rel(A.paged_decode_launch(q, kc, vc, tables, ctx, 64 ** -0.5, None, splits), ref) <= 1e-2


# issue #29's head dims and GQA ratios (tests/test_llama.py UNSEEN runs them in whole models): (q heads, KV heads, D)
HEAD_DIMS = [(8, 8, 64), (16, 4, 80), (32, 4, 96), (24, 8, 128), (16, 2, 256), (8, 8, 256)]


@pytest.mark.gpu
@pytest.mark.parametrize("heads,kv,D", HEAD_DIMS)
def test_gpu_decode_attention_every_head_dim_bf16(heads, kv, D):
    """The ungated decode kernel at each head dim (80 and 96: not powers of two, masked tiles) and GQA ratio 1, 4, 8,
    at every split count, against the torch oracle (relative L2 <= 1e-2, as above)."""
    lens = [1, 15, 16, 17, 300, 1024, 33, 2048]
    gen = torch.Generator().manual_seed(D + heads)
    width = math.ceil(max(lens) / 16)
    q, kc, vc, tables, ctx, _ = decode_inputs(heads, kv, D, 16, lens, width, width * len(lens) + 1, gen,
                                              torch.bfloat16, "cuda")
    ref = A.paged_decode_attention_torch(q, kc, vc, tables, ctx, D ** -0.5, None)
    assert rel(A.paged_decode_attention_fast(q, kc, vc, tables, ctx, D ** -0.5, None), ref) <= 1e-2
    for splits in (1, 5, 64):
        assert rel(A.paged_decode_launch(q, kc, vc, tables, ctx, D ** -0.5, None, splits), ref) <= 1e-2


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A small Llama (GQA, biases, llama3 RoPE) as transformers saves it; vocab >= 1024 for decode_schedule."""
    from tests.test_llama import build_hf
    kw = dict(vocab_size=1030, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, attention_bias=True, max_position_embeddings=512,
              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 64})
    path = str(tmp_path_factory.mktemp("llama-graphs"))
    build_hf("llama", kw, seed=4).save_pretrained(path)
    return path


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-3), ("bfloat16", 3e-2)])
def test_gpu_llama_cuda_graph_decode_equals_eager(llama_dir, dtype, tol):
    from tests.test_fast_paths import graph_vs_eager
    assert graph_vs_eager(llama_dir, dtype) <= tol
