"""Which prefix blocks each replica holds, as far as the router knows.

Two kinds of entries per replica:
- confirmed: from the replica's KV events (`BlockStored`, `BlockRemoved`, `AllCleared`, applied
  through `apply()`, or a whole snapshot through `replace()`, see kv_sync.py): exactly the
  hashes in its prefix cache, as of the last event read; no TTL, no bound (the replica says
  when they go);
- speculative: the router sent a prompt to a replica, so its full blocks will be cached there
  once the prefill is scheduled; they expire after `ttl_s` (a replica that publishes events
  confirms them within a poll, so its TTL can be short; one that does not may evict them
  unseen). An LRU bounded by `max_blocks` (the replica's own KV capacity when known): the
  router never guesses that a replica holds more blocks than it has.

A block matches if it is confirmed or speculative and unexpired; a removal drops both kinds.
"""

from __future__ import annotations

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
    """Per replica: confirmed hashes (a set) and speculative ones (hash → expiry, LRU first)."""

    def __init__(self, ttl_s: float = 120.0, max_blocks: int = 100_000):
        if ttl_s <= 0 or max_blocks < 1:
            raise ValueError("ttl_s must be > 0 and max_blocks >= 1")
        self.ttl_s = ttl_s
        self.default_max_blocks = max_blocks
        self._confirmed: dict[str, set[int]] = {}
        self._entries: dict[str, OrderedDict[int, float]] = {}  # speculative
        self._max: dict[str, int] = {}
        self.evictions = 0  # speculative entries dropped by the LRU bound, cumulative

    def set_capacity(self, replica: str, max_blocks: int) -> None:
        """Bound a replica's speculative entries by its KV capacity (from /server_info)."""
        self._max[replica] = max(1, max_blocks)
        self._trim(replica, self._entries.get(replica, OrderedDict()))

    def size(self, replica: str) -> int:
        """Distinct hashes believed held (confirmed or speculative, expired ones not yet dropped)."""
        conf = self._confirmed.get(replica, set())
        return len(conf) + sum(1 for h in self._entries.get(replica, ()) if h not in conf)

    def confirmed(self, replica: str) -> frozenset[int]:
        """The hashes the replica's events say it holds."""
        return frozenset(self._confirmed.get(replica, ()))

    def num_confirmed(self, replica: str) -> int:
        return len(self._confirmed.get(replica, ()))

    def match(self, replica: str, hashes: Sequence[int], now: float) -> int:
        """How many leading blocks of `hashes` the replica holds (a chain: stop at the first miss)."""
        conf = self._confirmed.get(replica) or ()
        entries = self._entries.get(replica)
        if not conf and not entries:
            return 0
        n = 0
        for h in hashes:
            if h in conf:
                n += 1
                continue
            expiry = entries.get(h) if entries else None
            if expiry is None:
                break
            if expiry <= now:
                del entries[h]  # type: ignore[union-attr]
                break
            n += 1
        return n

    def add_speculative(self, replica: str, hashes: Iterable[int], now: float, ttl_s: float | None = None) -> None:
        """The router sent these blocks' prompt to the replica: expect them cached for a while."""
        expiry = now + (self.ttl_s if ttl_s is None else ttl_s)
        entries = self._entries.setdefault(replica, OrderedDict())
        # Last block first: a chain's first blocks end up most recently used, so the LRU bound
        # drops a prefix from its tail (as the engine evicts), never the head the rest hangs on.
        for h in reversed(list(hashes)):
            old = entries.pop(h, None)
            entries[h] = expiry if old is None else max(old, expiry)
        self._trim(replica, entries)

    def apply(self, event: KVEvent) -> None:
        """A KV event from a replica."""
        if isinstance(event, BlockStored):
            self._confirmed.setdefault(event.replica, set()).update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            conf = self._confirmed.get(event.replica)
            entries = self._entries.get(event.replica)
            for h in event.block_hashes:
                if conf:
                    conf.discard(h)
                if entries:
                    entries.pop(h, None)
        elif isinstance(event, AllCleared):
            self.forget(event.replica)

    def replace(self, replica: str, hashes: Iterable[int]) -> None:
        """A snapshot: the replica holds exactly these (speculative entries stay, on their TTL)."""
        self._confirmed[replica] = set(hashes)

    def forget(self, replica: str) -> None:
        """Drop everything known about a replica (it restarted: its cache is empty)."""
        self._confirmed.pop(replica, None)
        self._entries.pop(replica, None)

    def _trim(self, replica: str, entries: OrderedDict[int, float]) -> None:
        limit = self._max.get(replica, self.default_max_blocks)
        while len(entries) > limit:
            entries.popitem(last=False)
            self.evictions += 1
