"""One replica's KV events into the prefix index, in order, with a snapshot resync whenever
order cannot be proven (plain Python; probes.py does the HTTP).

    not synced ──snapshot(epoch E, seq S)──► synced at (E, S)
    synced at (E, S) ── page of E with events S+1, S+2, … ──► synced at (E, last)
                     ── page of another epoch (a restart) ──► index forgotten, not synced
                     ── a gap (events lost, or a seq hole) ──► not synced (snapshot next)

The wire shapes are `inferlab serve`'s GET /kv_events and /kv_events/snapshot (see
engine/kv_events.py): hashes as 32 hex digits, records numbered without holes per epoch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inferlab.engine.kv_events import KINDS, KVEventPage, KVEventRecord, KVSnapshot
from inferlab.router.prefix_index import AllCleared, BlockRemoved, BlockStored, PrefixIndex


class BadFeed(ValueError):
    """A /kv_events answer that is not the shape we read."""


def parse_page(body: Any) -> KVEventPage:
    try:
        events = tuple(KVEventRecord(int(e["seq"]), _kind(e["type"]), tuple(int(h, 16) for h in e.get("block_hashes") or ()))
                       for e in body["events"])  # fmt: skip
        return KVEventPage(str(body["epoch"]), int(body["seq"]), events, bool(body.get("gap", False)))
    except (KeyError, TypeError, ValueError) as e:
        raise BadFeed(f"malformed /kv_events answer: {e!r}") from None


def parse_snapshot(body: Any) -> KVSnapshot:
    try:
        return KVSnapshot(str(body["epoch"]), int(body["seq"]), tuple(int(h, 16) for h in body["block_hashes"]))
    except (KeyError, TypeError, ValueError) as e:
        raise BadFeed(f"malformed /kv_events/snapshot answer: {e!r}") from None


def _kind(kind: Any) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown event type {kind!r}")
    return str(kind)


@dataclass
class KVSync:
    """The feed position of one replica and what it has done to the index."""

    replica: str
    index: PrefixIndex
    epoch: str | None = None
    seq: int = 0  # the last record applied (or the snapshot's)
    synced: bool = False
    supported: bool | None = None  # None: not asked yet; False: the replica publishes no events
    resyncs: int = 0  # snapshots applied, cumulative
    gaps: int = 0  # pages that forced a resync, cumulative
    events: int = 0  # records applied, cumulative
    on_resync: Callable[[str, str], None] | None = None  # (replica, why): metrics, logs

    def reset(self) -> None:
        """The replica went away (or its index was dropped): resync from a snapshot next time."""
        self.synced = False

    def apply_page(self, page: KVEventPage) -> bool:
        """Apply a page in order; False when a snapshot is needed first (nothing applied then)."""
        if self.epoch is not None and page.epoch != self.epoch:
            self.index.forget(self.replica)  # a new life of the replica: its old cache is gone
            self.epoch = None
            return self._lost("epoch")
        if not self.synced:
            return False
        if page.gap or page.seq < self.seq:
            return self._lost("gap")
        expect = self.seq + 1
        for r in page.events:
            if r.seq != expect:
                return self._lost("gap")
            expect += 1
        for r in page.events:
            if r.kind == "stored":
                self.index.apply(BlockStored(self.replica, r.block_hashes))
            elif r.kind == "removed":
                self.index.apply(BlockRemoved(self.replica, r.block_hashes))
            else:
                self.index.apply(AllCleared(self.replica))
            self.seq = r.seq
            self.events += 1
        return True

    def apply_snapshot(self, snap: KVSnapshot) -> None:
        if self.epoch is not None and snap.epoch != self.epoch:
            self.index.forget(self.replica)
        self.index.replace(self.replica, snap.block_hashes)
        self.epoch, self.seq, self.synced = snap.epoch, snap.seq, True
        self.resyncs += 1

    def _lost(self, why: str) -> bool:
        self.synced = False
        self.gaps += 1
        if self.on_resync is not None:
            self.on_resync(self.replica, why)
        return False
