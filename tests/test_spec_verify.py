"""Speculative verify steps (layers/deltanet_verify.py, ForwardBatch.verify_tokens): a verify step of T tokens per
sequence computes what T single decode steps compute, and rollback leaves nothing of the rejected tokens behind.

- ops, a chain of two verify steps: verify_torch's outputs == T decode_torch steps, the state that of one decode
  step (the newest token, always accepted) and the tail untouched; commit_torch(counts) moves the tails as counts[b]
  decode steps; the accepted drafts pending, a second verify (other T) == decode steps from the state after the
  first's accepted tokens, and so do a decode_torch step with the replay and settle_torch; all exact (torch.equal)
  in fp32: the same ops token by token. Odd dims (dk 5, dv 6, 3 value heads on 1 key head), conv kernels 2 and 4,
  T = 1..4, counts 1..T, slots out of order.
- fast == torch through Triton's interpreter (the same chain, T = 2..4, fp32): outputs, states and replay rows
  within TOL_FAST (fp32: the kernels' sums run in another order), conv tails bit-exact (data movement), slots outside
  the batch untouched; with the value columns of a head split over programs (dv 10 in slabs of 4) and unsplit.
- GPU (real Qwen3.5-35B-A3B shapes at TP=1 and TP=8 local, bf16 proj and tails, fp32 states): verify_fast == T
  decode_fast steps within the decode kernel's bf16 tolerances (rtol = atol = 2e-2, relative L2 <= 5e-3; the two
  kernels compute the same function with different launch shapes), commit_fast(counts) and settle_fast == counts
  decode_fast steps: states within 1e-2, conv tails bit-exact.
- model (the tiny preset with its MTP head, fp32, CPU, torch kernels): a verify batch's hidden states == T single
  decode steps' (TOL: the mixed-step attention against the decode attention, same fp32 function); after commit(n),
  pending n - 1 and one more decode step from the accepted tokens, the hidden state == a sequence that only ever saw
  the accepted tokens (KV and conv tail rollback, TOL), DeltaNet states (settled) within TOL; the MTP head's catch-up
  over the verify batch == over the accepted tokens at the last accepted row (its own KV left consistent).
"""
import pytest
import torch

from layers import deltanet as dn
from layers.deltanet_verify import (VerifyStep, commit_fast, commit_torch, settle_fast, settle_torch, verify_fast,
                                    verify_torch)
from tests.test_kernels_deltanet import tiny_cfg

TOL = 1e-5
TOL_FAST = 1e-5
EPS = 1e-6
SLOTS, K_MAX = 8, 4


def make_layer(hk, hv, dk, dv, kernel, slots=SLOTS, seed=0):
    from layers import backend
    torch.manual_seed(seed)
    with backend.use_kernels("torch"):
        layer = dn.GatedDeltaNet(tiny_cfg(hk, hv, dk, dv, kernel))
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    layer.conv_state = torch.randn(slots, layer.conv_dim, kernel - 1)
    layer.ssm_state = torch.randn(slots, hv, dk, dv)
    dn.allocate_replay([layer], slots, K_MAX, torch.float32, "cpu")
    return layer


def proj_rows(layer, n, seed):
    g = torch.Generator().manual_seed(seed)
    width = layer.conv_dim + layer.num_v_heads * layer.dv + 2 * layer.num_v_heads
    p = torch.randn(n, width, generator=g)
    p[:, -layer.num_v_heads:] *= 8  # a: softplus inputs on both sides of its threshold now and then
    return p


def args(layer):
    return (layer.conv1d.weight, layer.A_log, layer.dt_bias)


class Caches:
    """One layer's caches as a verify chain moves them: tails, states, replay rows and pending counts (copies)."""
    def __init__(self, layer):
        self.conv, self.ssm = layer.conv_state.clone(), layer.ssm_state.clone()
        self.replay, self.pending = layer.replay.clone(), layer.pending.clone()

    def verify(self, layer, op, proj, slots, T, row=0):
        return op(proj, self.conv, self.ssm, slots, *args(layer), layer.norm.weight, EPS, T, self.replay,
                  self.pending, row)

    def commit(self, op, proj, slots, T, counts, row=0):
        op([VerifyStep(proj, self.conv, slots, T, row)], counts)
        self.pending[slots] = counts - 1

    def settle(self, layer, op, slots):
        op(self.ssm, slots, self.replay, self.pending, layer.A_log, layer.dt_bias)
        self.pending[slots] = 0

    def decode(self, layer, op, proj, slots):
        y = op(proj, self.conv, self.ssm, slots, *args(layer), layer.norm.weight, EPS, None, self.replay,
               self.pending)
        self.pending[slots] = 0
        return y


def decode_steps(layer, proj, slots, T, conv, ssm):
    """T decode_torch steps on copies of the caches: per step the outputs, and the caches after each step."""
    B = slots.shape[0]
    rows = proj.view(B, T, -1)
    outs, after = [], []
    conv, ssm = conv.clone(), ssm.clone()
    for t in range(T):
        outs.append(dn.decode_torch(rows[:, t].contiguous(), conv, ssm, slots, *args(layer), layer.norm.weight, EPS))
        after.append((conv.clone(), ssm.clone()))
    return torch.stack(outs, 1).flatten(0, 1), after


def taken(after, slots, counts, conv, ssm):
    """The caches with each slot as after its counts[b] steps (others as given)."""
    conv, ssm = conv.clone(), ssm.clone()
    for slot, n in zip(slots.tolist(), counts):
        conv[slot], ssm[slot] = after[n - 1][0][slot], after[n - 1][1][slot]
    return conv, ssm


@pytest.mark.parametrize("dims", [(1, 3, 5, 6, 4), (2, 2, 4, 3, 2)])
@pytest.mark.parametrize("T", [1, 2, 3, 4])
def test_verify_chain_equals_single_decode_steps(dims, T):
    """verify (T) -> commit(counts) -> verify (T2, from the pending drafts) -> commit -> a decode step with the replay
    / a settle: every output and cache as single decode steps over the accepted tokens only."""
    layer = make_layer(*dims)
    slots = torch.tensor([5, 1, 6])
    T2 = 5 - T if T > 1 else 3
    proj, proj2, proj3 = proj_rows(layer, 3 * T, seed=T), proj_rows(layer, 3 * T2, seed=9 + T), proj_rows(layer, 3, 7)
    start = Caches(layer)
    expected, after = decode_steps(layer, proj, slots, T, start.conv, start.ssm)
    for counts, counts2 in (([1, T, 1], [T2, 1, T2]), ([T, (T + 1) // 2, max(1, T - 1)], [1, T2, (T2 + 1) // 2])):
        c = Caches(layer)
        y = c.verify(layer, verify_torch, proj, slots, T)
        assert torch.equal(y, expected)
        assert torch.equal(c.conv, start.conv) and torch.equal(c.ssm, after[0][1])  # the first token's
        c.commit(commit_torch, proj, slots, T, torch.tensor(counts))
        conv1, ssm1 = taken(after, slots, counts, start.conv, start.ssm)
        assert torch.equal(c.conv, conv1)
        settled = Caches(layer)
        settled.__dict__.update({k: v.clone() for k, v in c.__dict__.items()})
        settled.settle(layer, settle_torch, slots)
        assert torch.equal(settled.ssm, ssm1)
        # the second verify step replays the accepted drafts first
        expected2, after2 = decode_steps(layer, proj2, slots, T2, conv1, ssm1)
        y2 = c.verify(layer, verify_torch, proj2, slots, T2)
        assert torch.equal(y2, expected2) and torch.equal(c.ssm[slots], after2[0][1][slots])
        c.commit(commit_torch, proj2, slots, T2, torch.tensor(counts2))
        conv2, ssm2 = taken(after2, slots, counts2, conv1, ssm1)
        # a decode step takes the pending drafts first
        y3, after3 = decode_steps(layer, proj3, slots, 1, conv2, ssm2)
        assert torch.equal(c.decode(layer, dn.decode_torch, proj3, slots), y3)
        assert torch.equal(c.conv, after3[0][0]) and torch.equal(c.ssm[slots], after3[0][1][slots])
        others = [s for s in range(SLOTS) if s not in slots.tolist()]
        assert torch.equal(c.conv[others], start.conv[others]) and torch.equal(c.ssm[others], start.ssm[others])


def close(a, b):
    return a.numel() == 0 or (a - b).abs().max().item() <= TOL_FAST


@pytest.mark.parametrize("dims", [(1, 3, 5, 6, 4), (2, 2, 4, 10, 2)])
@pytest.mark.parametrize("T", [2, 3, 4])  # (a verify step has a draft or more; the torch chain covers T = 1)
@pytest.mark.parametrize("block_v", [4, 64])
def test_fast_equals_torch(dims, T, block_v, monkeypatch):
    monkeypatch.setitem(dn.DECODE_CONFIG, "block_v", block_v)
    monkeypatch.setitem(dn.DECODE_CONFIG, "batched_block_v", block_v)
    layer = make_layer(*dims)
    slots = torch.tensor([5, 1, 6])
    T2 = 5 - T if T > 1 else 3
    proj, proj2, proj3 = proj_rows(layer, 3 * T, 10 + T), proj_rows(layer, 3 * T2, 20 + T), proj_rows(layer, 3, 3)
    start = Caches(layer)
    others = [s for s in range(SLOTS) if s not in slots.tolist()]
    for counts, counts2 in (([1, T, 1], [T2, 1, T2]), ([T, (T + 1) // 2, max(1, T - 1)], [1, T2, (T2 + 1) // 2])):
        want, got = Caches(layer), Caches(layer)
        for t_op, f_op, p, n_tok, counts_ in ((verify_torch, verify_fast, proj, T, counts),
                                             (verify_torch, verify_fast, proj2, T2, counts2)):
            y_t = want.verify(layer, t_op, p, slots, n_tok)
            y_f = got.verify(layer, f_op, p, slots, n_tok)
            assert close(y_f, y_t)
            assert torch.equal(got.conv, want.conv) and close(got.ssm, want.ssm)
            assert close(got.replay[:, :n_tok - 1], want.replay[:, :n_tok - 1])
            n = torch.tensor(counts_)
            want.commit(commit_torch, p, slots, n_tok, n)
            got.commit(commit_fast, p, slots, n_tok, n)
            assert torch.equal(got.conv, want.conv)
        settled_t, settled_f = Caches(layer), Caches(layer)
        for dst, src in ((settled_t, want), (settled_f, got)):
            dst.__dict__.update({k: v.clone() for k, v in src.__dict__.items()})
        settled_t.settle(layer, settle_torch, slots)
        settled_f.settle(layer, settle_fast, slots)
        assert close(settled_f.ssm, settled_t.ssm)
        assert close(got.decode(layer, dn.decode_fast, proj3, slots), want.decode(layer, dn.decode_torch, proj3, slots))
        assert torch.equal(got.conv, want.conv) and close(got.ssm, want.ssm)
        assert torch.equal(got.ssm[others], start.ssm[others]) and torch.equal(got.conv[others], start.conv[others])


def test_fast_verify_refuses_a_conv_kernel_over_4_taps_and_torch_takes_it():
    layer = make_layer(1, 2, 4, 4, 5)  # (the fast kernel slides a window of 3 inputs: every Qwen3.5 has 4 taps)
    slots, proj = torch.tensor([1]), proj_rows(layer, 2, 7)
    c = Caches(layer)
    with pytest.raises(ValueError, match="at most 4 taps"):
        c.verify(layer, verify_fast, proj, slots, 2)
    assert torch.equal(c.ssm, layer.ssm_state) and torch.equal(c.conv, layer.conv_state)  # nothing written
    assert torch.isfinite(c.verify(layer, verify_torch, proj, slots, 2)).all()


def test_commit_fast_commits_every_layer_in_one_launch(monkeypatch):
    """Three layers of one shape (each its own caches, weights and proj rows), verified into rows 0..2 of the commit
    table, committed by one commit_fast launch: each layer's tails equal commit_torch's of that layer (bit-exact),
    slots outside the batch untouched. A step out of its row, or a layer of another shape, is refused before
    anything is written."""
    from layers import deltanet_verify as dv
    monkeypatch.setitem(dn.DECODE_CONFIG, "block_v", 4)
    T = 2
    layers = [make_layer(1, 3, 5, 6, 4, seed=s) for s in range(3)]
    slots = torch.tensor([5, 1])
    n = torch.tensor([2, 1])
    projs = [proj_rows(m, 2 * T, seed=20 + i) for i, m in enumerate(layers)]
    start = [m.conv_state.clone() for m in layers]
    want = []
    for m, proj in zip(layers, projs):
        c = Caches(m)
        c.verify(m, verify_torch, proj, slots, T)
        c.commit(commit_torch, proj, slots, T, n)
        want.append(c.conv)
    steps = []
    for row, (m, proj) in enumerate(zip(layers, projs)):
        verify_fast(proj, m.conv_state, m.ssm_state, slots, *args(m), m.norm.weight, EPS, T, m.replay, m.pending, row)
        steps.append(VerifyStep(proj, m.conv_state, slots, T, row))
    with pytest.raises(RuntimeError, match="row 1"):
        commit_fast([steps[0], steps[2]], n)  # layer 2's step where row 1 is expected
    other = make_layer(2, 2, 4, 3, 2)
    proj_o = proj_rows(other, 2 * T, seed=1)
    verify_fast(proj_o, other.conv_state, other.ssm_state, slots, *args(other), other.norm.weight, EPS, T,
                other.replay, other.pending, 1)
    with pytest.raises(ValueError, match="one launch commits layers of one kind"):
        commit_fast([steps[0], VerifyStep(proj_o, other.conv_state, slots, T, 1)], n)
    assert all(torch.equal(m.conv_state, c) for m, c in zip(layers, start))  # nothing written by the refusals
    verify_fast(projs[1], layers[1].conv_state, layers[1].ssm_state, slots, *args(layers[1]), layers[1].norm.weight,
                EPS, T, layers[1].replay, layers[1].pending, 1)  # (row 1 names layer 1 again)
    grids, kernel = [], dv._commit_kernel

    class Counted:  # _commit_kernel[grid](...), each grid noted
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]
    monkeypatch.setattr(dv, "_commit_kernel", Counted())
    commit_fast(steps, n)
    assert len(grids) == 1 and grids[0][2] == 3, grids  # one launch, a grid plane per layer
    others = [s for s in range(SLOTS) if s not in slots.tolist()]
    for m, conv, conv0 in zip(layers, want, start):
        assert torch.equal(m.conv_state, conv)
        assert torch.equal(m.conv_state[others], conv0[others])


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 8])
def test_gpu_verify_fast_equals_decode_steps_bf16(tp, monkeypatch):
    from tests.compare import max_diff, rel
    from tests.test_kernels_deltanet import decode_args, random_proj, real_layer
    m = real_layer("fast", tp, monkeypatch, 40)
    dn.allocate_replay([m], 40, 3, torch.bfloat16, "cuda")
    gen = torch.Generator().manual_seed(tp)
    for B, T in ((1, 2), (7, 4), (32, 3)):
        slots = torch.randperm(39, generator=gen)[:B].cuda()
        proj = random_proj(m, B * T, gen, "cuda", torch.bfloat16)
        start = m.conv_state.clone(), m.ssm_state.clone()
        steps, after = [], []
        for t in range(T):
            steps.append(dn.decode_fast(*decode_args(m, proj.view(B, T, -1)[:, t].contiguous(), slots)))
            after.append((m.conv_state.clone(), m.ssm_state.clone()))
        want = torch.stack(steps, 1).flatten(0, 1)
        m.conv_state.copy_(start[0])
        m.ssm_state.copy_(start[1])
        m.pending.zero_()
        got = verify_fast(proj, m.conv_state, m.ssm_state, slots, m.conv1d.weight, m.A_log, m.dt_bias, m.norm.weight,
                          m.norm.eps, T, m.replay, m.pending)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
        assert rel(got, want) <= 5e-3
        counts = torch.randint(1, T + 1, (B,), generator=gen).cuda()
        commit_fast([VerifyStep(proj, m.conv_state, slots, T, 0)], counts)
        m.pending[slots] = counts - 1
        settle_fast(m.ssm_state, slots, m.replay, m.pending, m.A_log, m.dt_bias)
        for b, (slot, n) in enumerate(zip(slots.tolist(), counts.tolist())):
            assert torch.equal(m.conv_state[slot], after[n - 1][0][slot])
            assert max_diff(m.ssm_state[slot], after[n - 1][1][slot]) <= 1e-2


# ------------------------------------------------------------------------------------------------ the model
def caches(model):
    from layers.attention import GatedAttention
    out = []
    for m in model.modules():
        if isinstance(m, GatedAttention):
            out += [m.k_cache, m.v_cache]
        if isinstance(m, dn.GatedDeltaNet):
            out += [m.conv_state, m.ssm_state]
    return out


def save(model):
    return [t.clone() for t in caches(model)]


def restore(model, saved):
    for t, s in zip(caches(model), saved):
        t.copy_(s)


def verify_batch(rows, T):
    """rows (slot, T tokens, start) as the runner builds a verify step: every row its own query (its sequence's
    block table, its length)."""
    import dataclasses
    from tests.test_mtp import batch_of
    b = batch_of(rows)
    return dataclasses.replace(b, is_decode=False, verify_tokens=T, block_tables=b.block_tables.repeat_interleave(
        T, dim=0), context_lens=(b.positions + 1).to(torch.int32))


@pytest.fixture(scope="module")
def tiny():
    from qwen35.config import ModelConfig
    from qwen35.runner import init_dummy_weights
    from tests.test_mtp import build, small_vocab
    model = build(ModelConfig.from_dict(small_vocab(512)))
    init_dummy_weights(model, seed=3)
    dn.allocate_replay([m for m in model.modules() if isinstance(m, dn.GatedDeltaNet)], 8, 4, torch.float32, "cpu")
    return model


@pytest.mark.parametrize("T", [1, 3, 4])
def test_model_verify_step_equals_single_steps_and_rolls_back(tiny, T):
    from qwen35.mtp import catch_up
    from tests.test_mtp import batch_of
    model = tiny
    gen = torch.Generator().manual_seed(T)
    prompts = [torch.randint(0, 400, (n,), generator=gen).tolist() for n in (5, 9, 17)]
    slots = [3, 0, 7]
    drafts = [torch.randint(0, 400, (T,), generator=gen).tolist() for _ in prompts]
    nxt = torch.randint(0, 400, (3,), generator=gen)
    counts = [1, T, max(1, T - 1)]
    with torch.inference_mode():
        b = batch_of([(s, p, 0) for s, p in zip(slots, prompts)])
        h = model(b)
        catch_up(model, b, h, nxt, b.logits_indices)  # the head's KV over the prompts
        prefilled = save(model)
        starts = [len(p) for p in prompts]
        # the reference: T single decode steps, the caches after each
        ref, after = [], []
        for j in range(T):
            ref.append(model(batch_of([(s, [d[j]], st + j) for s, d, st in zip(slots, drafts, starts)])))
            after.append(save(model))
        ref = torch.stack(ref, 1).flatten(0, 1)
        # the verify step from the prefilled caches
        restore(model, prefilled)
        vb = verify_batch([(s, d, st) for s, d, st in zip(slots, drafts, starts)], T)
        hv = model(vb)
        assert (hv - ref).abs().max().item() <= TOL
        n = torch.tensor(counts)
        last = torch.arange(3) * T + n - 1
        newest = nxt + 1
        h_mtp = catch_up(model, vb, hv, newest, last)
        mods = [m for m in model.modules() if isinstance(m, dn.GatedDeltaNet)]
        dn.commit(mods, n)
        mods[0].pending[slots] = n - 1
        pending = save(model)  # (the accepted drafts pending)
        dn.settle(mods, torch.tensor(slots))
        spec_caches = save(model)
        # reference caches: DeltaNet states after counts[b] steps per sequence; KV of the full run (positions past
        # a sequence's accepted ones are rewritten before they are read)
        restore(model, after[-1])
        for li, m in enumerate(mods):
            for s, c in zip(slots, counts):
                step = after[c - 1]
                idx = [i for i, t in enumerate(caches(model)) if t is m.conv_state][0]
                m.conv_state[s] = step[idx][s]
                m.ssm_state[s] = step[idx + 1][s]
                spec = spec_caches[idx], spec_caches[idx + 1]
                assert (spec[0][s] - m.conv_state[s]).abs().max().item() <= TOL
                assert (spec[1][s] - m.ssm_state[s]).abs().max().item() <= TOL
        # one more step from the accepted tokens: the same as a sequence that never saw the rejected ones, from the
        # settled states and from the pending drafts (the step takes them first)
        step = [(s, [int(x)], st + c) for s, x, st, c in zip(slots, nxt, starts, counts)]
        h_ref = model(batch_of(step))
        for caches_before in (spec_caches, pending):
            restore(model, caches_before)
            mods[0].pending[slots] = 0 if caches_before is spec_caches else n - 1
            h_spec = model(batch_of(step))
            assert (h_spec - h_ref).abs().max().item() <= TOL
            assert not mods[0].pending.any()  # (the step took them)
        # the head's catch-up over the accepted tokens alone (a chunk of them per sequence) at the last accepted row
        restore(model, prefilled)
        acc = batch_of([(s, d[:c], st) for s, d, st, c in zip(slots, drafts, starts, counts)])
        rows = torch.cat([torch.arange(c) + i * T for i, c in enumerate(counts)])
        h_acc = catch_up(model, acc, ref[rows], newest, acc.cu_seqlens[1:].long() - 1)
        assert (h_mtp - h_acc).abs().max().item() <= TOL


@pytest.mark.timeout(900)
def test_fast_kernels_compile_for_hopper():
    """verify_fast's, commit_fast's, settle_fast's and the replaying decode_fast's launches (bf16 storage, the tiny
    preset's head dims: dk = dv = 16, 2 value heads per key head) compile for sm_90 through Triton's compiler and ptxas
    (tests/hopper_compile.py)."""
    from tests.hopper_compile import compile_all, hopper_backend_available, recorded
    if not hopper_backend_available():
        pytest.skip("this Triton has no NVIDIA backend to compile with")
    layer = make_layer(2, 4, 16, 16, 4)
    conv, ssm = layer.conv_state.bfloat16(), layer.ssm_state
    w = [t.bfloat16() if t is not layer.A_log else t for t in args(layer)]
    T, slots = 3, torch.tensor([5, 1])
    proj = proj_rows(layer, 2 * T, seed=1).bfloat16()
    replay = layer.replay.bfloat16()
    with recorded() as launches:
        verify_fast(proj, conv, ssm, slots, *w, layer.norm.weight, EPS, T, replay, layer.pending)
        commit_fast([VerifyStep(proj, conv, slots, T, 0)], torch.tensor([1, 3]))
        settle_fast(ssm, slots, replay, layer.pending, w[1], w[2])
        dn.decode_fast(proj[:2], conv, ssm, slots, *w, layer.norm.weight, EPS, None, replay, layer.pending)
    names = {e["name"] for e in launches}
    assert {"_verify_kernel", "_commit_kernel", "_settle_kernel", "_decode_kernel"} <= names, names
    assert compile_all(launches) == []
