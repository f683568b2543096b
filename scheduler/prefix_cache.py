"""Whole-prompt prefix cache (rank 0 bookkeeping; the runner only executes the copies a StepPlan lists).

A DeltaNet state cannot be truncated, so sharing arbitrary prefixes would need a state snapshot at every block
boundary. Serving workloads repeat whole prompts (the throughput benchmark reuses the same prompts at every level,
chat clients resend a conversation), so we cache exactly that: for a prompt of L tokens, the state after its first
L-1 tokens. A request with the same prompt copies the snapshot into its own slot, shares the KV blocks of those
L-1 tokens, and feeds only the last prompt token (whose logits give the first completion token).

An entry owns a snapshot state slot and the KV blocks of positions [0, L-1): the full blocks are handed over by the
request that computed them (it keeps reading them, as a hit does), the partial last block is a copy (the request
keeps writing into its own). Entries in use by a running request are never evicted; the others go LRU first.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class CacheEntry:
    key: tuple[int, ...]       # the prompt without its last token
    snapshot_slot: int
    blocks: list[int]          # KV blocks of positions [0, len(key)): shared full blocks, then a partial copy
    users: int = 0             # running requests reading `blocks`


class PrefixCache:
    def __init__(self, snapshot_slots: list[int]):
        self.free_slots = list(snapshot_slots)
        self.entries: OrderedDict[tuple[int, ...], CacheEntry] = OrderedDict()
        self.hits = 0
        self.hit_tokens = 0        # prompt tokens served from the cache instead of being prefilled

    def lookup(self, prompt_ids: list[int]) -> CacheEntry | None:
        entry = self.entries.get(tuple(prompt_ids[:-1])) if len(prompt_ids) >= 2 else None
        if entry is not None:
            self.entries.move_to_end(entry.key)
            self.hits += 1
            self.hit_tokens += len(entry.key)
        return entry

    def contains(self, prompt_ids: list[int]) -> bool:
        return tuple(prompt_ids[:-1]) in self.entries

    def add(self, entry: CacheEntry) -> None:
        self.entries[entry.key] = entry

    def evict_one(self, keep: CacheEntry | None = None) -> CacheEntry | None:
        """Remove the least recently used entry that no request reads (and is not `keep`); the caller frees its
        blocks."""
        for key, entry in self.entries.items():
            if entry.users == 0 and entry is not keep:
                del self.entries[key]
                self.free_slots.append(entry.snapshot_slot)
                return entry
        return None
