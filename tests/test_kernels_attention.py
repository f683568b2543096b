"""Gated attention ops (layers/attention.py, layers/rotary.py): the Triton ops against their torch oracles, the oracles
against independent references, and the layer with each kernel set.

CPU (fp32, tiny shapes, Triton through the interpreter; TP-local odd shapes, padded rows on the scratch block,
several batch sizes and split counts):
- q/k norm + RoPE + cache write: fast == torch to 1e-5 max abs on O(1) values (only rsqrt and the sum order differ,
  ~1e-7); V rows copied bit-exact; cache slots outside slot_mapping untouched. apply_rope == the spec §4.1 formula to
  1e-6.
- decode attention: fast == torch to 1e-5 for every split count (1, several, more than the context has tiles, so
  empty splits occur), torch batched == the per-sequence prefill oracle to 1e-5 (table columns past each context hold
  valid random blocks: only context_lens may hide them).
- prefill attention (varlen flash over the paged cache): fast == the per-sequence SDPA oracle to 1e-5 on a pack of
  lengths 1, 63, 64, 65, 200 with prefix-hit / chunk rows (start_pos > 0), GQA ratios 1, 2, 4, gated and ungated,
  several query/key tile shapes and page sizes; a mixed step's rows equal each sequence alone and the decode rows
  the decode oracle; keys past a query's position never change its output.
- layer: GatedAttention built with "fast" == built with "torch" to 1e-5 on outputs and caches (prefill, mixed and
  decode steps).
GPU (`-m gpu`, real Qwen3.5-35B-A3B shapes: 16 q / 2 KV heads at TP=1, 2 q / 1 KV at TP=8, head_dim 256, rotary 64,
block 16; bf16):
- norm + RoPE + cache: >= 99% of elements bit-equal to torch and max abs diff <= 0.05 on O(1..5) values (a rounding
  flip of the bf16 norm output moves a product by an ulp or two); V bit-exact.
- decode attention: relative L2 error <= 1e-2 against the fp32-softmax torch oracle (bf16 P for the PV dot gives
  ~3e-3), contexts up to 32K at batch 1-2 and 1K at batch 64; it also replays inside a CUDA graph with new tables and
  context lengths (no host sync, no data-dependent launch).
- prefill attention: relative L2 <= 1e-2 against the SDPA oracle (both round P to bf16), <= 2e-2 per sequence, on
  a pack of lengths 1..1024 with prefix-hit rows, gated and not; a mixed step of 64 decode rows and a chunk in one
  launch against the decode and SDPA oracles.
- layer: fast vs torch relative L2 <= 2e-2 on the layer output (the GEMMs are shared; the rest as above), decode
  and mixed steps.
"""
import math
from types import SimpleNamespace

import pytest
import torch

from dist import parallel
from layers import attention as A
from layers import backend
from layers.backend import triton
from layers.forward_batch import ForwardBatch
from layers.rotary import RotaryEmbedding, apply_rope
from tests.compare import max_diff, rel

pytestmark = pytest.mark.skipif(triton is None, reason="needs triton")
TOL = 1e-5


def decode_inputs(heads, kv, D, block_size, lens, width, n_blocks, gen, dtype=torch.float32, device="cpu"):
    """Random caches, q, a strided gate view (as split_qkv gives it) and shuffled tables whose columns past each
    context are valid random blocks."""
    k_cache = torch.randn(n_blocks, block_size, kv, D, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(n_blocks, block_size, kv, D, generator=gen).to(dtype).to(device)
    q = torch.randn(len(lens), heads, D, generator=gen).to(dtype).to(device)
    gate = torch.randn(len(lens), heads, 2 * D, generator=gen).to(dtype).to(device)[..., D:]
    tables = torch.stack([torch.randperm(n_blocks, generator=gen)[:width] for _ in lens]).int().to(device)
    lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, tables, lens, gate


def decode_batch(context_lens, tables, block_size) -> ForwardBatch:
    """A pure-decode batch as ModelRunner.prepare builds it: sequence i feeds one token at context_lens[i] - 1."""
    B = len(context_lens)
    lens = torch.tensor(context_lens)
    pos = lens - 1
    tables = tables.cpu()
    return ForwardBatch(
        input_ids=torch.zeros(B, dtype=torch.int64), positions=pos,
        slot_mapping=tables[torch.arange(B), pos // block_size].long() * block_size + pos % block_size,
        cu_seqlens=torch.arange(B + 1, dtype=torch.int32), start_pos=pos.int(), context_lens=lens.int(),
        block_tables=tables.int(), state_slots=torch.arange(B), logits_indices=torch.arange(B),
        seq_lens_cpu=[1] * B, start_pos_cpu=pos.tolist(), state_slots_cpu=list(range(B)), is_decode=True)


# ------------------------------------------------------------------------------------------------------- RoPE
def test_apply_rope_is_the_spec_formula():
    """x'[i] = x[i] cos_i - x[i+h] sin_i, x'[i+h] = x[i+h] cos_i + x[i] sin_i for i < h = rotary_dim / 2; the rest
    passes through; theta_i = pos / base^(2i / rotary_dim)."""
    gen = torch.Generator().manual_seed(0)
    rd, D, base = 8, 20, 1e4
    rot = RotaryEmbedding(rd, base, 64)
    x = torch.randn(5, 3, D, generator=gen, dtype=torch.float64).float()
    pos = torch.tensor([0, 1, 7, 33, 63])
    out = apply_rope(x, pos, rot.cos, rot.sin)
    h = rd // 2
    theta = pos[:, None].double() / base ** (torch.arange(h).double() * 2 / rd)
    c, s = theta.cos()[:, None, :], theta.sin()[:, None, :]
    x64 = x.double()
    want = x64.clone()
    want[..., :h] = x64[..., :h] * c - x64[..., h:rd] * s
    want[..., h:rd] = x64[..., h:rd] * c + x64[..., :h] * s
    assert max_diff(out, want) <= 1e-6
    assert torch.equal(out[..., rd:], x[..., rd:])


# --------------------------------------------------------------------------- q/k norm + RoPE + KV-cache write
def norm_rope_case(H, KV, D, RD, T, gen, dtype=torch.float32, device="cpu", n_blocks=9, block_size=4,
                   max_pos=512):
    qkv = torch.randn(T, H * 2 * D + 2 * KV * D, generator=gen).to(dtype).to(device)
    positions = torch.randint(1, max_pos, (T,), generator=gen)
    positions[1:2] = 0  # position 0 (no rotation) among others
    slots = torch.randperm(n_blocks * block_size, generator=gen)[:T].to(device)
    qw = (torch.randn(D, generator=gen) * 0.3).to(dtype).to(device)
    kw = (torch.randn(D, generator=gen) * 0.3).to(dtype).to(device)
    rot = RotaryEmbedding(RD, 1e7, max_pos, device=device)
    cache = torch.randn(n_blocks, block_size, KV, D, generator=gen).to(dtype).to(device)
    return qkv, positions.to(device), slots, qw, kw, rot.cos, rot.sin, cache


@pytest.mark.parametrize("H,KV,D,RD", [(4, 2, 32, 8), (2, 1, 32, 8), (3, 1, 24, 6), (2, 2, 16, 16)])
@pytest.mark.parametrize("T", [1, 5, 12])
def test_norm_rope_cache_fast_equals_torch(H, KV, D, RD, T):
    """The tiny model's heads, a TP=8-like rank (2 q heads, 1 KV head), an odd head count with a head_dim that is not
    a power of two and an odd half-rotary size, and a fully rotated head."""
    gen = torch.Generator().manual_seed(H * 1000 + D * 10 + T)
    qkv, pos, slots, qw, kw, cos, sin, cache = norm_rope_case(H, KV, D, RD, T, gen)
    caches = [(cache.clone(), -cache.clone()) for _ in range(2)]
    q_ref = A.qk_norm_rope_cache_torch(qkv, pos, slots, qw, kw, cos, sin, *caches[0], 1e-6)
    q_fast = A.qk_norm_rope_cache_fast(qkv, pos, slots, qw, kw, cos, sin, *caches[1], 1e-6)
    assert q_fast.shape == q_ref.shape == (T, H, D) and q_fast.dtype == q_ref.dtype
    assert q_ref.abs().max() > 1
    assert max_diff(q_fast, q_ref) <= TOL
    assert max_diff(caches[1][0], caches[0][0]) <= TOL
    assert torch.equal(caches[1][1], caches[0][1])
    untouched = torch.ones(cache.shape[0] * cache.shape[1], dtype=torch.bool)
    untouched[slots] = False
    for (k, v) in caches:  # only the slots of slot_mapping were written
        assert torch.equal(k.view(-1, KV, D)[untouched], cache.view(-1, KV, D)[untouched])
        assert torch.equal(v.view(-1, KV, D)[untouched], -cache.view(-1, KV, D)[untouched])
    k_written = caches[1][0].view(-1, KV, D)[slots]
    assert not torch.equal(k_written, cache.view(-1, KV, D)[slots])


# ------------------------------------------------------------------------------------------ decode attention
DECODE_SHAPES = [(6, 2, 16, 4), (4, 4, 16, 4), (2, 1, 32, 4), (3, 1, 24, 8)]


@pytest.mark.parametrize("heads,kv,D,block_size", DECODE_SHAPES)
def test_decode_torch_equals_per_sequence_reference(heads, kv, D, block_size):
    """The batched decode oracle against the per-sequence prefill oracle (both gated)."""
    gen = torch.Generator().manual_seed(heads * 10 + kv)
    lens = [1, 4, 5, 36, 17, 8]  # one token, whole blocks, a full table, partial blocks
    width = math.ceil(max(lens) / block_size)
    q, k_cache, v_cache, tables, ctx, gate = decode_inputs(heads, kv, D, block_size, lens, width, 40, gen)
    batch = decode_batch(lens, tables, block_size)
    out = A.paged_decode_attention_torch(q, k_cache, v_cache, batch.block_tables, batch.context_lens, D ** -0.5, gate)
    ref = A.paged_prefill_attention_torch(q, k_cache, v_cache, batch, D ** -0.5, gate)
    assert out.shape == (len(lens), heads * D)
    assert max_diff(out, ref) <= TOL


@pytest.mark.parametrize("heads,kv,D,block_size", DECODE_SHAPES)
@pytest.mark.parametrize("lens", [[37], [1, 9, 16], [3, 40, 1, 17, 8, 24, 33, 2]])
def test_decode_fast_equals_torch(heads, kv, D, block_size, lens):
    """Every split path: one split (gate in the attention kernel), several (merged by the last program of each
    sequence and KV head to arrive, all parts in one load or 2 at a time), and more splits than the context has
    tiles (empty splits); min_tiles 2 leaves short contexts fewer, longer splits. The arrival counters are back at
    zero after each launch (a CUDA graph replays it with no reset in between), and a second launch gives the same
    bits."""
    gen = torch.Generator().manual_seed(len(lens) * 100 + heads)
    width = math.ceil(max(lens) / block_size) + 2  # columns past every context
    args = decode_inputs(heads, kv, D, block_size, lens, width, 48, gen)
    ref = A.paged_decode_attention_torch(*args[:5], D ** -0.5, args[5])
    assert ref.abs().max() > 0.1
    for splits, min_tiles, chunk in [(1, 1, None), (2, 1, None), (3, 2, None), (7, 1, None), (7, 1, 2)]:
        out = A.paged_decode_launch(*args[:5], D ** -0.5, args[5], splits, tile=16, min_tiles=min_tiles,
                                    merge_chunk=chunk)
        assert max_diff(out, ref) <= TOL, (splits, min_tiles, chunk)
        assert all(not buf.any() for buf in backend._COUNTERS.values())
        assert torch.equal(A.paged_decode_launch(*args[:5], D ** -0.5, args[5], splits, tile=16,
                                                 min_tiles=min_tiles, merge_chunk=chunk), out)
    assert max_diff(A.paged_decode_attention_fast(*args[:5], D ** -0.5, args[5]), ref) <= TOL


def test_decode_padded_rows_read_only_the_scratch_block():
    """Graph padding: rows with context 1 on the scratch block (the last one) give the gated scratch value and leave
    the real rows' results unchanged."""
    gen = torch.Generator().manual_seed(5)
    heads, kv, D, bs, n_blocks = 4, 2, 16, 4, 12
    real = [9, 14]
    q, k_cache, v_cache, tables, ctx, gate = decode_inputs(heads, kv, D, bs, real + [1, 1], 4, n_blocks - 1, gen)
    tables[2:] = n_blocks - 1
    k_cache = torch.cat([k_cache, torch.randn(1, bs, kv, D, generator=gen)])
    v_cache = torch.cat([v_cache, torch.randn(1, bs, kv, D, generator=gen)])
    out = A.paged_decode_launch(q, k_cache, v_cache, tables, ctx, D ** -0.5, gate, 3, tile=16, min_tiles=1)
    alone = A.paged_decode_attention_torch(q[:2], k_cache, v_cache, tables[:2], ctx[:2], D ** -0.5, gate[:2])
    assert max_diff(out[:2], alone) <= TOL
    scratch_v = v_cache[-1, 0].repeat_interleave(heads // kv, dim=0).reshape(-1)  # softmax over one key is 1
    for r in (2, 3):
        assert max_diff(out[r], scratch_v * torch.sigmoid(gate[r].reshape(-1))) <= TOL


def test_decode_splits_depend_on_shapes_only(monkeypatch):
    """Few sequences get many splits (up to MAX_SPLITS), a full batch few; never more than the widest context gives
    MIN_TILES_PER_SPLIT tiles each; at least 1."""
    monkeypatch.setattr(A.backend, "sm_count", lambda device: 132)
    tiles = A.DECODE_TILE * A.MIN_TILES_PER_SPLIT
    assert A.decode_splits(1, 2, 32768, "cpu") == min(A.MAX_SPLITS, 132)
    assert A.decode_splits(64, 2, 32768, "cpu") == math.ceil(2 * 132 / 128)
    assert A.decode_splits(1, 2, 3 * tiles, "cpu") == 3
    assert A.decode_splits(256, 8, 32768, "cpu") == 1
    assert A.decode_splits(1, 1, 1, "cpu") == 1
    assert A.decode_splits(2, 1, 32768, "cpu") >= A.decode_splits(8, 1, 32768, "cpu")
    assert A.decode_splits(1, 2, 3 * 128 * A.MIN_TILES_PER_SPLIT, "cpu", tile=128) == 3
    assert A.decode_splits(64, 8, 32768, "cpu", per_sm=4) == math.ceil(4 * 132 / 512)


def test_decode_config_by_head_dim_and_rows():
    """The smallest listed head_dim >= the model's, else the largest listed; within it the first setting whose row
    bound takes the rows."""
    assert A.decode_config(64, 1) == A.DECODE_CONFIG[64][0][1] and A.decode_config(64, 2) == A.DECODE_CONFIG[64][1][1]
    assert A.decode_config(80, 1) == A.decode_config(128, 64) == A.DECODE_CONFIG[128][0][1]
    assert A.decode_config(256, 8) == A.DECODE_CONFIG[256][0][1] == A.decode_config(512, 1)
    assert A.decode_config(256, 9) == A.DECODE_CONFIG[256][1][1] == A.decode_config(512, 64)
    for table in A.DECODE_CONFIG.values():
        assert table[-1][0] is None and {"tile", "warps", "stages", "per_sm"} == set(table[0][1])


# ----------------------------------------------------------------------------------------- prefill attention
def prefill_batch(lens, starts, block_size, n_blocks, gen, device="cpu", extra_cols=2) -> ForwardBatch:
    """A packed step as ModelRunner.prepare builds it: sequence i feeds lens[i] tokens after starts[i] cached ones,
    in shuffled distinct blocks; table columns past each context hold other sequences' blocks."""
    width = max(math.ceil((s + n) / block_size) for n, s in zip(lens, starts)) + extra_cols
    need = sum(math.ceil((s + n) / block_size) for n, s in zip(lens, starts))
    assert need <= n_blocks
    perm = torch.randperm(n_blocks, generator=gen).tolist()
    rows, used = [], 0
    for n, s in zip(lens, starts):
        own = math.ceil((s + n) / block_size)
        rows.append(perm[used:used + own] + [perm[(used + own + c) % n_blocks] for c in range(width - own)])
        used += own
    tables = torch.tensor(rows, dtype=torch.int32)
    lens_t, starts_t = torch.tensor(lens), torch.tensor(starts)
    seq = torch.repeat_interleave(torch.arange(len(lens)), lens_t)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int64)
    cu[1:] = lens_t.cumsum(0)
    pos = starts_t[seq] + torch.arange(int(cu[-1])) - cu[:-1][seq]
    return ForwardBatch(
        input_ids=torch.zeros(len(pos), dtype=torch.int64, device=device), positions=pos.to(device),
        slot_mapping=(tables[seq, pos // block_size].long() * block_size + pos % block_size).to(device),
        cu_seqlens=cu.int().to(device), start_pos=starts_t.int().to(device),
        context_lens=(starts_t + lens_t).int().to(device), block_tables=tables.to(device),
        state_slots=torch.arange(len(lens), device=device), logits_indices=(cu[1:] - 1).to(device),
        seq_lens_cpu=list(lens), start_pos_cpu=list(starts), state_slots_cpu=list(range(len(lens))),
        is_decode=all(n == 1 and s > 0 for n, s in zip(lens, starts)))


def prefill_inputs(heads, kv, D, block_size, lens, starts, gen, dtype=torch.float32, device="cpu", gated=True):
    """(q, k_cache, v_cache, batch, gate): random caches (every position a query may see holds a key), q and a
    strided gate view as split_qkv gives them (gate None when not gated)."""
    n_blocks = sum(math.ceil((s + n) / block_size) for n, s in zip(lens, starts)) + 3
    batch = prefill_batch(lens, starts, block_size, n_blocks, gen, device)
    T = sum(lens)
    k_cache = torch.randn(n_blocks, block_size, kv, D, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(n_blocks, block_size, kv, D, generator=gen).to(dtype).to(device)
    q = torch.randn(T, heads, D, generator=gen).to(dtype).to(device)
    gate = torch.randn(T, heads, 2 * D, generator=gen).to(dtype).to(device)[..., D:] if gated else None
    return q, k_cache, v_cache, batch, gate


def small_prefill_tiles(monkeypatch, block_m=16, block_n=16):
    for d in A.PREFILL_CONFIG:
        monkeypatch.setitem(A.PREFILL_CONFIG, d, dict(block_m=block_m, block_n=block_n, num_warps=4, num_stages=1))


PREFILL_PACK = [1, 63, 64, 65, 200]   # tile boundaries (16 and 64) crossed and not
PREFILL_STARTS = [0, 0, 37, 0, 5]     # fresh prompts and chunks / prefix hits on cached pages


@pytest.mark.parametrize("heads,kv", [(2, 2), (4, 2), (4, 1)])  # GQA ratios 1, 2, 4
@pytest.mark.parametrize("gated", [True, False])
def test_prefill_fast_equals_torch(heads, kv, gated, monkeypatch):
    """A varlen pack of lengths 1, 63, 64, 65, 200, some after cached tokens (start_pos > 0), 16 x 16 tiles and
    4-token pages, so query tiles, key tiles and pages are crossed at different places."""
    small_prefill_tiles(monkeypatch)
    gen = torch.Generator().manual_seed(heads * 10 + kv + gated)
    D, bs = 16, 4
    q, kc, vc, batch, gate = prefill_inputs(heads, kv, D, bs, PREFILL_PACK, PREFILL_STARTS, gen, gated=gated)
    ref = A.paged_prefill_attention_torch(q, kc, vc, batch, D ** -0.5, gate)
    out = A.paged_prefill_attention_fast(q, kc, vc, batch, D ** -0.5, gate)
    assert out.shape == ref.shape == (sum(PREFILL_PACK), heads * D) and out.dtype == ref.dtype
    assert ref.abs().max() > 0.5
    assert max_diff(out, ref) <= TOL


@pytest.mark.parametrize("block_m,block_n", [(64, 64), (16, 32), (32, 16)])
def test_prefill_fast_tile_shapes(block_m, block_n, monkeypatch):
    """The default 64 x 64 tiles (lengths 63/64/65 straddle one query tile) and unequal query / key tiles, with
    16-token pages, a head_dim that is not a power of two and starts that are not tile multiples."""
    small_prefill_tiles(monkeypatch, block_m, block_n)
    gen = torch.Generator().manual_seed(block_m + block_n)
    D, bs = 24, 16
    lens, starts = [63, 64, 65, 3, 130], [0, 70, 1, 0, 33]
    q, kc, vc, batch, gate = prefill_inputs(4, 2, D, bs, lens, starts, gen)
    ref = A.paged_prefill_attention_torch(q, kc, vc, batch, D ** -0.5, gate)
    assert max_diff(A.paged_prefill_attention_fast(q, kc, vc, batch, D ** -0.5, gate), ref) <= TOL


def test_prefill_fast_mixed_step(monkeypatch):
    """Decode rows (one token on a cached context) between prefill rows, in one launch: each equals its sequence
    run alone through the fast kernel and the oracle; the decode rows also equal the decode kernel's output."""
    small_prefill_tiles(monkeypatch)
    gen = torch.Generator().manual_seed(11)
    heads, kv, D, bs = 4, 2, 16, 4
    lens, starts = [1, 40, 1, 1, 17, 1], [30, 0, 7, 1, 50, 64]
    q, kc, vc, batch, gate = prefill_inputs(heads, kv, D, bs, lens, starts, gen)
    out = A.paged_prefill_attention_fast(q, kc, vc, batch, D ** -0.5, gate)
    assert max_diff(out, A.paged_prefill_attention_torch(q, kc, vc, batch, D ** -0.5, gate)) <= TOL
    offsets = [0] + torch.tensor(lens).cumsum(0).tolist()
    for i, (n, s) in enumerate(zip(lens, starts)):
        rows = slice(offsets[i], offsets[i + 1])
        one = ForwardBatch(
            input_ids=batch.input_ids[rows], positions=batch.positions[rows], slot_mapping=batch.slot_mapping[rows],
            cu_seqlens=torch.tensor([0, n], dtype=torch.int32), start_pos=batch.start_pos[i:i + 1],
            context_lens=batch.context_lens[i:i + 1], block_tables=batch.block_tables[i:i + 1],
            state_slots=batch.state_slots[i:i + 1], logits_indices=torch.tensor([n - 1]), seq_lens_cpu=[n],
            start_pos_cpu=[s], state_slots_cpu=[0], is_decode=n == 1 and s > 0)
        alone = A.paged_prefill_attention_fast(q[rows], kc, vc, one, D ** -0.5, gate[rows])
        assert max_diff(out[rows], alone) <= TOL
    dec = [i for i, n in enumerate(lens) if n == 1]
    rows = torch.tensor([offsets[i] for i in dec])
    want = A.paged_decode_attention_torch(q[rows], kc, vc, batch.block_tables[dec], batch.context_lens[dec],
                                          D ** -0.5, gate[rows])
    assert max_diff(out[rows], want) <= TOL


def test_prefill_fast_reads_only_the_context():
    """Keys past each query's position (later tokens of its own sequence, table columns past its context, other
    sequences' pages) do not change its output: set them all to huge values and compare."""
    gen = torch.Generator().manual_seed(12)
    heads, kv, D, bs = 2, 1, 16, 4
    lens, starts = [9, 1, 20], [3, 12, 0]
    q, kc, vc, batch, gate = prefill_inputs(heads, kv, D, bs, lens, starts, gen)
    out = A.paged_prefill_attention_fast(q, kc, vc, batch, D ** -0.5, gate)
    # the first query row of each sequence sees positions 0..start only: poison everything else
    kp, vp = torch.full_like(kc, 1e4), torch.full_like(vc, -1e4)
    offsets = [0] + torch.tensor(lens).cumsum(0).tolist()
    for i, s in enumerate(starts):
        for p in range(s + 1):
            blk, off = batch.block_tables[i, p // bs], p % bs
            kp[blk, off], vp[blk, off] = kc[blk, off], vc[blk, off]
    first = torch.tensor(offsets[:-1])
    poisoned = A.paged_prefill_attention_fast(q, kp, vp, batch, D ** -0.5, gate)
    assert max_diff(poisoned[first], out[first]) <= TOL


# ---------------------------------------------------------------------------------------------------- layer
def tiny_cfg(H=4, KV=2, D=32):
    return SimpleNamespace(num_attention_heads=H, num_key_value_heads=KV, head_dim=D, hidden_size=48,
                           rms_norm_eps=1e-6)


def build_layer(kernels, cfg, rank, tp, rotary, n_blocks, block_size, monkeypatch, dtype=torch.float32,
                device="cpu", seed=0):
    monkeypatch.setattr(parallel, "_RANK", rank)
    monkeypatch.setattr(parallel, "_WORLD", tp)
    with backend.use_kernels(kernels):
        m = A.GatedAttention(cfg, rotary, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(seed)
    for p in m.parameters():  # in place: the projections are views of the fused weight
        p.data.copy_((torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1])).to(dtype))
    shape = (n_blocks, block_size, m.num_kv_heads, m.head_dim)
    m.k_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    m.v_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    return m


def test_layer_uses_one_fused_gemm(monkeypatch):
    rot = RotaryEmbedding(8, 1e7, 64)
    m = build_layer("torch", tiny_cfg(), 0, 1, rot, 4, 4, monkeypatch)
    rows = [m.q_proj.weight.shape[0], m.k_proj.weight.shape[0], m.v_proj.weight.shape[0]]
    assert m.qkv_weight.shape == (sum(rows), 48)
    assert m.q_proj.weight.data_ptr() == m.qkv_weight.data_ptr()
    assert torch.equal(m.qkv_weight[rows[0]: rows[0] + rows[1]], m.k_proj.weight)
    assert torch.equal(m.qkv_weight[-rows[2]:], m.v_proj.weight)


@pytest.mark.parametrize("rank,tp", [(0, 1), (3, 4), (1, 2)])
def test_layer_fast_equals_torch(rank, tp, monkeypatch):
    """TP=1, a rank with 1 q head and a replicated KV head (TP=4 of 4 heads / 2 KV), and a TP=2 rank (2 q heads,
    1 KV head); a prefill step (one new prompt, one continuation), a mixed step (a decode row and a chunk), then a
    decode step with two padded rows."""
    cfg, bs, n_blocks = tiny_cfg(), 4, 16
    rot = RotaryEmbedding(8, 1e7, 128)
    layers = [build_layer(k, cfg, rank, tp, rot, n_blocks, bs, monkeypatch) for k in ("torch", "fast")]
    layers[1].k_cache, layers[1].v_cache = layers[0].k_cache.clone(), layers[0].v_cache.clone()
    gen = torch.Generator().manual_seed(rank)
    tables = torch.tensor([[3, 7, 1, 9, 0], [2, 5, 11, 4, 0]], dtype=torch.int32)
    # prefill: sequence 0 a fresh 6-token prompt, sequence 1 has 5 tokens cached and feeds 9 more
    starts, news = [0, 5], [6, 9]
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, news)])
    seq = torch.repeat_interleave(torch.arange(2), torch.tensor(news))
    prefill = ForwardBatch(
        input_ids=torch.zeros(len(pos), dtype=torch.int64), positions=pos,
        slot_mapping=tables[seq, pos // bs].long() * bs + pos % bs,
        cu_seqlens=torch.tensor([0, 6, 15], dtype=torch.int32), start_pos=torch.tensor(starts, dtype=torch.int32),
        context_lens=torch.tensor([6, 14], dtype=torch.int32), block_tables=tables, state_slots=torch.arange(2),
        logits_indices=torch.tensor([5, 14]), seq_lens_cpu=news, start_pos_cpu=starts, state_slots_cpu=[0, 1],
        is_decode=False)
    x = torch.randn(len(pos), cfg.hidden_size, generator=gen)
    outs = [m(x, prefill) for m in layers]
    assert outs[0].shape == (len(pos), cfg.hidden_size) and outs[0].abs().max() > 0.1
    assert max_diff(outs[1], outs[0]) <= TOL
    # mixed: sequence 0 one decode token at position 6, sequence 1 a chunk of 3 more at 14 (one launch in "fast")
    mixed = prefill_batch([1, 3], [6, 14], bs, n_blocks, gen)
    mixed.block_tables, mixed.slot_mapping = tables, tables[torch.tensor([0, 1, 1, 1]), mixed.positions // bs].long() \
        * bs + mixed.positions % bs
    x = torch.randn(4, cfg.hidden_size, generator=gen)
    outs = [m(x, mixed) for m in layers]
    assert not mixed.is_decode and max_diff(outs[1], outs[0]) <= TOL
    # decode: both sequences one token on, two padded rows (token at position 0 on the scratch block)
    scratch = n_blocks - 1
    dec_tables = torch.cat([tables, torch.full((2, 5), scratch, dtype=torch.int32)])
    dec = decode_batch([8, 18, 1, 1], dec_tables, bs)
    x = torch.randn(4, cfg.hidden_size, generator=gen)
    x[3] = x[2]  # padded rows all carry the same token, so the scratch slot gets one value
    outs = [m(x, dec) for m in layers]
    assert max_diff(outs[1], outs[0]) <= TOL
    for a, b in zip((layers[1].k_cache, layers[1].v_cache), (layers[0].k_cache, layers[0].v_cache)):
        assert max_diff(a, b) <= TOL


# ------------------------------------------------------------------------------------------------------ GPU
REAL = {1: (16, 2), 8: (2, 1)}  # TP degree -> local (q heads, KV heads) of Qwen3.5-35B-A3B
D_REAL, RD_REAL, BS_REAL = 256, 64, 16


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 8])
@pytest.mark.parametrize("T", [1, 64, 1000])
def test_gpu_norm_rope_cache_bf16(tp, T):
    H, KV = REAL[tp]
    gen = torch.Generator().manual_seed(T + tp)
    qkv, pos, slots, qw, kw, cos, sin, cache = norm_rope_case(H, KV, D_REAL, RD_REAL, T, gen, torch.bfloat16, "cuda",
                                                              n_blocks=200, block_size=BS_REAL, max_pos=32768)
    caches = [(cache.clone(), -cache.clone()) for _ in range(2)]
    q_ref = A.qk_norm_rope_cache_torch(qkv, pos, slots, qw, kw, cos, sin, *caches[0], 1e-6)
    q_fast = A.qk_norm_rope_cache_fast(qkv, pos, slots, qw, kw, cos, sin, *caches[1], 1e-6)
    k_fast, k_ref = (c[0].view(-1, KV, D_REAL)[slots] for c in (caches[1], caches[0]))
    for fast, ref in ((q_fast, q_ref), (k_fast, k_ref)):
        assert max_diff(fast, ref) <= 0.05
        assert (fast == ref).float().mean().item() >= 0.99
    assert torch.equal(caches[1][1], caches[0][1])


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 8])
@pytest.mark.parametrize("lens", [[32768], [8192, 1], [1, 15, 16, 17, 300, 1024, 33], [1024] * 64])
def test_gpu_decode_attention_bf16(tp, lens):
    heads, kv = REAL[tp]
    gen = torch.Generator().manual_seed(len(lens) + tp)
    width = math.ceil(max(lens) / BS_REAL)
    args = decode_inputs(heads, kv, D_REAL, BS_REAL, lens, width, max(width, 2 * len(lens) + 8) + 1, gen,
                         torch.bfloat16, "cuda")
    ref = A.paged_decode_attention_torch(*args[:5], D_REAL ** -0.5, args[5])
    out = A.paged_decode_attention_fast(*args[:5], D_REAL ** -0.5, args[5])
    assert torch.isfinite(out).all()
    assert rel(out, ref) <= 1e-2
    for splits in (1, 5, 64):
        assert rel(A.paged_decode_launch(*args[:5], D_REAL ** -0.5, args[5], splits), ref) <= 1e-2


@pytest.mark.gpu
def test_gpu_decode_attention_in_cuda_graph():
    """Captured once, replayed with new tables and context lengths: same as eager."""
    heads, kv = REAL[1]
    gen = torch.Generator().manual_seed(3)
    lens, width = [100, 2000, 1, 4096], 256
    q, kc, vc, tables, ctx, gate = decode_inputs(heads, kv, D_REAL, BS_REAL, lens, width, 600, gen, torch.bfloat16,
                                                 "cuda")
    fn = lambda: A.paged_decode_attention_fast(q, kc, vc, tables, ctx, D_REAL ** -0.5, gate)  # noqa: E731
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    for new_lens in ([4096, 3, 50, 1], [17, 17, 17, 4000]):
        ctx.copy_(torch.tensor(new_lens, dtype=torch.int32))
        tables.copy_(torch.stack([torch.randperm(600, generator=gen)[:width] for _ in lens]).int())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fn())


GPU_PACK, GPU_STARTS = [1, 63, 64, 65, 200, 1024, 3], [0, 40, 0, 7, 0, 300, 64]


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 8])
@pytest.mark.parametrize("gated", [True, False])
def test_gpu_prefill_attention_bf16(tp, gated):
    """Real shapes, a varlen pack with prefix-hit rows: relative L2 <= 1e-2 against the SDPA oracle overall and
    <= 2e-2 per sequence (both round P to bf16 for the PV product, ~3e-3)."""
    heads, kv = REAL[tp]
    gen = torch.Generator().manual_seed(tp + 2 * gated)
    q, kc, vc, batch, gate = prefill_inputs(heads, kv, D_REAL, BS_REAL, GPU_PACK, GPU_STARTS, gen, torch.bfloat16,
                                            "cuda", gated)
    ref = A.paged_prefill_attention_torch(q, kc, vc, batch, D_REAL ** -0.5, gate)
    out = A.paged_prefill_attention_fast(q, kc, vc, batch, D_REAL ** -0.5, gate)
    assert torch.isfinite(out).all()
    assert rel(out, ref) <= 1e-2
    offsets = [0] + torch.tensor(GPU_PACK).cumsum(0).tolist()
    for lo, hi in zip(offsets[:-1], offsets[1:]):
        assert rel(out[lo:hi], ref[lo:hi]) <= 2e-2, (lo, hi)


@pytest.mark.gpu
def test_gpu_prefill_attention_mixed_step_bf16():
    """64 decode rows at context ~1K and a 512-token prompt chunk after 512 cached tokens, one launch: the decode
    rows within 1e-2 (relative L2) of the decode oracle, the chunk within 1e-2 of the SDPA oracle."""
    heads, kv = REAL[1]
    gen = torch.Generator().manual_seed(9)
    lens, starts = [1] * 64 + [512], [1000 + i for i in range(64)] + [512]
    q, kc, vc, batch, gate = prefill_inputs(heads, kv, D_REAL, BS_REAL, lens, starts, gen, torch.bfloat16, "cuda")
    out = A.paged_prefill_attention_fast(q, kc, vc, batch, D_REAL ** -0.5, gate)
    dec = A.paged_decode_attention_torch(q[:64], kc, vc, batch.block_tables[:64], batch.context_lens[:64],
                                         D_REAL ** -0.5, gate[:64])
    assert rel(out[:64], dec) <= 1e-2
    assert rel(out[64:], A.paged_prefill_attention_torch(q, kc, vc, batch, D_REAL ** -0.5, gate)[64:]) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 8])
def test_gpu_layer_prefill_bf16(tp, monkeypatch):
    """The whole layer at real shapes on a mixed step (a fresh 1000-token prompt, a chunk after cached tokens, two
    decode rows): fast vs torch relative L2 <= 2e-2 on the output, K/V pages as the decode test."""
    cfg = SimpleNamespace(num_attention_heads=16, num_key_value_heads=2, head_dim=D_REAL, hidden_size=2048,
                          rms_norm_eps=1e-6)
    rot = RotaryEmbedding(RD_REAL, 1e7, 4096, device="cuda")
    lens, starts = [1000, 1, 300, 1], [0, 500, 128, 77]
    gen = torch.Generator().manual_seed(tp)
    n_blocks = sum(math.ceil((s + n) / BS_REAL) for n, s in zip(lens, starts)) + 3
    batch = prefill_batch(lens, starts, BS_REAL, n_blocks, gen, "cuda")
    layers = [build_layer(k, cfg, 0, tp, rot, n_blocks, BS_REAL, monkeypatch, torch.bfloat16, "cuda")
              for k in ("torch", "fast")]
    layers[1].k_cache, layers[1].v_cache = layers[0].k_cache.clone(), layers[0].v_cache.clone()
    x = torch.randn(sum(lens), 2048, device="cuda", dtype=torch.bfloat16)
    outs = [m(x, batch) for m in layers]
    assert rel(outs[1], outs[0]) <= 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 8])
def test_gpu_layer_decode_bf16(tp, monkeypatch):
    """The whole layer at real shapes (hidden 2048), a decode step of 8 sequences at context ~1K."""
    H, KV = REAL[tp]
    cfg = SimpleNamespace(num_attention_heads=16, num_key_value_heads=2, head_dim=D_REAL, hidden_size=2048,
                          rms_norm_eps=1e-6)
    rot = RotaryEmbedding(RD_REAL, 1e7, 4096, device="cuda")
    n_blocks = 8 * 64 + 1
    layers = [build_layer(k, cfg, 0, tp, rot, n_blocks, BS_REAL, monkeypatch, torch.bfloat16, "cuda")
              for k in ("torch", "fast")]
    assert (layers[1].num_heads, layers[1].num_kv_heads) == (H, KV)
    layers[1].k_cache, layers[1].v_cache = layers[0].k_cache.clone(), layers[0].v_cache.clone()
    lens = [1024 - 37 * i for i in range(8)]
    tables = torch.randperm(n_blocks - 1)[: 8 * 64].view(8, 64).int()
    batch = decode_batch(lens, tables, BS_REAL)
    batch = ForwardBatch(**{f: (getattr(batch, f).cuda() if isinstance(getattr(batch, f), torch.Tensor)
                                else getattr(batch, f)) for f in batch.__dataclass_fields__})
    x = torch.randn(8, 2048, device="cuda", dtype=torch.bfloat16)
    outs = [m(x, batch) for m in layers]
    assert rel(outs[1], outs[0]) <= 2e-2


# ------------------------------------------------------------------------------------------------- block tables
@pytest.mark.parametrize("n,width", [(1, 5), (4, 9), (7, 33)])
def test_set_tables_fast_equals_torch(n, width):
    """The block tables a step sets (layers/block_tables.py): the one-launch writer equals the torch one exactly,
    on tables of 1..width blocks (a full-width one included) into some of the slots; other slots' rows and the
    columns past each table keep their values; slot_end is the last position each table covers, clamped."""
    from layers.block_tables import pack_tables, set_tables_fast, set_tables_torch
    gen = torch.Generator().manual_seed(n * 31 + width)
    slots = torch.randperm(12, generator=gen)[:n].tolist()
    lens = [width] + torch.randint(1, width + 1, (n - 1,), generator=gen).tolist()
    tables = [(s, torch.randint(0, 1000, (m,), generator=gen).tolist()) for s, m in zip(slots, lens)]
    flat = torch.tensor(pack_tables(tables), dtype=torch.int64)
    before = torch.randint(0, 1000, (12, width + 2), generator=gen, dtype=torch.int32)
    got, want = before.clone(), before.clone()
    end_got, end_want = torch.full((12,), -7, dtype=torch.int64), torch.full((12,), -7, dtype=torch.int64)
    set_tables_fast(got, flat, n, end_got, block_size=16, max_len=16 * width - 5)
    set_tables_torch(want, flat, n, end_want, block_size=16, max_len=16 * width - 5)
    assert torch.equal(got, want) and torch.equal(end_got, end_want)
    for s, t in tables:
        assert got[s, :len(t)].tolist() == t and torch.equal(got[s, len(t):], before[s, len(t):])
        assert end_got[s] == min(16 * len(t), 16 * width - 5) - 1
    others = [s for s in range(12) if s not in slots]
    assert torch.equal(got[others], before[others]) and (end_got[others] == -7).all()
    set_tables_fast(got, flat, n)  # no slot_end: the tables alone
    assert torch.equal(got, want)
