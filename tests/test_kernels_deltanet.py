"""Gated DeltaNet decode (layers/deltanet.py): the fast op (one Triton kernel) against the torch oracle, the oracle
against the per-sequence reference, mixed steps, and the layer's one-GEMM input projection.

CPU (fp32, tiny shapes, Triton through the interpreter): TP-local odd shapes (dk, dv not powers of two; 3 value
heads on 1 key head; Hv/Hk = 3 and 1), conv kernels 2, 3, 4, batches 1 to 5 and 8 chained on the same caches in
slots out of order, padded rows on the scratch slot, softplus inputs on both sides of its threshold (20), each with
the value columns of a head split over programs (4 per slab: 3 slabs, the last partial, at dv = 10) and unsplit:
- decode_fast == decode_torch to 1e-5 max abs on O(1..10) outputs and O(1) states (the sum orders differ, ~1e-7);
  conv tails bit-exact (pure data movement; the q/k tail shared by a group of programs is shifted once, after all
  of them read it); slots outside the batch bit-untouched; pad rows write scratch only; the group counters are
  back at zero after every launch.
- decode_torch == the per-sequence reference (mixed_torch: F.conv1d, the recurrent rule, one sequence at a time)
  to 1e-5, so the oracle itself is checked against the spec's formulation.
- gates_fast (the prefill path's g and beta) == gates_torch: 1e-5 relative on g, 1e-6 on beta, softplus inputs from
  -60 to 60 and sigmoid inputs from -30 to 30.
- mixed_fast (decode rows batched through the decode op, the other sequences through the varlen prefill kernels,
  gates and gated norm) == mixed_torch to 2e-4 (the prefill kernels' tolerance) on outputs and caches, with either
  kernel set; decode rows interleaved (gathered rows), first (sliced rows) and absent (the batch's own tensors).
- forward: the fused u|z|b|a GEMM (views of one weight) == the four separate projections, decode and mixed, to 1e-5.
- head dims that are not powers of two (dv 24, dk 48): the fast layer == the torch layer on a mixed step and a decode
  step, to 2e-4 on outputs and caches.
GPU (`-m gpu`, real Qwen3.5-35B-A3B shapes from the preset config at TP=1 (16 key / 32 value heads) and TP=8 local
(2 / 4), dk = dv = 128, conv 4; bf16 activations, fp32 state):
- decode_fast vs decode_torch at batch 1, 7 (+1 padded row), 32, 64, three chained steps, value slabs of 16, 32 and
  128 columns (the default and both ends of the sweep): outputs within rtol = atol =
  2e-2 (about five bf16 ulps; the two paths round the conv, o and the norm each once to bf16, and a rare flip of a
  rounding tie moves an output by an ulp or two) and relative L2 <= 5e-3; states max abs <= 1e-2 on O(1) entries (a
  flipped bf16 conv output of v moves its state column by ~|k_i| x one ulp of v); conv tails bit-exact.
- mixed_fast vs mixed_torch (TP=8 local shapes): relative L2 <= 1e-2 on outputs, states max abs <= 1e-2.
"""
from types import SimpleNamespace

import pytest
import torch

from dist import parallel
from layers import backend
from layers import deltanet as dn
from layers.backend import triton
from layers.forward_batch import ForwardBatch
from tests.compare import max_diff, rel

pytestmark = pytest.mark.skipif(triton is None, reason="needs triton")
TOL_CHUNKED = 2e-4
TOL = 1e-5
EPS = 1e-6


def tiny_cfg(hk, hv, dk, dv, kernel, hidden=16):
    return SimpleNamespace(linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=dk,
                           linear_value_head_dim=dv, hidden_size=hidden, linear_conv_kernel_dim=kernel,
                           rms_norm_eps=EPS)


def real_cfg():
    from qwen35.config import ModelConfig
    from qwen35.synth import PRESETS
    return ModelConfig.from_dict({"text_config": dict(PRESETS["qwen3.5-35b-a3b"]["text_config"])})


def build_layer(kernels, cfg, monkeypatch, rank=0, tp=1, n_slots=9, dtype=torch.float32, device="cpu", seed=0):
    """A layer of rank `rank` of `tp` with random weights (A_log, dt_bias spread so that softplus sees both sides of
    its threshold) and random caches of n_slots slots (the last one is the scratch slot)."""
    monkeypatch.setattr(parallel, "_RANK", rank)
    monkeypatch.setattr(parallel, "_WORLD", tp)
    with backend.use_kernels(kernels):
        m = dn.GatedDeltaNet(cfg, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(seed)
    for name, p in m.named_parameters():  # in place: the projections are views of the fused weight
        if name == "A_log":
            x = torch.rand(p.shape, generator=gen) * 2 - 1.5
        elif name == "dt_bias":
            x = torch.linspace(-25, 25, p.numel())[torch.randperm(p.numel(), generator=gen)]
        elif name == "norm.weight":
            x = torch.rand(p.shape, generator=gen) + 0.5
        else:
            x = torch.randn(p.shape, generator=gen) * (0.5 if "conv1d" in name else p.shape[-1] ** -0.5)
        p.data.copy_(x.to(p.dtype))
    m.conv_state = torch.randn(n_slots, m.conv_dim, m.kernel - 1, generator=gen).to(dtype).to(device)
    m.ssm_state = torch.randn(n_slots, m.num_v_heads, m.dk, m.dv, generator=gen).to(device)
    return m


def random_proj(m, T, gen, device="cpu", dtype=torch.float32):
    """A fused projection u|z|b|a [T, ...] with O(1) u, z, b and a in [-10, 10] (a + dt_bias then spans +-35)."""
    H = m.num_v_heads
    u = torch.randn(T, m.conv_dim + H * m.dv + H, generator=gen) * 2
    a = torch.rand(T, H, generator=gen) * 20 - 10
    return torch.cat([u, a], -1).to(dtype).to(device)


def decode_args(m, proj, slots):
    return (proj, m.conv_state, m.ssm_state, slots, m.conv1d.weight, m.A_log, m.dt_bias, m.norm.weight, m.norm.eps)


def batch_of(lens, starts, slots, device="cpu") -> ForwardBatch:
    """What the DeltaNet layer reads of a ModelRunner batch (the token-level fields stay empty)."""
    cu = torch.tensor([0] + lens).cumsum(0).int()
    empty = torch.zeros(0, dtype=torch.int64)
    return ForwardBatch(
        input_ids=empty, positions=empty, slot_mapping=empty, cu_seqlens=cu.to(device),
        start_pos=torch.tensor(starts, dtype=torch.int32, device=device), context_lens=None, block_tables=None,
        state_slots=torch.tensor(slots, device=device), logits_indices=empty, seq_lens_cpu=list(lens),
        start_pos_cpu=list(starts), state_slots_cpu=list(slots),
        is_decode=all(n == 1 and s > 0 for n, s in zip(lens, starts)))


def caches(m):
    return m.conv_state.clone(), m.ssm_state.clone()


def set_caches(m, saved):
    m.conv_state, m.ssm_state = (t.clone() for t in saved)


# (hk, hv, dk, dv, kernel, rank, tp): Hv/Hk = 3 with dk, dv not powers of two; one key head for three value heads
# (rank 1 of TP=2); Hv/Hk = 1 with conv kernel 2
SHAPES = [(2, 6, 12, 10, 4, 0, 1), (2, 6, 8, 8, 3, 1, 2), (4, 4, 16, 8, 2, 0, 1)]


# --------------------------------------------------------------------------------------- decode: fast vs torch
@pytest.fixture(params=[4, 32], ids=["split", "whole"])
def block_v(request, monkeypatch):
    """Value columns per decode program: 4 splits every head of the tiny shapes over programs, 32 covers them."""
    monkeypatch.setitem(dn.DECODE_CONFIG, "block_v", request.param)
    monkeypatch.setitem(dn.DECODE_CONFIG, "batched_block_v", request.param)
    return request.param


def counters_clear():
    return all(not buf.any() for buf in backend._COUNTERS.values())


@pytest.mark.parametrize("hk,hv,dk,dv,kernel,rank,tp", SHAPES)
def test_decode_fast_equals_torch(hk, hv, dk, dv, kernel, rank, tp, block_v, monkeypatch):
    """Batches of 1 to 5 and 8 (with one and two padded rows on the scratch slot) chained on the same caches."""
    m = build_layer("torch", tiny_cfg(hk, hv, dk, dv, kernel), monkeypatch, rank, tp, n_slots=11, seed=hv + kernel)
    gen = torch.Generator().manual_seed(dk)
    scratch = 10
    before = caches(m)
    for B, pad in ((1, 0), (2, 0), (3, 0), (4, 0), (5, 1), (8, 2)):
        real = torch.randperm(scratch, generator=gen)[: B - pad].tolist()
        slots = torch.tensor(real + [scratch] * pad)
        proj = random_proj(m, B, gen)
        if pad:  # pad rows carry one token, as the runner's padding does
            proj[B - pad:] = proj[B - pad]
        start = caches(m)
        y_ref = dn.decode_torch(*decode_args(m, proj, slots))
        after_ref = caches(m)
        set_caches(m, start)
        y = dn.decode_fast(*decode_args(m, proj, slots))
        assert counters_clear()
        assert y.shape == (B, m.num_v_heads * dv) and y_ref.abs().max() > 0.5
        assert max_diff(y[:B - pad], y_ref[:B - pad]) <= TOL
        assert torch.equal(m.conv_state[:scratch], after_ref[0][:scratch])  # programs of pad rows race on scratch
        assert max_diff(m.ssm_state[:scratch], after_ref[1][:scratch]) <= TOL
        untouched = [s for s in range(scratch) if s not in real]
        assert torch.equal(m.ssm_state[untouched], start[1][untouched])
        assert torch.equal(m.conv_state[untouched], start[0][untouched])
        set_caches(m, after_ref)
    assert max_diff(m.ssm_state[:scratch], before[1][:scratch]) > 0.1  # the chain did move the states


def test_decode_fast_splits_as_configured(monkeypatch):
    """The launch settings come from DECODE_CONFIG, the rows and the head dims alone: slabs capped at the head,
    warps so that a thread holds >= 32 state elements, the batched values from batched_from rows."""
    monkeypatch.setitem(dn.DECODE_CONFIG, "block_v", 32)
    monkeypatch.setitem(dn.DECODE_CONFIG, "warps", 4)
    assert dn.decode_launch(128, 128) == (32, 4)
    assert dn.decode_launch(12, 10) == (16, 1)
    monkeypatch.setitem(dn.DECODE_CONFIG, "block_v", 128)
    monkeypatch.setitem(dn.DECODE_CONFIG, "warps", 8)
    assert dn.decode_launch(128, 128) == (128, 8)
    assert dn.decode_launch(128, 64) == (64, 8)
    assert dn.decode_launch(16, 16) == (16, 1)
    monkeypatch.setitem(dn.DECODE_CONFIG, "batched_from", 8)
    monkeypatch.setitem(dn.DECODE_CONFIG, "batched_block_v", 64)
    monkeypatch.setitem(dn.DECODE_CONFIG, "batched_warps", 2)
    assert dn.decode_launch(128, 128, 7) == (128, 8)
    assert dn.decode_launch(128, 128, 8) == (64, 2)
    assert dn.decode_launch(128, 32, 64) == (32, 2)


def test_arrival_counters_grow_and_keep_old_buffers():
    """Grown, never freed (a captured graph keeps the address it was captured with), zero when handed out."""
    first = backend.arrival_counters(1, torch.device("cpu"))
    again = backend.arrival_counters(first.numel(), torch.device("cpu"))
    assert again is first and not first.any()
    bigger = backend.arrival_counters(first.numel() + 1, torch.device("cpu"))
    assert bigger.numel() > first.numel() and not bigger.any()
    assert any(old is first for old in backend._OUTGROWN)


def test_decode_fast_softplus_and_beta_edges(block_v, monkeypatch):
    """Gates at the extremes: a + dt_bias from -60 to 60 (softplus threshold, exp overflow guard), b from -30 to 30
    (beta ~0 and ~1): in-kernel g and beta equal the torch formulas."""
    m = build_layer("torch", tiny_cfg(1, 2, 4, 4, 4), monkeypatch, n_slots=13)
    gen = torch.Generator().manual_seed(5)
    B, H = 12, m.num_v_heads
    proj = random_proj(m, B, gen)
    proj[:, -2 * H:-H] = torch.linspace(-30, 30, B * H).view(B, H)                       # b
    proj[:, -H:] = torch.linspace(-60, 60, B * H).view(B, H) - m.dt_bias.data            # a
    slots = torch.arange(B)
    start = caches(m)
    y_ref = dn.decode_torch(*decode_args(m, proj, slots))
    after_ref = caches(m)
    set_caches(m, start)
    y = dn.decode_fast(*decode_args(m, proj, slots))
    assert torch.isfinite(y).all()
    assert max_diff(y, y_ref) <= TOL
    assert max_diff(m.ssm_state, after_ref[1]) <= TOL


@pytest.mark.parametrize("H", [1, 3, 32])
def test_gates_fast_equals_torch(H):
    """The prefill path's gate kernel: a + dt_bias from -60 to 60 (softplus threshold, exp overflow guard), b from
    -30 to 30, strided views of a wider row, fp32 (1e-5 relative on g, whose magnitude reaches ~100)."""
    T = 37
    gen = torch.Generator().manual_seed(H)
    row = torch.randn(T, 2 * H + 3, generator=gen)
    b, a = row[:, 1:1 + H], row[:, 2 + H:2 + 2 * H]
    b.copy_(torch.linspace(-30, 30, T * H).view(T, H))
    dt_bias = torch.randn(H, generator=gen)
    a.copy_(torch.linspace(-60, 60, T * H)[torch.randperm(T * H, generator=gen)].view(T, H) - dt_bias)
    A_log = torch.rand(H, generator=gen) * 2 - 1.5
    g_ref, beta_ref = dn.gates_torch(a, b, A_log, dt_bias)
    g, beta = dn.gates_fast(a, b, A_log, dt_bias)
    assert g.dtype == beta.dtype == torch.float32 and g.shape == beta.shape == (T, H)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)
    assert max_diff(beta, beta_ref) <= 1e-6


@pytest.mark.parametrize("hk,hv,dk,dv,kernel,rank,tp", SHAPES[:2])
def test_decode_torch_equals_per_sequence_reference(hk, hv, dk, dv, kernel, rank, tp, monkeypatch):
    """The oracle against mixed_torch on a decode batch: F.conv1d on the cached tail, the recurrent rule, the gated
    norm, one sequence at a time."""
    m = build_layer("torch", tiny_cfg(hk, hv, dk, dv, kernel), monkeypatch, rank, tp, seed=1)
    gen = torch.Generator().manual_seed(2)
    slots = [4, 0, 7, 2, 5]
    batch = batch_of([1] * 5, [3, 9, 1, 30, 2], slots)
    for _ in range(2):
        proj = random_proj(m, 5, gen)
        start = caches(m)
        y = dn.decode_torch(*decode_args(m, proj, batch.state_slots))
        after = caches(m)
        set_caches(m, start)
        y_ref = m.mixed_torch(proj, batch)
        assert y_ref.abs().max() > 0.5
        assert max_diff(y, y_ref) <= TOL
        for a, b in zip(after, caches(m)):
            assert max_diff(a, b) <= TOL


# ------------------------------------------------------------------------------------------------ mixed steps
MIXED = {  # (lens, starts, slots): decode rows are those of one token after a cached start
    "interleaved": ([1, 5, 1, 70, 3, 1, 1], [4, 0, 9, 0, 6, 0, 2], [3, 1, 7, 0, 5, 6, 2]),
    "decodes first": ([1, 1, 1, 66, 2, 1], [4, 9, 2, 0, 6, 0], [3, 7, 2, 0, 5, 6]),
    "no decodes": ([66, 1, 3], [0, 0, 6], [0, 6, 5]),
}


@pytest.mark.parametrize("kernels", ["torch", "fast"])
@pytest.mark.parametrize("case", sorted(MIXED))
def test_mixed_fast_equals_per_sequence(kernels, case, monkeypatch):
    """Decode rows and prefill rows: fresh prompts (one over 64 tokens, two chunks; one of a single token),
    continuing chunks, decodes. Interleaved (rows gathered), decodes first as the scheduler packs them (rows as
    slices) and a step without decodes (the batch's own tensors). mixed_fast == mixed_torch on outputs and every
    cache entry."""
    m = build_layer(kernels, tiny_cfg(2, 6, 16, 16, 4), monkeypatch, seed=3)
    gen = torch.Generator().manual_seed(4)
    lens, starts, slots = MIXED[case]
    batch = batch_of(lens, starts, slots)
    assert not batch.is_decode
    proj = random_proj(m, sum(lens), gen)
    y, after, y_ref = run_both(m, lambda: m.mixed_fast(proj, batch), lambda: m.mixed_torch(proj, batch))
    assert y_ref.abs().max() > 0.5
    # the prefill rows take the Triton chunked kernel, whose fp32 sums run in another order than the torch
    # chunk rule's: the prefill kernels' own tolerance (tests/test_kernels_deltanet_prefill.py)
    assert max_diff(y, y_ref) <= TOL_CHUNKED
    for a, b in zip(after, caches(m)):
        assert max_diff(a, b) <= TOL_CHUNKED


def test_mixed_split_once_per_step_with_checkpoints_renumbered():
    """mixed_split: the decode rows and the prefill sequences of an interleaved step (rows gathered), the prefill
    sequences' offsets, starts and slots, their checkpoints renumbered to them; made once per step (the same
    object for every layer); None for a step without decode rows."""
    from layers.deltanet import mixed_split
    lens, starts, slots = MIXED["interleaved"]  # decodes: sequences 0, 2, 6; prefill: 1, 3, 4, 5 (5: fresh)
    batch = batch_of(lens, starts, slots)
    batch.checkpoints_cpu = [(3, 64, 11), (4, 9, 12)]
    split = mixed_split(batch, torch.device("cpu"))
    assert mixed_split(batch, torch.device("cpu")) is split
    offsets = [0, *torch.tensor(lens).cumsum(0).tolist()]
    rows = lambda seqs: [t for i in seqs for t in range(offsets[i], offsets[i + 1])]  # noqa: E731
    assert split.decode_rows.tolist() == rows([0, 2, 6]) and split.decode_slots.tolist() == [3, 7, 2]
    assert split.chunk_rows.tolist() == rows([1, 3, 4, 5])
    assert split.cu_seqlens.tolist() == [0, 5, 75, 78, 79] and split.cu_seqlens.dtype == torch.int32
    assert split.start_pos.tolist() == [0, 0, 6, 0] and split.slots.tolist() == [1, 0, 5, 6]
    assert split.checkpoints.tolist() == [[1, 64, 11], [2, 9, 12]]
    first = batch_of(*MIXED["decodes first"])  # decode rows, then prefill rows: slices, no index copied
    split = mixed_split(first, torch.device("cpu"))
    assert split.decode_rows == slice(0, 3) and split.chunk_rows == slice(3, 72) and split.checkpoints is None
    assert mixed_split(batch_of(*MIXED["no decodes"]), torch.device("cpu")) is None


def run_both(m, first, second):
    """(first(), the caches it left, second()), both from the same caches."""
    start = caches(m)
    a = first()
    after = caches(m)
    set_caches(m, start)
    return a, after, second()


# ------------------------------------------------------------------------------------ the layer, one GEMM in
def test_in_proj_is_one_fused_weight(monkeypatch):
    m = build_layer("torch", tiny_cfg(2, 6, 12, 10, 4), monkeypatch, rank=1, tp=2)
    parts = [m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a]
    assert m.in_proj.shape == (m.conv_dim + 2 * m.num_v_heads + m.num_v_heads * m.dv, 16)
    assert not isinstance(m.in_proj, torch.nn.Parameter)
    assert torch.equal(m.in_proj, torch.cat([p.weight for p in parts]))
    m.in_proj_b.weight.data.fill_(7.0)  # the loader writes the views: the fused weight sees it
    assert (m.in_proj[-2 * m.num_v_heads:-m.num_v_heads] == 7.0).all()


@pytest.mark.parametrize("kernels", ["torch", "fast"])
def test_forward_equals_separate_projections(kernels, monkeypatch):
    """forward = out_proj(mixed_torch(cat of the four projections)) for a decode batch and a mixed one."""
    m = build_layer(kernels, tiny_cfg(1, 3, 16, 16, 4), monkeypatch, seed=6)
    gen = torch.Generator().manual_seed(7)
    for lens, starts, slots in (([1, 1, 1], [5, 2, 1], [2, 6, 8]), ([1, 4, 1], [3, 0, 8], [1, 4, 2])):
        batch = batch_of(lens, starts, slots)
        x = torch.randn(sum(lens), 16, generator=gen)
        proj = torch.cat([m.in_proj_qkv(x), m.in_proj_z(x), m.in_proj_b(x), m.in_proj_a(x)], -1)
        got, after, want = run_both(m, lambda: m(x, batch), lambda: m.out_proj(m.mixed_torch(proj, batch)))
        assert want.abs().max() > 0.1
        assert max_diff(got, want) <= TOL_CHUNKED
        for a, b in zip(after, caches(m)):
            assert max_diff(a, b) <= TOL_CHUNKED


@pytest.mark.parametrize("hk,hv,dk,dv", [(1, 2, 16, 24), (1, 1, 48, 48), (2, 2, 48, 32)])
def test_odd_head_dims_fast_equals_torch(hk, hv, dk, dv, monkeypatch):
    """Head dims that are not powers of two (linear_value_head_dim 24, linear_key_head_dim 48): the fast layer
    (the prefill kernels on padded blocks, the decode kernel, the gated norm) against the torch layer on the same
    weights and caches, through a mixed step (a fresh 70-token prompt over two chunks, a continuing chunk, decode
    rows) and then a decode step; outputs and caches within the prefill kernels' tolerance."""
    cfg = tiny_cfg(hk, hv, dk, dv, 4)
    ref, fast = (build_layer(kernels, cfg, monkeypatch, seed=11) for kernels in ("torch", "fast"))
    gen = torch.Generator().manual_seed(dk + dv)
    for lens, starts, slots in (MIXED["interleaved"], ([1, 1, 1, 1], [70, 5, 9, 1], [0, 1, 5, 6])):
        batch = batch_of(lens, starts, slots)
        x = torch.randn(sum(lens), 16, generator=gen)
        want, got = ref(x, batch), fast(x, batch)
        assert want.abs().max() > 0.1 and max_diff(got, want) <= TOL_CHUNKED
        for a, b in zip(caches(fast), caches(ref)):
            assert max_diff(a, b) <= TOL_CHUNKED


# ------------------------------------------------------------------------------------------------------ GPU
def real_layer(kernels, tp, monkeypatch, n_slots):
    """Rank 0 of `tp` at the real shapes, bf16 weights and conv tails, fp32 states of O(1)."""
    m = build_layer(kernels, real_cfg(), monkeypatch, rank=0, tp=tp, n_slots=n_slots, dtype=torch.bfloat16,
                    device="cuda", seed=tp)
    m.ssm_state.mul_(0.5)
    return m


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 8])
@pytest.mark.parametrize("block_v", [16, 32, 128])
def test_gpu_decode_fast_equals_torch_bf16(tp, block_v, monkeypatch):
    monkeypatch.setitem(dn.DECODE_CONFIG, "block_v", block_v)
    n_slots = 80
    m = real_layer("torch", tp, monkeypatch, n_slots)
    scratch = n_slots - 1
    gen = torch.Generator().manual_seed(0)
    for B, pad in ((1, 0), (8, 1), (32, 0), (64, 0)):
        real = torch.randperm(scratch, generator=gen)[: B - pad].tolist()
        slots = torch.tensor(real + [scratch] * pad, device="cuda")
        for _ in range(3):
            proj = random_proj(m, B, gen, "cuda", torch.bfloat16)
            if pad:
                proj[B - pad:] = proj[B - pad]
            y_ref, after_ref, y = run_both(m, lambda: dn.decode_torch(*decode_args(m, proj, slots)),
                                           lambda: dn.decode_fast(*decode_args(m, proj, slots)))
            n = B - pad
            assert torch.isfinite(y).all()
            torch.testing.assert_close(y[:n].float(), y_ref[:n].float(), rtol=2e-2, atol=2e-2)
            assert rel(y[:n], y_ref[:n]) <= 5e-3
            assert torch.equal(m.conv_state[:scratch], after_ref[0][:scratch])
            assert max_diff(m.ssm_state[:scratch], after_ref[1][:scratch]) <= 1e-2
            assert counters_clear()
            set_caches(m, after_ref)


@pytest.mark.gpu
def test_gpu_decode_fast_graph_replay_equals_eager(monkeypatch):
    """Captured once (after the warm-up that sizes the group counters), replayed on new inputs: the same bits as
    eager calls from the same caches (no float atomics; each launch leaves the counters at zero), TP=8 local shapes."""
    m = real_layer("torch", 8, monkeypatch, 20)
    gen = torch.Generator().manual_seed(3)
    B = 8
    slots = torch.randperm(19, generator=gen)[:B].cuda()
    proj = random_proj(m, B, gen, "cuda", torch.bfloat16)
    args = decode_args(m, proj, slots)  # the graph holds these tensors: below they are only copied into
    conv, ssm = m.conv_state, m.ssm_state
    dn.decode_fast(*args)  # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = dn.decode_fast(*args)
    for _ in range(3):
        proj.copy_(random_proj(m, B, gen, "cuda", torch.bfloat16))
        start = conv.clone(), ssm.clone()
        y_eager = dn.decode_fast(*args).clone()
        eager = conv.clone(), ssm.clone()
        conv.copy_(start[0])
        ssm.copy_(start[1])
        graph.replay()
        assert torch.equal(y_graph, y_eager)
        assert torch.equal(conv, eager[0]) and torch.equal(ssm, eager[1])
        assert not torch.equal(ssm, start[1])
    assert counters_clear()


@pytest.mark.gpu
def test_gpu_mixed_fast_equals_per_sequence_bf16(monkeypatch):
    m = real_layer("fast", 8, monkeypatch, 9)
    gen = torch.Generator().manual_seed(1)
    lens, starts, slots = [1, 300, 1, 77, 1], [40, 0, 9, 100, 2], [3, 1, 7, 0, 5]
    batch = batch_of(lens, starts, slots, "cuda")
    proj = random_proj(m, sum(lens), gen, "cuda", torch.bfloat16)
    y, after, y_ref = run_both(m, lambda: m.mixed_fast(proj, batch), lambda: m.mixed_torch(proj, batch))
    assert rel(y, y_ref) <= 1e-2
    assert torch.equal(after[0], m.conv_state)
    assert max_diff(after[1], m.ssm_state) <= 1e-2
