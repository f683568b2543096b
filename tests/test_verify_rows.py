"""layers/verify_rows.py: the fast one-launch verify-row inputs equal the torch ones exactly (CPU, interpreter): rows
whose draft positions run past their blocks (the scratch block, clamped positions, fewer acceptable drafts), the
scratch slot's draft row, rows planned a verify step behind (their slot's accepted drafts added to the start), T =
1..4, batches of 1..5 rows in slots out of order."""
import pytest
import torch

from layers.verify_rows import verify_rows_fast, verify_rows_torch

SLOTS, K, BS, WIDTH = 6, 3, 4, 7  # state slots, drafts per slot, block size, table width (spare columns included)


def buffers(gen):
    table = torch.randint(0, 50, (SLOTS + 1, WIDTH), generator=gen, dtype=torch.int32)
    slot_end = torch.randint(0, (WIDTH - 2) * BS, (SLOTS + 1,), generator=gen)
    tokens = torch.randint(0, 1000, (SLOTS + 1,), generator=gen)
    drafts = torch.randint(0, 1000, (SLOTS + 1, K), generator=gen)  # row SLOTS: the scratch slot's
    accepted = torch.randint(0, K + 1, (SLOTS + 1,), generator=gen)
    return slot_end, table, tokens, drafts, accepted


@pytest.mark.parametrize("T", [1, 2, 3, 4])
@pytest.mark.parametrize("B", [1, 2, 5])
def test_fast_equals_torch(B, T):
    gen = torch.Generator().manual_seed(B * 10 + T)
    slot_end, table, tokens, drafts, accepted = buffers(gen)
    slots = torch.randperm(SLOTS + 1, generator=gen)[:B]  # (may include the scratch slot, SLOTS)
    # starts at, near and past each slot's end: some draft positions fall past the blocks
    starts = (slot_end[slots] - torch.randint(-1, T + 1, (B,), generator=gen)).clamp(min=0)
    behind = torch.randint(0, 2, (B,), generator=gen)
    args = (slots, starts, behind, T, slot_end, table, tokens, drafts, accepted, BS, 99)
    want, got = verify_rows_torch(*args), verify_rows_fast(*args)
    for name, w, g in zip(want._fields, want, got):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g, w), (name, g, w)


def test_positions_past_the_blocks():
    slot_end, table, tokens, drafts, accepted = buffers(torch.Generator().manual_seed(0))
    slots, starts = torch.tensor([4, SLOTS]), torch.stack([slot_end[4] - 1, slot_end[SLOTS] - 5])
    r = verify_rows_fast(slots, starts, torch.zeros(2, dtype=torch.int64), 3, slot_end, table, tokens, drafts,
                         accepted, BS, 99)
    end = slot_end[4].item()
    assert r.positions[:3].tolist() == [end - 1, end, end]  # the last clamped
    assert r.slot_mapping[2].item() == 99 * BS + (end + 1) % BS  # its K/V to the scratch block
    assert r.num_drafts.tolist() == [1, 2]
    assert r.input_ids.tolist() == [tokens[4], *drafts[4, :2], tokens[SLOTS], *drafts[SLOTS, :2]]


def test_rows_planned_behind_start_past_the_host_position():
    slot_end, table, tokens, drafts, accepted = buffers(torch.Generator().manual_seed(1))
    accepted[2], accepted[5] = 2, 3
    slots, starts = torch.tensor([2, 5]), torch.tensor([3, 4])
    r = verify_rows_fast(slots, starts, torch.tensor([1, 0]), 2, slot_end, table, tokens, drafts, accepted, BS, 99)
    assert r.start_pos.tolist() == [5, 4]  # slot 2 behind by its 2 accepted drafts; slot 5's row not behind
    assert r.context_lens.tolist() == [6, 7, 5, 6]
