"""The prefix cache's changes as a log that a router can follow: which block hashes entered the
cache (`stored`), left it (`removed`), or all of it went (`cleared`).

The same three events as vLLM's KV events (BlockStored / BlockRemoved / AllBlocksCleared), but
read over plain HTTP (`GET /kv_events?after=SEQ`, `GET /kv_events/snapshot` on `inferlab
serve`) instead of a ZMQ PUB socket and a replay socket: no second port, the server's own auth,
and a poller that can be late without losing anything it cannot recover.

    engine thread                        any thread (the HTTP side)
    ─────────────                        ──────────────────────────
    stored / removed / cleared ─► log ─► since(after) → events after `after`, or a gap
                                   └───► snapshot()   → (epoch, seq, every cached hash)

- `seq` numbers every record, from 1, without holes; `epoch` is new for every log (every
  engine start), so a follower that sees another epoch knows the cache it mirrored is gone.
- The log keeps the last `capacity` records: memory is bounded whoever listens or not; a
  follower that fell further behind gets `gap` and resyncs from the snapshot.
- The snapshot is the log's own mirror of the cached hashes (kept as records are appended,
  under the same lock), so it is consistent with `seq` without ever reading the engine's
  structures from another thread.

Cost on the engine thread: one uncontended lock, a deque append and a set update per change of
the prefix cache (a few per 16-token block at most); nothing at all when the engine has no log.
"""

from __future__ import annotations

import secrets
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

KINDS = ("stored", "removed", "cleared")


@dataclass(frozen=True)
class KVEventRecord:
    seq: int
    kind: str  # one of KINDS
    block_hashes: tuple[int, ...] = ()


@dataclass(frozen=True)
class KVEventPage:
    """What a follower gets for `since(after)`: the records after `after`, oldest first, or
    `gap` (records it needs are no longer kept, or `after` is from another life of the log)."""

    epoch: str
    seq: int  # the log's last seq at the time of the call
    events: tuple[KVEventRecord, ...]
    gap: bool = False


@dataclass(frozen=True)
class KVSnapshot:
    epoch: str
    seq: int  # the snapshot holds every record up to and including this one
    block_hashes: tuple[int, ...]


class KVEventLog:
    """A bounded, thread-safe log of one engine's prefix-cache changes (see the module doc)."""

    def __init__(self, capacity: int = 8192, epoch: str | None = None, block_size: int = 16):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.block_size = block_size  # tokens per block, for followers that hash prompts
        self.epoch = epoch or secrets.token_hex(8)
        self._lock = threading.Lock()
        self._records: deque[KVEventRecord] = deque(maxlen=capacity)
        self._seq = 0
        self._cached: set[int] = set()

    @property
    def seq(self) -> int:
        return self._seq

    # ------------------------------------------------------------------ the engine's side
    def stored(self, block_hashes: Iterable[int]) -> None:
        hashes = tuple(block_hashes)
        if hashes:
            with self._lock:
                self._cached.update(hashes)
                self._append("stored", hashes)

    def removed(self, block_hashes: Iterable[int]) -> None:
        hashes = tuple(block_hashes)
        if hashes:
            with self._lock:
                self._cached.difference_update(hashes)
                self._append("removed", hashes)

    def cleared(self) -> None:
        with self._lock:
            self._cached.clear()
            self._append("cleared", ())

    def _append(self, kind: str, hashes: tuple[int, ...]) -> None:
        self._seq += 1
        self._records.append(KVEventRecord(self._seq, kind, hashes))

    # ------------------------------------------------------------------ a follower's side
    def since(self, after: int, limit: int = 1000) -> KVEventPage:
        """Up to `limit` records with seq > `after`. A gap when the oldest of them is no longer
        kept, or when `after` is ahead of the log (the follower knew an earlier life of it)."""
        with self._lock:
            seq = self._seq
            if after > seq or after < 0:
                return KVEventPage(self.epoch, seq, (), gap=True)
            if after == seq:
                return KVEventPage(self.epoch, seq, ())
            oldest = self._records[0].seq if self._records else seq + 1
            if after + 1 < oldest:
                return KVEventPage(self.epoch, seq, (), gap=True)
            start = after + 1 - oldest  # records are consecutive: index by seq
            out = tuple(self._records[i] for i in range(start, min(start + max(limit, 1), len(self._records))))
            return KVEventPage(self.epoch, seq, out)

    def snapshot(self) -> KVSnapshot:
        with self._lock:
            return KVSnapshot(self.epoch, self._seq, tuple(self._cached))


def hash_hex(h: int) -> str:
    """A block hash on the wire: 32 hex digits (128-bit ints do not survive every JSON reader)."""
    return f"{h:032x}"


def page_json(page: KVEventPage, block_size: int) -> dict[str, Any]:
    return {
        "epoch": page.epoch,
        "seq": page.seq,
        "block_size": block_size,
        "gap": page.gap,
        "events": [{"seq": r.seq, "type": r.kind, "block_hashes": [hash_hex(h) for h in r.block_hashes]}
                   for r in page.events],  # fmt: skip
    }


def snapshot_json(snap: KVSnapshot, block_size: int) -> dict[str, Any]:
    return {"epoch": snap.epoch, "seq": snap.seq, "block_size": block_size,
            "block_hashes": [hash_hex(h) for h in snap.block_hashes]}  # fmt: skip
