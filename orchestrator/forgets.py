"""The two-phase forget in an orchestrator: what it holds of a person about to be forgotten, and why.

Several orchestrators share one store (egomem/memory/sql/coordination.py), and each stream's recording
not yet cut into a chunk is this process's alone. To find a person in it takes their names and their
face / voice keys, which the forget deletes from the store. So a forget goes in two phases:
1. the forgetting orchestrator announces it (`store.announce_forget`); every orchestrator, itself
   included (`prepare_here`), reads the person's name history and keys while they are still there,
   redacts its streams' recordings with them (memory/chunk.py `redact_recording`, as the forget does
   queued chunks), keeps them as a `PendingForget` so that every chunk its recorders cut meanwhile is
   redacted too (`PendingForgets.redact_chunk`, called by recording.py `Recorder.cut`), waits until
   the chunks cut before are in the job queue (where the forget redacts them), and acknowledges
   (`store.ack_forget`; orchestrator/changes.py does it for announcements made elsewhere);
2. the forgetting orchestrator waits for the acknowledgements of every live orchestrator, at most
   `memory.forget_prepare_timeout_s` (`await_acks`; those that did not answer are reported, never
   waited for longer), then forgets. Hearing that the person is gone, each orchestrator redacts its
   recordings once more and drops what it held (`settle`; the forgetting one: `complete_here`).
A pending forget whose person is never forgotten (the forgetting process died) is dropped after
`memory.forget_prepare_ttl_s`. The names and keys are held in memory only, never written anywhere.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from egomem.config import Config, MemoryConfig
from egomem.memory.chunk import StreamChunk, redact_in_memory, redact_recording
from egomem.memory.redact import name_pattern
from egomem.memory.store import MemoryStore
from egomem.memory.types import OrchestratorRecord

log = logging.getLogger(__name__)
MODALITIES = ("face", "voice")


@dataclass
class PendingForget:
    """A person about to be forgotten, as this process needs them to find them in its recordings."""

    request_id: str
    user_id: str
    names: list[str]  # every name they had (store.name_history)
    pattern: re.Pattern[str] | None  # those names as redaction matches them (memory/redact.py)
    theirs: dict[str, list[np.ndarray]]  # modality -> their key vectors: their polls are removed
    others: dict[str, list[np.ndarray]]  # modality -> everyone else's: a poll nearer to one of these stays
    since: float  # time.monotonic() when it was taken up


async def read_person(store: MemoryStore, user_id: str, request_id: str) -> PendingForget:
    """The person's names and keys, read from the store (in worker threads) before the forget deletes them."""
    names = await asyncio.to_thread(store.name_history, user_id)
    keys = await asyncio.to_thread(store.list_keys)
    theirs, others = ({m: [k.vector for k in keys if (k.user_id == user_id) == mine and k.modality == m]
                       for m in MODALITIES} for mine in (True, False))
    return PendingForget(request_id, user_id, names, name_pattern(names), theirs, others, time.monotonic())


class PendingForgets:
    """The forgets this process has taken up and not yet seen carried out, by request id. Touched on the
    event loop only (where the recorders record and cut)."""

    def __init__(self, memory: MemoryConfig):
        self.distance = {"face": memory.forget_face_distance, "voice": memory.forget_voice_distance}
        self.ttl_s = memory.forget_prepare_ttl_s
        self._pending: dict[str, PendingForget] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._pending

    def __len__(self) -> int:
        return len(self._pending)

    def pending(self) -> list[PendingForget]:
        self.expire()
        return list(self._pending.values())

    def add(self, p: PendingForget, recorders: Iterable[Any]) -> None:
        """Hold `p` and redact `recorders` with it at once (no chunk can be cut in between: one loop step)."""
        self._pending[p.request_id] = p
        self.redact_recordings(p, recorders)

    def redact_recordings(self, p: PendingForget, recorders: Iterable[Any]) -> None:
        for rec in recorders:
            redact_recording(rec, p.pattern, p.theirs, p.others, self.distance)

    def redact_chunk(self, chunk: StreamChunk) -> dict[str, int]:
        """Remove every pending person from a chunk just cut (recording.py `Recorder.cut`); returns what changed."""
        counts: dict[str, int] = {}
        for p in self.pending():
            for k, v in redact_in_memory(chunk, p.pattern, p.theirs, p.others, self.distance).items():
                counts[k] = counts.get(k, 0) + v
        return counts

    def complete(self, request_id: str, recorders: Iterable[Any]) -> PendingForget | None:
        """The person is forgotten: redact `recorders` once more (what they recorded since), then let go."""
        p = self._pending.pop(request_id, None)
        if p is not None:
            self.redact_recordings(p, recorders)
        return p

    def drop(self, request_id: str) -> None:
        """Let go without redacting (the forget failed or was given up)."""
        self._pending.pop(request_id, None)

    def expire(self) -> None:
        """Drop the forgets taken up more than `memory.forget_prepare_ttl_s` ago (never carried out)."""
        now = time.monotonic()
        for rid, p in list(self._pending.items()):
            if now - p.since > self.ttl_s:
                del self._pending[rid]
                log.warning("forget %s: announced %.0f s ago and not carried out (its orchestrator died?); "
                            "no longer redacting this process's chunks for it", rid, now - p.since)


class ForgetHost(Protocol):
    """What the two-phase forget needs of the process (services.py `Services` is one; named here, not
    imported, so services.py can hold a `PendingForgets` without an import cycle)."""

    cfg: Config
    store: MemoryStore
    streams: Mapping[str, Any]  # open streams, each with its `recorder`
    forgets: PendingForgets

    async def handoffs_done(self) -> None: ...


def _recorders(s: ForgetHost) -> list[Any]:
    return [st.recorder for st in list(s.streams.values())]


async def prepare_here(s: ForgetHost, user_id: str, request_id: str) -> PendingForget:
    """Phase 1 in this process: hold the person's names and keys, redact every stream's recording, and
    wait until the chunks cut before are in the job queue (where the forget redacts them)."""
    p = await read_person(s.store, user_id, request_id)
    s.forgets.add(p, _recorders(s))
    await s.handoffs_done()
    return p


def complete_here(s: ForgetHost, request_id: str) -> PendingForget | None:
    return s.forgets.complete(request_id, _recorders(s))


async def settle(s: ForgetHost) -> None:
    """Let go of the pending forgets whose person is gone (redacting once more first), and of expired ones."""
    for p in s.forgets.pending():
        if await asyncio.to_thread(s.store.resolve_user, p.user_id) is None:
            complete_here(s, p.request_id)


async def await_acks(s: ForgetHost, request_id: str) -> list[OrchestratorRecord]:
    """Phase 2's wait: until every other live orchestrator has acknowledged `request_id`, at most
    `memory.forget_prepare_timeout_s`; returns those that have not (the forget goes on without them)."""
    m = s.cfg.memory
    deadline = time.monotonic() + m.forget_prepare_timeout_s
    while True:
        live = await asyncio.to_thread(s.store.live_orchestrators, m.orchestrator_live_s)
        acked = await asyncio.to_thread(s.store.forget_acks, request_id)
        waiting = [o for o in live if o.origin != s.store.origin and o.origin not in acked]
        if not waiting or time.monotonic() >= deadline:
            return waiting
        await asyncio.sleep(min(m.forget_ack_poll_s, max(deadline - time.monotonic(), 0.0)))
