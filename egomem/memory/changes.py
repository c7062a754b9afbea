"""The store's change feed: who was forgotten, merged or had their profile changed, for the processes
that hold copies (live streams' MemChunks, the identification index, retrieval caches).

Several orchestrators share one store; a forget, merge or profile change made through one of them
must reach the others' copies. Every write transaction that changes what a user's profile renders
calls `SQLBase._changed`, and a process follows the feed with `store.change_feed(on_change)`:

- PostgreSQL: `NOTIFY egomem_changes` in the writing transaction (so a change is announced exactly
  when it commits, never for a rolled-back write), heard by a `LISTEN` connection in a thread
  (`PostgresChangeFeed`). Notifications sent while the listener was disconnected are lost, so after
  every reconnect it reports one `resync` change: drop every copy and reload.
- SQLite (one machine): the op log polled every `poll_s` (`OpLogChangeFeed`); one writer at a
  time commits, so op ids commit in order, and they are never reused (schema v5: not even those of
  rows forget deletes), so reading "after the last id seen" misses nothing.

A forget's change names no one (like its op-log row): receivers ask the store which of their users
are gone. A merge names (kept, dropped); a profile change the users whose profile changed.
A `forget_prepare` (phase 1 of a two-phase forget, egomem/memory/sql/coordination.py) names the one
user about to be forgotten, by id only, and carries the request id the other orchestrators acknowledge
(`store.ack_forget`); on SQLite it is an op-log row that the forget then deletes with the user's others.
"""

from __future__ import annotations

import abc
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

log = logging.getLogger(__name__)

ChangeKind = Literal["forget_prepare", "forget", "merge", "profile", "resync"]
CHANGE_CHANNEL = "egomem_changes"  # the PostgreSQL LISTEN/NOTIFY channel every process of one store uses
RECONNECT_MAX_S = 30.0  # the LISTEN connection retries with doubling waits up to this
# op-log ops that say a user was merged or forgotten; any other op with a user_id changed that user's memory,
# except those that leave every copy as it was (a new user is in no stream yet)
_OP_KINDS: dict[str, ChangeKind] = {"forget_prepare": "forget_prepare", "forget": "forget", "merge_users": "merge"}
_OPS_NO_CHANGE = frozenset({"create_user"})


@dataclass(frozen=True)
class Change:
    """One committed change. `user_ids`: forget_prepare (the user), forget (), merge (kept, dropped),
    profile (the users), resync (). `ts`: wall-clock time on the writer just before its commit
    (propagation latency = receive time - ts, across machines only as good as their clocks).
    `origin`: the writing store object's id. `request`: a forget_prepare's request id (else "")."""

    kind: ChangeKind
    user_ids: tuple[str, ...] = ()
    ts: float = 0.0
    origin: str = ""
    request: str = ""

    def payload(self) -> str:
        return json.dumps({"k": self.kind, "u": list(self.user_ids), "t": self.ts, "o": self.origin,
                           "r": self.request})

    @classmethod
    def parse(cls, payload: str) -> Change:
        d = json.loads(payload)
        return cls(d["k"], tuple(d.get("u") or ()), float(d.get("t") or 0.0), d.get("o") or "", d.get("r") or "")


OnChange = Callable[[Change], None]


def new_origin() -> str:
    """An id for one store object (a process may open several): its own changes can be told apart."""
    return uuid.uuid4().hex[:16]


class ChangeFeed(abc.ABC):
    """Calls `on_change` from its own thread for every change committed after `start()` (and `resync`
    when changes may have been missed). `close()` stops it; an exception in `on_change` is logged."""

    def __init__(self, on_change: OnChange, poll_s: float):
        if not poll_s > 0:
            raise ValueError(f"memory.change_poll_s = {poll_s!r}: must be > 0 seconds")
        self.on_change, self.poll_s = on_change, float(poll_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=type(self).__name__, daemon=True)
        self.ready = threading.Event()  # set once the feed listens: changes committed from then on are seen

    def start(self) -> ChangeFeed:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.poll_s * 4 + 5)

    def _deliver(self, change: Change) -> None:
        try:
            self.on_change(change)
        except Exception:  # one bad receiver must not stop the feed
            log.exception("change feed: applying %s failed", change)

    @abc.abstractmethod
    def _loop(self) -> None: ...


class OpLogChangeFeed(ChangeFeed):
    """The SQLite fallback: polls `store.op_log(after_op_id=...)` every `poll_s` seconds, from the row
    that was newest when it started."""

    def __init__(self, store: Any, on_change: OnChange, poll_s: float):
        super().__init__(on_change, poll_s)
        self.store = store

    def _loop(self) -> None:
        last = self.store.last_op_id()
        self.ready.set()
        while not self._stop.wait(self.poll_s):
            try:
                rows = self.store.op_log(after_op_id=last, limit=10_000)
            except Exception as e:  # noqa: BLE001 - a busy or restarting database: next round
                log.warning("change feed: reading the op log failed (%s); retrying", e)
                continue
            if rows:
                last = rows[-1].op_id  # ids are never reused (SQLite schema v5), so nothing lands behind it
            for change in changes_from_ops(rows):
                self._deliver(change)


def changes_from_ops(rows: Sequence[Any]) -> list[Change]:
    """Op-log rows -> changes (one per forget_prepare / forget / merge; the other users touched, once each,
    as one profile change)."""
    out: list[Change] = []
    touched: dict[str, None] = {}
    for r in rows:
        kind = _OP_KINDS.get(r.op)
        if kind == "forget_prepare" and r.user_id:
            detail = r.detail or {}
            out.append(Change("forget_prepare", (r.user_id,), r.ts, str(detail.get("origin", "")),
                              str(detail.get("request_id", ""))))
        elif kind == "forget":
            out.append(Change("forget", (), r.ts))
        elif kind == "merge" and r.user_id and r.related_user_id:
            out.append(Change("merge", (r.user_id, r.related_user_id), r.ts))
        elif r.user_id and r.op not in _OPS_NO_CHANGE:
            touched[r.user_id] = None
    if touched:
        out.append(Change("profile", tuple(touched), rows[-1].ts))
    return out


class PostgresChangeFeed(ChangeFeed):
    """`LISTEN egomem_changes` on a connection of its own; reconnects (then reports `resync`) when it drops.
    It wakes every `poll_s` to see whether it was closed; a notification wakes it at once."""

    def __init__(self, dsn: str, on_change: OnChange, poll_s: float, channel: str = CHANGE_CHANNEL):
        super().__init__(on_change, poll_s)
        self.dsn, self.channel = dsn, channel

    def _loop(self) -> None:
        import psycopg

        first, backoff = True, self.poll_s
        while not self._stop.is_set():
            try:
                with psycopg.connect(self.dsn, autocommit=True) as conn:
                    conn.execute(f'LISTEN "{self.channel}"')
                    self.ready.set()
                    if not first:  # changes committed while we were away went unheard
                        self._deliver(Change("resync", (), time.time()))
                    first, backoff = False, self.poll_s
                    while not self._stop.is_set():
                        for n in conn.notifies(timeout=self.poll_s):
                            try:
                                change = Change.parse(n.payload)
                            except (ValueError, KeyError, TypeError):
                                log.warning("change feed: ignoring a malformed notification %r", n.payload[:200])
                                continue
                            self._deliver(change)
            except psycopg.Error as e:
                if self._stop.is_set():
                    break
                log.warning("change feed: the LISTEN connection to PostgreSQL failed (%s); reconnecting in %.1f s",
                            e, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, RECONNECT_MAX_S)
