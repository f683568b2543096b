"""DeltaNet prefill ops (layers/deltanet_prefill.py): the Triton ops against their torch oracles, and the oracles
against independent references (a per-sequence F.conv1d; the token-by-token recurrence of spec §3.2).

CPU (fp32, tiny shapes, Triton through the interpreter; on a GPU machine the same tests run the compiled kernels on
CUDA with the state kernel's dots in "ieee" precision):
- conv: fast == torch to 1e-5 (same fp32 summation order, then one rounding; the GPU fuses multiply-adds, a wrong tap
  or tail is O(1)); tails and checkpoint tails bit-exact (raw copies). torch == F.conv1d to 1e-5.
- delta rule: fast vs torch <= 2e-4 max abs on outputs and states of magnitude O(1) (the chunk solve and the sums run
  in a different order; a wrong slot, decay or chunk boundary is O(0.1)); torch vs the recurrence <= 2e-4; head
  dims that are not powers of two (12, 24, 48) on the kernels' padded blocks, checkpoints included.
GPU (`-m gpu`, real Qwen3.5-35B-A3B shapes at TP=1 and TP=8 local, bf16 inputs, fp32 states, default precision):
- conv: within 1 bf16 ulp (rtol 1e-2) of torch, tails exact;
- delta rule: relative L2 error <= 1e-2 on outputs (bf16 rounding alone is ~2e-3) and <= 1e-2 on the states
  (tf32 dots); with fp32 inputs and "ieee" dots, <= 1e-4.
"""
import pytest
import torch
import torch.nn.functional as F

from layers import deltanet_prefill as dp
from layers.backend import triton
from tests.compare import max_diff, rel

pytestmark = pytest.mark.skipif(triton is None, reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PACK = [1, 63, 64, 65, 200]                  # chunk boundaries crossed and not
STARTS = [0, 9, 0, 130, 3]                   # some sequences continue from a cached state


@pytest.fixture
def exact_dots(monkeypatch):
    """fp32 comparisons: all dots in full fp32 (a no-op in the interpreter, which uses numpy)."""
    monkeypatch.setitem(dp.FAST_CONFIG, "precision", "ieee")
    monkeypatch.setitem(dp.FAST_CONFIG, "precision_prep", "ieee")
    monkeypatch.setitem(dp.FAST_CONFIG, "precision_solve", "ieee")


def packed(lens, starts, device=DEVICE, seed=0, num_slots=None):
    """cu_seqlens, start_pos and shuffled distinct slots for a pack of sequences."""
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    slots = torch.randperm(num_slots or 2 * len(lens), generator=gen)[:len(lens)].to(device)
    return cu, torch.tensor(starts, dtype=torch.int32, device=device), slots


def delta_inputs(N, Hk, Hv, dk, dv, dtype=torch.float32, device=DEVICE, seed=0):
    """q, k, v as strided views of one conv output row (as the layer splits it), g and beta as views of a wider
    tensor; g in the model's range (log decay in about [-3, 0])."""
    gen = torch.Generator().manual_seed(seed)
    c = torch.randn(N, 2 * Hk * dk + Hv * dv, generator=gen).to(device, dtype)
    q, k, v = c.split([Hk * dk, Hk * dk, Hv * dv], -1)
    gb = torch.randn(N, 2 * Hv + 1, generator=gen).to(device)
    g = F.logsigmoid(gb[:, :Hv] - 1.0)
    beta = gb[:, Hv + 1:].sigmoid()
    return q.view(N, Hk, dk), k.view(N, Hk, dk), v.view(N, Hv, dv), g, beta


def recurrence(q, k, v, g, beta, state, scale):
    """Spec §3.2 token by token, one sequence, fp32: state [Hv, dk, dv] -> (o [n, Hv, dv], state)."""
    rep = v.shape[1] // q.shape[1]
    norm = lambda x: x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    q = (norm(q.float()) * scale).repeat_interleave(rep, 1)
    k = norm(k.float()).repeat_interleave(rep, 1)
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        delta = (v[t].float() - torch.einsum("hkv,hk->hv", state, k[t])) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", state, q[t])
    return out, state


# ------------------------------------------------------------------------------------------------ conv
def conv_case(lens, starts, C, K, dtype=torch.float32, device=DEVICE, seed=0, num_slots=None):
    gen = torch.Generator().manual_seed(seed)
    N = sum(lens)
    wide = torch.randn(N, C + 24, generator=gen).to(device, dtype)
    u = wide[:, 8:8 + C]                                       # a strided view of a wider GEMM output
    weight = torch.randn(C, 1, K, generator=gen).to(device, dtype) * 0.5
    cu, sp, slots = packed(lens, starts, device, seed, num_slots)
    state = torch.randn(num_slots or 2 * len(lens), C, K - 1, generator=gen).to(device, dtype)
    return u, cu, sp, state, slots, weight


def test_conv_torch_equals_conv1d():
    """The oracle against F.conv1d over [cached tail | new inputs] per sequence (zeros for a fresh one)."""
    lens, starts, C, K = [1, 2, 5, 70], [4, 0, 1, 0], 12, 4
    u, cu, sp, state, slots, weight = conv_case(lens, starts, C, K, device="cpu")
    before = state.clone()
    out = dp.causal_conv1d_varlen_torch(u, cu, sp, state, slots, weight)
    for b, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        tail = before[slots[b]] if starts[b] > 0 else torch.zeros(C, K - 1)
        seq = torch.cat([tail, u[lo:hi].t()], 1)
        want = F.silu(F.conv1d(seq[None], weight, groups=C)[0]).t()
        assert max_diff(out[lo:hi], want) < 1e-5
        assert torch.equal(state[slots[b]], seq[:, -(K - 1):])


SHORT, SHORT_STARTS = [1, 2, 9, 0, 3, 6], [5, 2, 0, 7, 0, 1]


@pytest.mark.parametrize("C,K,block_t,lens,starts", [(72, 4, 64, PACK + [2, 0], STARTS + [5, 7]),
                                                     (40, 4, 4, SHORT, SHORT_STARTS),
                                                     (20, 3, 2, SHORT, SHORT_STARTS)])
def test_conv_fast_equals_torch(monkeypatch, C, K, block_t, lens, starts):
    """Odd channel counts (partial channel blocks), several token blocks per sequence (block_t 2 and 4: only the
    first block of a sequence may touch its tail), sequences shorter than the tail (it shifts), an empty one."""
    monkeypatch.setitem(dp.FAST_CONFIG, "conv_block_t", block_t)
    u, cu, sp, state, slots, weight = conv_case(lens, starts, C, K)
    ref_state = state.clone()
    want = dp.causal_conv1d_varlen_torch(u, cu, sp, ref_state, slots, weight)
    got = dp.causal_conv1d_varlen_fast(u, cu, sp, state, slots, weight)
    assert max_diff(got, want) < 1e-5
    assert torch.equal(state, ref_state)                      # tails in place, untouched slots unchanged


def test_conv_checkpoints():
    """Checkpoint tails: the tail a sequence would leave had it stopped at position p, written to another slot
    (p inside the new tokens, p within the first K-1 new tokens so that the old tail shows, p at the end)."""
    lens, starts, C, K = [10, 130, 1], [0, 6, 2], 24, 4
    u, cu, sp, state, slots, weight = conv_case(lens, starts, C, K, num_slots=8)
    spare = [s for s in range(state.shape[0]) if s not in slots.tolist()]
    ck = torch.tensor([[0, 3, spare[0]], [1, 7, spare[1]], [1, 6 + 64, spare[2]], [1, 136, spare[3]]],
                      device=DEVICE)
    before, ref_state = state.clone(), state.clone()
    want = dp.causal_conv1d_varlen_torch(u, cu, sp, ref_state, slots, weight, ck)
    got = dp.causal_conv1d_varlen_fast(u, cu, sp, state, slots, weight, ck)
    assert max_diff(got, want) < 1e-5
    assert torch.equal(state, ref_state)
    for b, p, dst in ck.tolist():  # the oracle's checkpoint is the tail of the same sequence cut at p
        lo, n = cu[b].item(), p - starts[b]
        cut = before.clone()
        dp.causal_conv1d_varlen_torch(u[lo:lo + n], torch.tensor([0, n], dtype=torch.int32, device=DEVICE),
                                      sp[b:b + 1], cut, slots[b:b + 1], weight)
        assert torch.equal(cut[slots[b]], ref_state[dst])


# ------------------------------------------------------------------------------------------------ delta rule
@pytest.mark.parametrize("chunk", [16, 64])
def test_delta_torch_equals_recurrence(chunk):
    """The chunked oracle against spec §3.2 token by token, with cached states and fresh ones."""
    Hk, Hv, dk, dv = 2, 4, 16, 16
    N = sum(PACK)
    q, k, v, g, beta = delta_inputs(N, Hk, Hv, dk, dv, device="cpu")
    cu, sp, slots = packed(PACK, STARTS, "cpu")
    state = torch.randn(2 * len(PACK), Hv, dk, dv) * 0.3
    before = state.clone()
    out = dp.chunk_delta_rule_varlen_torch(q, k, v, g, beta, cu, sp, state, slots, dk ** -0.5, chunk=chunk)
    for b, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        init = before[slots[b]] if STARTS[b] > 0 else torch.zeros(Hv, dk, dv)
        o, s = recurrence(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], init, dk ** -0.5)
        assert max_diff(out[lo:hi], o) < 2e-4
        assert max_diff(state[slots[b]], s) < 2e-4


if triton is not None:
    import triton.language as tl

    _diag_inverses_t = dp._diag_inverses_t

    @triton.jit
    def _inverse_kernel(scr_ptr, t_ptr, n, BLK: tl.constexpr):
        ii = tl.arange(0, BLK)
        x0, x1, x2, x3 = _diag_inverses_t(scr_ptr, 4 * BLK, n, BLK)
        out = t_ptr + ii[:, None] * BLK + ii[None, :]
        tl.store(out, tl.trans(x0))
        tl.store(out + BLK * BLK, tl.trans(x1))
        tl.store(out + 2 * BLK * BLK, tl.trans(x2))
        tl.store(out + 3 * BLK * BLK, tl.trans(x3))


@pytest.mark.parametrize("blk,n", [(16, 64), (16, 37), (16, 5), (32, 128)])
def test_diag_inverses(blk, n):
    """The prep kernel's diagonal-block solve: (I + D_r)^-1 of the four strictly lower diagonal blocks D_r of a
    chunk's A [4 blk, 4 blk] (|A_ij| <= 1/2) in scratch, against torch's triangular solve in fp64. The blocks off
    the diagonal must be ignored, and scratch rows past n hold garbage (NaN) that must be read as padding: zero
    rows of D, identity rows of the inverse."""
    gen = torch.Generator().manual_seed(blk + n)
    A = ((torch.rand(4 * blk, 4 * blk, generator=gen, dtype=torch.float64) * 2 - 1) * 0.5).tril(-1)
    A[n:] = 0
    D = torch.stack([A[r * blk:(r + 1) * blk, r * blk:(r + 1) * blk] for r in range(4)])
    eye = torch.eye(blk, dtype=torch.float64)
    want = torch.linalg.solve_triangular(eye + D, eye.expand(4, blk, blk), upper=False)
    scr = A.float().clone()
    scr[n:] = float("nan")
    T = torch.full((4, blk, blk), float("nan"), device=DEVICE)
    _inverse_kernel[(1,)](scr.to(DEVICE), T, n, BLK=blk)
    assert rel(T.cpu().double(), want) < 1e-5


@pytest.mark.parametrize("Hk,Hv,dk,dv,chunk", [(2, 4, 16, 16, 64), (1, 3, 16, 32, 64), (1, 2, 32, 16, 128),
                                                (1, 2, 16, 24, 64), (1, 1, 48, 48, 128), (2, 2, 48, 12, 64)])
def test_delta_fast_equals_torch(exact_dots, Hk, Hv, dk, dv, chunk):
    """A varlen pack (lengths 1, 63, 64, 65, 200 and an empty sequence), cached and fresh states, shuffled slots,
    strided q/k/v/g/beta; TP-local odd head counts (Hv = 3 Hk) and dk != dv; chunk 64 and 128; head dims that are
    not powers of two (24, 48; 12, below tl.dot's 16), on blocks padded to the next one."""
    lens, starts = PACK + [0], STARTS + [4]
    N = sum(lens)
    q, k, v, g, beta = delta_inputs(N, Hk, Hv, dk, dv)
    cu, sp, slots = packed(lens, starts)
    state = torch.randn(2 * len(lens), Hv, dk, dv, device=DEVICE) * 0.3
    ref_state = state.clone()
    want = dp.chunk_delta_rule_varlen_torch(q, k, v, g, beta, cu, sp, ref_state, slots, dk ** -0.5, chunk=chunk)
    got = dp.chunk_delta_rule_varlen_fast(q, k, v, g, beta, cu, sp, state, slots, dk ** -0.5, chunk=chunk)
    assert max_diff(got, want) < 2e-4
    assert max_diff(state, ref_state) < 2e-4                  # includes the slots nobody owns: unchanged


def test_delta_fast_half_inputs():
    """The model's case, half-precision q, k, v (the prep and output kernels form K K^T and Q K^T from the raw
    16-bit inputs, exact products summed in fp32, rows scaled by the inverse norms afterwards), default precisions:
    within the GPU test's tolerance of the fp32 oracle on the same inputs. fp16 on the CPU: Triton 3.9's interpreter
    gets tl.dot of bf16 operands wrong (errors ~1e10 on a plain [64, 16] x [16, 64] product, where fp16 and fp32 are
    exact); the GPU tests run bf16."""
    lens, starts = PACK, STARTS
    N = sum(lens)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    q, k, v, g, beta = delta_inputs(N, 1, 2, 16, 16, dtype=dtype, seed=5)
    cu, sp, slots = packed(lens, starts, seed=5)
    state = torch.randn(2 * len(lens), 2, 16, 16, device=DEVICE) * 0.3
    ref_state = state.clone()
    want = dp.chunk_delta_rule_varlen_torch(q, k, v, g, beta, cu, sp, ref_state, slots, 16 ** -0.5)
    got = dp.chunk_delta_rule_varlen_fast(q, k, v, g, beta, cu, sp, state, slots, 16 ** -0.5)
    assert got.dtype == dtype
    assert rel(got, want) < 1e-2
    assert rel(state, ref_state) < 1e-2


def test_delta_fast_decode_rows(exact_dots):
    """A mixed step's decodes are one-token sequences on cached states: fast equals the recurrence."""
    Hk, Hv, dk, dv, B = 2, 4, 16, 16, 6
    q, k, v, g, beta = delta_inputs(B, Hk, Hv, dk, dv, seed=3)
    cu, sp, slots = packed([1] * B, [17] * B, seed=3)
    state = torch.randn(2 * B, Hv, dk, dv, device=DEVICE) * 0.3
    before = state.clone()
    got = dp.chunk_delta_rule_varlen_fast(q, k, v, g, beta, cu, sp, state, slots, dk ** -0.5)
    for b in range(B):
        o, s = recurrence(q[b:b + 1], k[b:b + 1], v[b:b + 1], g[b:b + 1], beta[b:b + 1], before[slots[b]],
                          dk ** -0.5)
        assert max_diff(got[b:b + 1], o) < 2e-5
        assert max_diff(state[slots[b]], s) < 2e-5


@pytest.mark.parametrize("dk,dv", [(16, 16), (48, 24)])
def test_delta_checkpoints(exact_dots, dk, dv):
    """Checkpoint states at chunk multiples and at a sequence end, in spare slots: equal to the oracle's, and the
    oracle's equal to the final state of the same sequence cut there; head dims padded or not."""
    Hk, Hv, chunk = 1, 2, 64
    lens, starts = [140, 70, 5], [0, 12, 3]
    q, k, v, g, beta = delta_inputs(sum(lens), Hk, Hv, dk, dv, seed=5)
    cu, sp, slots = packed(lens, starts, seed=5, num_slots=10)
    spare = [s for s in range(10) if s not in slots.tolist()]
    ck = torch.tensor([[0, 64, spare[0]], [0, 128, spare[1]], [1, 12 + 64, spare[2]], [2, 8, spare[3]]],
                      device=DEVICE)
    state = torch.randn(10, Hv, dk, dv, device=DEVICE) * 0.3
    before, ref_state = state.clone(), state.clone()
    want = dp.chunk_delta_rule_varlen_torch(q, k, v, g, beta, cu, sp, ref_state, slots, dk ** -0.5, ck, chunk)
    got = dp.chunk_delta_rule_varlen_fast(q, k, v, g, beta, cu, sp, state, slots, dk ** -0.5, ck, chunk)
    assert max_diff(got, want) < 2e-4
    assert max_diff(state, ref_state) < 2e-4
    for b, p, dst in ck.tolist():
        lo, n = cu[b].item(), p - starts[b]
        init = before[slots[b]] if starts[b] > 0 else torch.zeros(Hv, dk, dv, device=DEVICE)
        _, s = recurrence(q[lo:lo + n], k[lo:lo + n], v[lo:lo + n], g[lo:lo + n], beta[lo:lo + n], init,
                          dk ** -0.5)
        assert max_diff(ref_state[dst], s) < 2e-4


# ------------------------------------------------------------------------------------------------ GPU, real shapes
REAL = {"tp1": (16, 32, 128, 128), "tp8": (2, 4, 128, 128)}   # Qwen3.5-35B-A3B: Hk, Hv, dk, dv per rank
GPU_PACK, GPU_STARTS = [1, 63, 64, 65, 200, 1024, 3], [0, 40, 0, 7, 0, 300, 64]


@pytest.mark.gpu
@pytest.mark.parametrize("tp", sorted(REAL))
def test_gpu_conv_real_shapes(tp):
    Hk, Hv, dk, dv = REAL[tp]
    u, cu, sp, state, slots, weight = conv_case(GPU_PACK, GPU_STARTS, 2 * Hk * dk + Hv * dv, 4, torch.bfloat16)
    ref_state = state.clone()
    want = dp.causal_conv1d_varlen_torch(u, cu, sp, ref_state, slots, weight)
    got = dp.causal_conv1d_varlen_fast(u, cu, sp, state, slots, weight)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(state, ref_state)


@pytest.mark.gpu
@pytest.mark.parametrize("tp", sorted(REAL))
def test_gpu_delta_real_shapes(tp):
    Hk, Hv, dk, dv = REAL[tp]
    q, k, v, g, beta = delta_inputs(sum(GPU_PACK), Hk, Hv, dk, dv, torch.bfloat16)
    cu, sp, slots = packed(GPU_PACK, GPU_STARTS)
    state = torch.randn(2 * len(GPU_PACK), Hv, dk, dv, device=DEVICE) * 0.3
    ref_state = state.clone()
    want = dp.chunk_delta_rule_varlen_torch(q, k, v, g, beta, cu, sp, ref_state, slots, dk ** -0.5)
    got = dp.chunk_delta_rule_varlen_fast(q, k, v, g, beta, cu, sp, state, slots, dk ** -0.5)
    assert got.dtype == torch.bfloat16
    assert rel(got, want) < 1e-2
    assert rel(state, ref_state) < 1e-2
    for b, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):  # no sequence hides in the average
        assert rel(got[lo:hi], want[lo:hi]) < 2e-2, b


@pytest.mark.gpu
def test_gpu_delta_ieee_fp32(exact_dots):
    """With fp32 inputs and full-precision dots the kernels compute the oracle's function to fp32 rounding."""
    Hk, Hv, dk, dv = REAL["tp8"]
    q, k, v, g, beta = delta_inputs(sum(GPU_PACK), Hk, Hv, dk, dv)
    cu, sp, slots = packed(GPU_PACK, GPU_STARTS)
    state = torch.randn(2 * len(GPU_PACK), Hv, dk, dv, device=DEVICE) * 0.3
    ref_state = state.clone()
    want = dp.chunk_delta_rule_varlen_torch(q, k, v, g, beta, cu, sp, ref_state, slots, dk ** -0.5)
    got = dp.chunk_delta_rule_varlen_fast(q, k, v, g, beta, cu, sp, state, slots, dk ** -0.5)
    assert rel(got, want) < 1e-4
    assert rel(state, ref_state) < 1e-4
