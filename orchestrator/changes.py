"""Changes other processes made to the shared store, applied to this orchestrator's copies.

`ChangeApplier` follows the store's change feed (egomem/memory/changes.py: PostgreSQL LISTEN/NOTIFY,
SQLite op-log polling) from its thread and applies each change on the event loop:
- forget: rebuild the identification index and drop the retrieval caches (`Perception.forget`); a
  stream whose user no longer lives stops personalising for them, every other stream reloads its
  profile (the forget may have redacted the person's name from it). A forget made through this
  orchestrator's own REST route was applied there already and is skipped.
- merge (kept, dropped): a stream of the dropped user goes on as the kept one; both reload.
- profile: streams of those users reload their profile (the Level-1 MemChunk).
- resync (the feed may have missed changes): all of the above for every stream.
The time from the writer's commit to applied here is `egomem_change_propagation_seconds`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

from aiohttp import web

from egomem.memory.changes import Change, ChangeFeed

from .services import Services

log = logging.getLogger(__name__)
RECENT_LATENCIES = 10_000  # propagation latencies kept for benches and debugging (the metric has buckets only)


class ChangeApplier:
    """Applies the store's change feed to `services` (streams, identifier, retrieval caches)."""

    def __init__(self, services: Services, loop: asyncio.AbstractEventLoop):
        self.s, self.loop = services, loop
        self.feed: ChangeFeed | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.latencies: collections.deque[tuple[Change, float]] = collections.deque(maxlen=RECENT_LATENCIES)

    def start(self) -> ChangeApplier:
        self.feed = self.s.store.change_feed(self._on_change, self.s.cfg.memory.change_poll_s)
        return self

    async def close(self) -> None:
        if self.feed is not None:
            await asyncio.to_thread(self.feed.close)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _on_change(self, change: Change) -> None:
        """Called from the feed's thread: hand the change to the event loop."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self._schedule, change)

    def _schedule(self, change: Change) -> None:
        task = self.loop.create_task(self.apply(change))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def apply(self, change: Change) -> None:
        s = self.s
        if change.kind == "forget" and change.origin and change.origin == s.store.origin:
            return  # rest.py's forget route applied it to this process before answering
        if change.kind in ("forget", "resync"):
            if s.perception is not None:
                await asyncio.to_thread(s.perception.forget)
            users = {st.user_id for st in s.streams.values() if st.user_id}
            gone = {u for u in users if await asyncio.to_thread(s.store.resolve_user, u) is None}
            for stream in list(s.streams.values()):
                if stream.user_id in gone:
                    stream.forget_user(stream.user_id)  # drops the user and clears the MemChunk
                else:
                    stream.refresh_profile()
        elif change.kind == "merge" and len(change.user_ids) == 2:
            keep, drop = change.user_ids
            if s.perception is not None:
                s.perception.identifier.invalidate()  # keys moved to the kept user
            for stream in list(s.streams.values()):
                if stream.user_id == drop:
                    stream.user_id = keep
                if stream.user_id == keep:
                    stream.refresh_profile()
        elif change.kind == "profile":
            changed = set(change.user_ids)
            for stream in list(s.streams.values()):
                if stream.user_id in changed:
                    stream.refresh_profile()
        s.metrics.inc("egomem_changes_applied_total")
        if change.ts:
            dt = max(time.time() - change.ts, 0.0)
            s.metrics.observe("egomem_change_propagation_seconds", dt)
            self.latencies.append((change, dt))


CHANGES = web.AppKey("changes", ChangeApplier)
