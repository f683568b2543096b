"""Speculative sampling on vocabulary shards (layers/spec_sampling.py: draft_fast / verify_fast against the gathered
reference draft_torch / verify_torch), on the CPU with the Triton passes through the interpreter:

- TP=1 and TP=2 (gloo, one process per rank): the same drafts (tokens exactly, log-sum-exp to rounding) and the
  same emitted tokens and counts for greedy, sampled and mixed batches, fewer drafts on some rows, and drafts that
  are mostly accepted (q close to p) as well as mostly rejected (q far from p), on every rank.
The fast path's p and q may differ from the reference's in the last bits (module comment): on these cases no
decision lies that close, so the tokens must be equal. Each kernel against its torch twin, and more ranks (simulated
in one process): tests/test_spec_fused.py.
"""
import os

import pytest
import torch
import torch.multiprocessing as mp

from layers import spec_sampling as ss
from layers.sampler import SampleBatch

from hf_reference import free_port, join_ranks

V = 2600       # padded vocabulary: 3 blocks per row at TP=1, shards of 1300 at TP=2
REAL = V - 37  # the real tokens (padding inside the last shard)


def batch(temps, key0=11, counter0=5, greedy_only=False) -> SampleBatch:
    n = len(temps)
    return SampleBatch(torch.tensor(temps, dtype=torch.float32), torch.zeros(n), torch.ones(n),
                       torch.arange(key0, key0 + n), torch.arange(counter0, counter0 + n) * 3, None,
                       greedy_only, False, False)


def cases():
    """(name, target logits [B, T, V], draft logits [B, k, V], batch, num_drafts), the same in every process."""
    g = torch.Generator().manual_seed(0)
    out = []
    for name, temps, spread, near in (("sampled_near", [1.0, 0.7, 1.3], 3.0, 0.2),
                                      ("sampled_far", [1.0, 1.0, 0.9, 1.0], 3.0, 3.0),
                                      ("mixed", [0.0, 1.0, 0.0, 0.8], 2.0, 0.3),
                                      ("greedy", [0.0, 0.0], 4.0, 0.5)):
        B, k = len(temps), 3
        target = torch.randn(B, k + 1, V, generator=g) * spread
        draft = target[:, :k] + torch.randn(B, k, V, generator=g) * near
        b = batch(temps, greedy_only=name == "greedy")
        out.append((name, target, draft, b, None))
        out.append((name + "_fewer", target, draft, b, torch.tensor([k, 1, 0, 2][:B])))
    return out


def draw_all(draft_fn, target_shard, draft_shard, b, num_drafts, real, vocab):
    """Draft k tokens per row from the draft logits (position j at counter + j), then verify: (drafts, lse, tokens,
    counts)."""
    import dataclasses
    k = draft_shard.shape[1]
    ds = [draft_fn(draft_shard[:, j], None if b.greedy_only else dataclasses.replace(b, counter=b.counter + j),
                   real, vocab) for j in range(k)]
    return torch.stack([d.tokens for d in ds], 1), torch.stack([d.lse for d in ds], 1)


def run_both(target, draft, b, num_drafts, rank=0, world=1):
    """Every result of both paths on this rank's shards."""
    size = V // world
    sl = slice(rank * size, (rank + 1) * size)
    t, d = target[..., sl].contiguous(), draft[..., sl].contiguous()
    out = {}
    for name, (draft_fn, verify_fn) in {"fast": (ss.draft_fast, ss.verify_fast),
                                        "torch": (ss.draft_torch, ss.verify_torch)}.items():
        tokens, lse = draw_all(draft_fn, t, d, b, num_drafts, REAL, V)
        verdict = verify_fn(t, tokens, d, lse, None if b.greedy_only else b, num_drafts, REAL, V)
        out[name] = (tokens, lse, verdict.tokens, verdict.num_emitted)
    return out


def check(out, name):
    (ft, fl, fv, fn), (tt, tl_, tv, tn) = out["fast"], out["torch"]
    assert torch.equal(ft, tt), (name, ft.tolist(), tt.tolist())
    assert torch.allclose(fl, tl_, rtol=1e-5, atol=1e-5), name
    assert torch.equal(fv, tv), (name, fv.tolist(), tv.tolist())
    assert torch.equal(fn, tn), name
    assert int(ft.max()) < REAL and int(fv.max()) < REAL


def test_shards_at_tp1_give_the_references_tokens():
    seen = set()
    for name, target, draft, b, num in cases():
        out = run_both(target, draft, b, num)
        check(out, name)
        seen.update(out["fast"][3].tolist())
    assert len(seen) >= 3  # rows emitted different counts: accepted and rejected drafts both verified


def _worker(rank, world, port, out_dir):
    join_ranks(rank, world, port, "cpu")
    from dist import parallel
    try:
        got = {name: run_both(t, d, b, num, rank, world) for name, t, d, b, num in cases()}
        torch.save(got, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        parallel.destroy()


def test_shards_at_tp2_give_the_references_tokens(tmp_path):
    mp.start_processes(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for name, target, draft, b, num in cases():
        want = run_both(target, draft, b, num)["torch"]  # one process, whole rows
        for r in range(2):
            check(ranks[r][name], name)
            assert all(torch.equal(x, y) if x.dtype == torch.int64 else torch.allclose(x, y, rtol=1e-5, atol=1e-5)
                       for x, y in zip(ranks[r][name]["fast"], want)), (name, r)


@pytest.mark.gpu
def test_gpu_passes_and_paths_at_real_shard_sizes():
    """The passes against their twins on a TP=4 shard of the real vocabulary, and draft / verify against the
    reference at TP=1 on a GPU (the kernels compiled, not interpreted)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    import dataclasses
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(2)
    B, T, n, start = 8, 3, 248320 // 4, 3 * 248320 // 4
    n_valid = n - 77
    p, q = torch.randn(B, T, n, generator=g, device=dev) * 4, torch.randn(B, T - 1, n, generator=g, device=dev) * 4
    one = torch.ones(B, device=dev)
    b = SampleBatch(torch.rand(B, generator=g, device=dev) + 0.5, one * 0, one,
                    torch.arange(B, device=dev) * 5 + 3, torch.arange(B, device=dev) + 9, None, False, False, False)
    inv_t = b.inv_temperature
    a = ss.stats_fast(p[:, 0], n_valid, start, ss.DRAFT_ID_OFFSET, b, sampled=True)
    want = ss.stats_torch(p[:, 0], n_valid, start, ss.DRAFT_ID_OFFSET, inv_t, b.key, b.counter, True)
    assert torch.equal(a[:, [0, 1, 3, 4, 5]], want[:, [0, 1, 3, 4, 5]])
    assert torch.allclose(a[:, 2], want[:, 2], rtol=1e-4)
    drafts = torch.randint(start - n // 2, start + n, (B, T - 1), generator=g, device=dev)
    a = ss.stats_fast(p.view(B * T, n), n_valid, start, 0, b, T, drafts=drafts, draft_logits=q.view(-1, n))
    rows = ss.at_positions(b, T)
    want = ss.stats_torch(p.view(B * T, n), n_valid, start, 0, rows.inv_temperature, rows.key, rows.counter, False,
                          True)
    assert torch.equal(a[:, [0, 1, 3, 4, 5]], want[:, [0, 1, 3, 4, 5]])
    assert torch.allclose(a[:, 2], want[:, 2], rtol=1e-4)
    i = torch.arange(B, device=dev)
    emitted = i % T + 1
    at, jq = emitted - 1, (emitted - 1).clamp(max=T - 2)
    lse_p = (p[i, at] * inv_t[:, None])[:, :n_valid].logsumexp(-1)
    draft_lse = (q * inv_t[:, None, None])[..., :n_valid].logsumexp(-1)
    a = ss.residual_fast(p, q, n_valid, start, b, emitted, lse_p, draft_lse)
    want = ss.residual_torch(p[i, at], q[i, jq], n_valid, start, inv_t, lse_p, draft_lse[i, jq], b.key,
                             b.counter + at)
    assert torch.equal(a[:, [1, 4]], want[:, [1, 4]])
    assert torch.allclose(a[:, [0, 2, 3]], want[:, [0, 2, 3]], rtol=1e-4)
    for name, target, draft, bt, num in cases():
        moved = [x.to(dev) if isinstance(x, torch.Tensor) else x for x in (target, draft)]
        bt = dataclasses.replace(bt, **{f.name: getattr(bt, f.name).to(dev) for f in dataclasses.fields(bt)
                                        if isinstance(getattr(bt, f.name), torch.Tensor)})
        check(run_both(*moved, bt, None if num is None else num.to(dev)), name)
