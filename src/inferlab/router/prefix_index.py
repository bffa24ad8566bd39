"""Which prefix blocks each replica holds, as far as the router knows.

Entries come from two sources:
- speculative: the router sent a prompt to a replica, so its full blocks will be cached there
  once the prefill runs; they expire after `ttl_s` (the replica may evict them under pressure,
  and nobody tells us yet);
- confirmed (the seam for a later slice): KV events from the replica (`BlockStored`,
  `BlockRemoved`, `AllCleared`) applied through `apply()`; stored blocks do not expire, they
  leave on a removal, a clear, or the LRU bound.

Each replica's entries are an LRU bounded by `max_blocks` (the replica's own KV capacity when
known): the router never believes a replica holds more blocks than it has.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStored:
    """The replica cached these blocks (KV event)."""

    replica: str
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class BlockRemoved:
    """The replica evicted these blocks (KV event)."""

    replica: str
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllCleared:
    """The replica dropped its whole prefix cache (a reset, a restart, a resync)."""

    replica: str


KVEvent = BlockStored | BlockRemoved | AllCleared


class PrefixIndex:
    """block hash → expiry time, per replica, least recently used first."""

    def __init__(self, ttl_s: float = 120.0, max_blocks: int = 100_000):
        if ttl_s <= 0 or max_blocks < 1:
            raise ValueError("ttl_s must be > 0 and max_blocks >= 1")
        self.ttl_s = ttl_s
        self.default_max_blocks = max_blocks
        self._entries: dict[str, OrderedDict[int, float]] = {}
        self._max: dict[str, int] = {}
        self.evictions = 0  # entries dropped by the LRU bound, cumulative

    def set_capacity(self, replica: str, max_blocks: int) -> None:
        """Bound a replica's entries by its KV capacity (from /server_info)."""
        self._max[replica] = max(1, max_blocks)
        self._trim(replica, self._entries.get(replica, OrderedDict()))

    def size(self, replica: str) -> int:
        return len(self._entries.get(replica, ()))

    def match(self, replica: str, hashes: Sequence[int], now: float) -> int:
        """How many leading blocks of `hashes` the replica holds (a chain: stop at the first miss)."""
        entries = self._entries.get(replica)
        if not entries:
            return 0
        n = 0
        for h in hashes:
            expiry = entries.get(h)
            if expiry is None:
                break
            if expiry <= now:
                del entries[h]
                break
            n += 1
        return n

    def add_speculative(self, replica: str, hashes: Iterable[int], now: float) -> None:
        """The router sent these blocks' prompt to the replica: expect them cached for ttl_s."""
        self._add(replica, hashes, now + self.ttl_s)

    def apply(self, event: KVEvent) -> None:
        """A KV event from a replica (the later slice's feed)."""
        if isinstance(event, BlockStored):
            self._add(event.replica, event.block_hashes, math.inf)
        elif isinstance(event, BlockRemoved):
            entries = self._entries.get(event.replica)
            for h in event.block_hashes if entries else ():
                entries.pop(h, None)  # type: ignore[union-attr]
        elif isinstance(event, AllCleared):
            self.forget(event.replica)

    def forget(self, replica: str) -> None:
        """Drop everything known about a replica (it restarted: its cache is empty)."""
        self._entries.pop(replica, None)

    def _add(self, replica: str, hashes: Iterable[int], expiry: float) -> None:
        entries = self._entries.setdefault(replica, OrderedDict())
        # Last block first: a chain's first blocks end up most recently used, so the LRU bound
        # drops a prefix from its tail (as the engine evicts), never the head the rest hangs on.
        for h in reversed(list(hashes)):
            old = entries.pop(h, None)
            entries[h] = expiry if old is None else max(old, expiry)
        self._trim(replica, entries)

    def _trim(self, replica: str, entries: OrderedDict[int, float]) -> None:
        limit = self._max.get(replica, self.default_max_blocks)
        while len(entries) > limit:
            entries.popitem(last=False)
            self.evictions += 1
