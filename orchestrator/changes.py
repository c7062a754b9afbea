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
- forget_prepare (another orchestrator is about to forget a user; forgets.py): redact this process's
  recordings while the user's names and keys are still in the store, keep redacting every chunk cut
  until the forget is done, wait for the chunks cut before to reach the queue, then acknowledge.
  A forget or resync (and every heartbeat) lets go of the pending forgets whose user is gone.
The time from the writer's commit to applied here is `egomem_change_propagation_seconds`.

The applier also keeps this orchestrator in the store's registry (`store.heartbeat` every
`memory.orchestrator_heartbeat_s`, once the feed listens; `store.leave` at close), so a forget
elsewhere knows to wait for its acknowledgement; on joining, and after a resync, it takes up the
forgets announced before it listened (`store.forget_announcements`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import time

from aiohttp import web

from egomem.memory.changes import Change, ChangeFeed

from .forgets import prepare_here, settle
from .services import Services

log = logging.getLogger(__name__)
RECENT_LATENCIES = 10_000  # propagation latencies kept for benches and debugging (the metric has buckets only)


class ChangeApplier:
    """Applies the store's change feed to `services` (streams, identifier, retrieval caches)."""

    def __init__(self, services: Services, loop: asyncio.AbstractEventLoop):
        self.s, self.loop = services, loop
        self.feed: ChangeFeed | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._heartbeat: asyncio.Task[None] | None = None
        self.label = f"{socket.gethostname()}:{services.cfg.orchestrator.port}"  # names it in a forget's report
        self.latencies: collections.deque[tuple[Change, float]] = collections.deque(maxlen=RECENT_LATENCIES)

    def start(self) -> ChangeApplier:
        self.feed = self.s.store.change_feed(self._on_change, self.s.cfg.memory.change_poll_s)
        self._heartbeat = self.loop.create_task(self._keep_registered())
        return self

    async def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await asyncio.gather(self._heartbeat, return_exceptions=True)
            try:
                await asyncio.to_thread(self.s.store.leave)
            except Exception as e:  # noqa: BLE001 - the database is away: the row goes stale (not live) instead
                log.warning("orchestrator registry: leaving failed (%s); forgets elsewhere may wait for this "
                            "orchestrator until its heartbeat is memory.orchestrator_live_s old", e)
        if self.feed is not None:
            await asyncio.to_thread(self.feed.close)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _keep_registered(self) -> None:
        """Once the feed listens (so every announcement from then on is heard): register, take up the
        forgets announced before, then refresh the heartbeat and let go of settled forgets, forever."""
        m = self.s.cfg.memory
        assert self.feed is not None
        while not await asyncio.to_thread(self.feed.ready.wait, m.orchestrator_heartbeat_s):
            pass
        joined = False
        while True:
            try:
                await asyncio.to_thread(self.s.store.heartbeat, self.label)
                if not joined:
                    await self._take_up_announcements()
                    joined = True
                await settle(self.s)
            except Exception as e:  # noqa: BLE001 - a busy or restarting database: next beat
                log.warning("orchestrator registry: heartbeat failed (%s); retrying in %.1f s", e,
                            m.orchestrator_heartbeat_s)
            await asyncio.sleep(m.orchestrator_heartbeat_s)

    async def _take_up_announcements(self) -> None:
        """Forgets announced elsewhere that this process may not have heard (it started, or its feed reconnected)."""
        m = self.s.cfg.memory
        for a in await asyncio.to_thread(self.s.store.forget_announcements, m.forget_prepare_ttl_s):
            if a.origin != self.s.store.origin and a.request_id not in self.s.forgets:
                await self._prepare(a.user_id, a.request_id)

    async def _prepare(self, user_id: str, request_id: str) -> None:
        """Phase 1 of a forget announced elsewhere (forgets.py): redact, hold, wait for hand-offs, acknowledge."""
        await prepare_here(self.s, user_id, request_id)
        if not await asyncio.to_thread(self.s.store.ack_forget, request_id):
            await settle(self.s)  # the announcement is gone: the forget is done (or was given up) already

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
        if change.kind in ("forget", "forget_prepare") and change.origin and change.origin == s.store.origin:
            return  # rest.py's forget route applied it to this process before answering
        if change.kind == "forget_prepare":
            if change.user_ids and change.request and change.request not in s.forgets:
                await self._prepare(change.user_ids[0], change.request)
        elif change.kind in ("forget", "resync"):
            await settle(s)  # a pending forget whose user is gone: its recordings redacted once more, then let go
            if s.perception is not None:
                await asyncio.to_thread(s.perception.forget)
            users = {st.user_id for st in s.streams.values() if st.user_id}
            gone = {u for u in users if await asyncio.to_thread(s.store.resolve_user, u) is None}
            for stream in list(s.streams.values()):
                if stream.user_id in gone:
                    stream.forget_user(stream.user_id)  # drops the user and clears the MemChunk
                else:
                    stream.refresh_profile()
            if change.kind == "resync":  # an announcement may have been missed too
                await self._take_up_announcements()
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
