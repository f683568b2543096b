"""create_engine: prefill/decode/remove semantics and logits against transformers (fp32, max |diff| <= 1e-4)."""
import json
import os

import pytest
import torch

from qwen35.api import create_engine
from tests.hf_reference import build_hf_model, hf_decode_logits

TOL = 1e-4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    hf = build_hf_model("moe", seed=7)
    path = str(tmp_path_factory.mktemp("api"))
    hf.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    return hf, path, cfg


def prompts(seed, lengths):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1024, (n,), generator=g) for n in lengths]


def test_interleaved_requests_match_transformers(setup):
    hf, path, cfg = setup
    eng = create_engine(cfg, path, device="cpu", max_num_seqs=4)
    a, b = prompts(0, [20, 70])
    steps_a, steps_b = [3, 4, 5], [9, 8]
    ref_a = hf_decode_logits(hf, a.tolist(), steps_a)
    ref_b = hf_decode_logits(hf, b.tolist(), steps_b)
    out = eng.prefill(["a"], [a])
    assert out.shape == (1, 1024) and out.dtype == torch.float32
    assert (out[0] - ref_a[0]).abs().max() <= TOL
    out = eng.prefill(["b"], [b])
    assert (out[0] - ref_b[0]).abs().max() <= TOL
    out = eng.decode(["b", "a"], torch.tensor([steps_b[0], steps_a[0]]))  # row i belongs to request_ids[i]
    assert (out[0] - ref_b[1]).abs().max() <= TOL and (out[1] - ref_a[1]).abs().max() <= TOL
    out = eng.decode(["a"], torch.tensor([steps_a[1]]))
    assert (out[0] - ref_a[2]).abs().max() <= TOL
    out = eng.decode(["a", "b"], torch.tensor([steps_a[2], steps_b[1]]))
    assert (out[0] - ref_a[3]).abs().max() <= TOL and (out[1] - ref_b[2]).abs().max() <= TOL


def test_replace_and_remove_leave_others_untouched(setup):
    hf, path, cfg = setup
    eng = create_engine(cfg, path, device="cpu", max_num_seqs=3)
    p1, p2, p3 = prompts(1, [10, 30, 5])
    eng.prefill(["x", "y"], [p1, p2])
    eng.decode(["x", "y"], torch.tensor([1, 2]))
    # replacing x's state with a new prompt must act like a fresh request and leave y alone
    out = eng.prefill(["x"], [p3])
    assert (out[0] - hf_decode_logits(hf, p3.tolist(), [])[0]).abs().max() <= TOL
    out = eng.decode(["y"], torch.tensor([7]))
    assert (out[0] - hf_decode_logits(hf, p2.tolist(), [2, 7])[2]).abs().max() <= TOL
    # remove in any order frees capacity: three more requests fit again
    eng.remove(["y"])
    eng.remove(["x"])
    eng.remove(["never-existed"])
    assert eng.slots.num_free == 3 and eng.blocks.num_used == 0
    eng.prefill(["p", "q", "r"], [p1, p2, p3])
    with pytest.raises(Exception):
        eng.prefill(["s"], [p1])  # no free state slot: a clear error, others untouched
    out = eng.decode(["q"], torch.tensor([2]))
    assert (out[0] - hf_decode_logits(hf, p2.tolist(), [2])[1]).abs().max() <= TOL
    with pytest.raises(KeyError):
        eng.decode(["x"], torch.tensor([1]))
    with pytest.raises(ValueError):
        eng.decode(["p", "q"], torch.tensor([1]))
