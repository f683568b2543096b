"""Hybrid prefix cache (rank 0 bookkeeping; the runner only executes the copies and checkpoints a StepPlan lists).

A prefix is resumable when both kinds of layer state exist for it: the attention layers' KV, kept position by
position in paged blocks (any run of full blocks can be shared by reference), and the DeltaNet layers' conv tail and
recurrent state, which summarise the whole prefix and cannot be truncated: only a snapshot taken exactly at the
resume point serves. Hence two structures:

- the chain: every full KV block a sequence computed is a node keyed by hash(parent's key, the block's tokens); a
  lookup walks a prompt block by block and compares the tokens exactly (a hash collision is a miss). A node owns
  its block and lives while something refers to it (`refs`): its children, the snapshots hung on it, the running
  requests whose chain ends there. At zero refs it is removed and its block freed, and so on up the chain.
- snapshots: a DeltaNet state slot holding the state after `position` tokens of a chain and, when that position is
  inside a block, a copy of that partial KV block; hung on the node of the last full block before the position.
  A lookup returns the deepest snapshot on the prompt's matched chain that leaves at least one token to feed.

Snapshot memory is a fixed number of slots (--prefix-cache-snapshots). Eviction takes the least recently used
snapshot that the plan being built neither reads nor writes; interval snapshots (taken only for their position,
`speculative`) go before the others unless a hit has shown them useful. Dropping a snapshot releases its node,
which frees the blocks nothing else refers to: that is how the KV blocks of the cache go back to admission.

A model without DeltaNet layers (`stateless`) needs no state: any matched full block is a resume point (its
snapshots still take slot ids, which have no tensors behind them).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from scheduler.pools import BlockPool


def check_snapshot_interval(interval: int, chunk: int) -> None:
    """ValueError unless a snapshot every `interval` prompt tokens can be a checkpoint of the DeltaNet prefill kernels,
    which stop at multiples of their `chunk`: a multiple of it, or 0 for no interval snapshots."""
    if interval < 0 or interval % chunk:
        raise ValueError(f"the prefix cache's snapshot interval (--prefix-cache-interval, got {interval}) must be a "
                         f"multiple of {chunk} (the DeltaNet chunk), or 0 for none")


@dataclass(eq=False)
class Node:
    """One full KV block of a cached chain; the root is the empty prefix (no block, never removed)."""
    key: int
    parent: "Node | None"
    tokens: tuple[int, ...]
    block: int
    depth: int                      # full blocks from the start of the sequence, this one included
    refs: int = 0                   # children + snapshots hung here + requests whose chain ends here
    snapshots: dict = field(default_factory=dict)  # tail tokens -> Snapshot


@dataclass(eq=False)
class Snapshot:
    node: Node
    tail: tuple[int, ...]           # tokens after the node's block
    position: int                   # node.depth * block_size + len(tail): the tokens it summarises
    slot: int                       # DeltaNet snapshot slot
    block: int | None               # the KV block holding the tail's positions (None: empty tail)
    speculative: bool               # an interval snapshot never hit: evicted first
    ready_step: int                 # first step whose plan may read it (its writes are queued before then)
    touched_step: int               # last step whose plan reads or writes it: not evicted while that one is built


@dataclass
class Match:
    path: list[Node]                # the root, then the nodes of the prompt's full blocks found in the cache
    snapshot: Snapshot | None       # where the hit resumes (None: no hit, or a stateless hit on a node)
    position: int                   # tokens served from the cache (0: none)


class PrefixCache:
    def __init__(self, blocks: BlockPool, snapshot_slots: list[int], stateless: bool = False):
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.free_slots = list(snapshot_slots)
        self.stateless = stateless
        self.root = Node(0, None, (), -1, 0)
        self.nodes: dict[int, Node] = {}
        # snapshots by eviction order: the speculative ones, then the others; least recently used first in each
        self._lru: tuple[OrderedDict, OrderedDict] = (OrderedDict(), OrderedDict())
        self.num_blocks = 0          # KV blocks the cache owns (nodes and tail copies)
        self.hits = 0
        self.hit_tokens = 0          # prompt tokens served from the cache instead of being prefilled

    @property
    def num_snapshots(self) -> int:
        return len(self._lru[0]) + len(self._lru[1])

    # ---- the chain -------------------------------------------------------------------------------------------
    def child(self, parent: Node, tokens: tuple[int, ...]) -> Node | None:
        node = self.nodes.get(hash((parent.key, tokens)))
        return node if node is not None and node.parent is parent and node.tokens == tokens else None

    def extend(self, parent: Node, tokens: tuple[int, ...], block: int) -> Node | None:
        """The node of `tokens` after `parent`: the cached one (then `block` stays with its owner), else a new node
        that takes `block` over. None on a hash collision: the chain stops there. The caller holds the node."""
        key = hash((parent.key, tokens))
        node = self.nodes.get(key)
        if node is not None:
            return node if node.parent is parent and node.tokens == tokens else None
        node = self.nodes[key] = Node(key, parent, tokens, block, parent.depth + 1)
        parent.refs += 1
        self.num_blocks += 1
        return node

    def hold(self, node: Node) -> None:
        if node is not self.root:
            node.refs += 1

    def release(self, node: Node) -> None:
        """Drop one reference; a node left without any is removed with its block, then its parent is released."""
        while node is not self.root:
            node.refs -= 1
            if node.refs:
                return
            del self.nodes[node.key]
            self.blocks.free([node.block])
            self.num_blocks -= 1
            node = node.parent

    def match(self, ids: list[int], limit: int, step: int) -> Match:
        """The cached chain over the full blocks of ids[:limit] and the deepest snapshot on it (position <= limit)
        that plan `step` may read."""
        bs, path = self.block_size, [self.root]
        for k in range(limit // bs):
            node = self.child(path[-1], tuple(ids[k * bs:(k + 1) * bs]))
            if node is None:
                break
            path.append(node)
        for node in reversed(path):
            start, best = node.depth * bs, None
            for tail, snap in node.snapshots.items():
                if snap.ready_step > step or start + len(tail) > limit or (best and len(tail) <= len(best.tail)):
                    continue
                if tuple(ids[start:start + len(tail)]) == tail:
                    best = snap
            if best is not None:
                return Match(path, best, best.position)
            if self.stateless and node is not self.root:
                return Match(path, None, start)
        return Match(path, None, 0)

    # ---- snapshots -------------------------------------------------------------------------------------------
    def take_slot(self, now: int) -> int | None:
        """A free snapshot slot, evicting if need be; None when every snapshot is in use by plan `now`."""
        if not self.free_slots and not self.evict_one(now):
            return None
        return self.free_slots.pop()

    def add(self, node: Node, tail: tuple[int, ...], slot: int, block: int | None, speculative: bool, now: int,
            ready: int) -> Snapshot:
        """Hang a snapshot that plan `now` writes on `node`, readable from plan `ready` on; it takes `block` over."""
        snap = Snapshot(node, tail, node.depth * self.block_size + len(tail), slot, block, speculative, ready, now)
        node.snapshots[tail] = snap
        node.refs += 1
        self.num_blocks += block is not None
        self._lru[int(not speculative)][snap] = None
        return snap

    def touch(self, snap: Snapshot, now: int) -> None:
        """A hit in plan `now`: most recently used, no longer speculative, kept while that plan is built."""
        del self._lru[int(not snap.speculative)][snap]
        snap.speculative = False
        self._lru[1][snap] = None
        snap.touched_step = max(snap.touched_step, now)

    def evict_one(self, now: int) -> bool:
        """Drop the first snapshot in eviction order that plan `now` does not touch; False if there is none."""
        for lru in self._lru:
            for snap in lru:
                if snap.touched_step < now:
                    self._drop(snap)
                    return True
        return False

    def evict_all(self, now: int) -> None:
        """Evict every snapshot that plan `now` does not touch."""
        while self.evict_one(now):
            pass

    def _drop(self, snap: Snapshot) -> None:
        del self._lru[int(not snap.speculative)][snap]
        del snap.node.snapshots[snap.tail]
        self.free_slots.append(snap.slot)
        if snap.block is not None:
            self.blocks.free([snap.block])
            self.num_blocks -= 1
        self.release(snap.node)
