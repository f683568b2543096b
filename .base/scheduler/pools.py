"""Capacity pools owned by the scheduler (rank 0): paged-KV blocks for the full-attention layers and DeltaNet
state slots. Both are plain id free-lists; the tensors themselves live in every rank's ModelRunner."""
from __future__ import annotations


class IdPool:
    """A fixed set of integer ids 0..n-1 handed out and returned whole."""

    def __init__(self, size: int, name: str):
        if size < 1:
            raise ValueError(f"{name} pool needs at least 1 entry, got {size}")
        self.size = size
        self.name = name
        # pop() from the end hands out low ids first, which keeps small workloads in a compact region
        self._free = list(range(size - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self, n: int = 1) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"{self.name} pool exhausted: asked {n}, {len(self._free)} free")
        ids = [self._free.pop() for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        used = self._used
        if len(ids) == 1 and ids[0] in used:  # the common case
            used.remove(ids[0])
            self._free.append(ids[0])
            return
        for i in ids:
            # a double free would hand one id to two requests: fail loudly instead
            if i not in used:
                raise RuntimeError(f"{self.name} pool: id {i} freed but not allocated")
            used.remove(i)
            self._free.append(i)


class BlockPool(IdPool):
    """Paged-KV blocks of `block_size` tokens each."""

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, "KV block")
        self.block_size = block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


class StateSlotPool(IdPool):
    """DeltaNet state slots (conv + recurrent state), one per running sequence."""

    def __init__(self, num_slots: int):
        super().__init__(num_slots, "DeltaNet state slot")
