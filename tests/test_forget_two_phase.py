"""The two-phase forget across orchestrators sharing one store (orchestrator/forgets.py,
egomem/memory/sql/coordination.py), on SQLite (two orchestrators on one file) and PostgreSQL.

Orchestrators A and B run the real app (no Triton: their streams are `FakeStream`s holding a real
`Recorder` wired to B's pending forgets, as stream.py wires its own). A forget through A is announced
first; B redacts what its stream recorded of the person (a transcript line naming them, their face
and voice polls) while their names and keys are still in the store, keeps redacting every chunk it
cuts until the forget is done, and acknowledges. An orchestrator that is registered but never
acknowledges delays the forget by the timeout at most and is named in the answer; an announced
forget that never happens stops redacting after its TTL. Without the feature, B's chunk still holds
the person (the name line and their polls)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from egomem.memory.changes import Change
from egomem.memory.redact import MARKER
from tests.memory_helpers import near, unit
from tests.test_multi_process import Collector

FACE_MAX, VOICE_MAX, FACE_ANN = unit(11), unit(12, 256), unit(13)
FACE_MODEL, VOICE_MODEL = "test-face", "test-voice"
SPEAK = LISTEN = np.zeros(8, np.int64)
PCM = np.zeros(1920, np.float32)


def test_announcements_acknowledgements_and_the_registry(backend):
    """Store level: an announcement reaches another store's change feed naming the user id and the
    request only; an acknowledgement counts only while the announcement stands; the registry lists
    orchestrators by heartbeat age; the forget deletes the announcement and its acknowledgements, so
    its proof scan finds nothing of the person in the new tables."""
    writer, reader = backend.open(), backend.open()
    seen = Collector()
    feed = reader.change_feed(seen, poll_s=0.1)
    try:
        assert feed.ready.wait(10)
        max_ = writer.create_user("Max Moe")
        writer.add_key(max_.user_id, "face", FACE_MODEL, FACE_MAX)
        request = writer.announce_forget(max_.user_id)
        heard = seen.wait(lambda c: c.kind == "forget_prepare")
        assert heard.user_ids == (max_.user_id,) and heard.request == request
        assert "Max" not in heard.payload() and Change.parse(heard.payload()) == heard
        if backend.name == "postgres":
            assert heard.origin == writer.origin
        assert [a.user_id for a in reader.forget_announcements(60)] == [max_.user_id]

        reader.heartbeat("b:1")
        writer.heartbeat("a:1")
        assert {o.origin for o in writer.live_orchestrators(60)} == {reader.origin, writer.origin}
        time.sleep(0.05)
        assert writer.live_orchestrators(0.01) == []  # live means a recent heartbeat
        assert reader.ack_forget(request) and reader.ack_forget(request) is False  # once
        assert writer.forget_acks(request) == {reader.origin}

        receipt = writer.forget_user(max_.user_id)
        assert receipt.leftovers == [] and receipt.deleted["forget_prepares"] == 1
        assert writer.forget_acks(request) == set() and writer.forget_announcements(60) == []
        assert reader.ack_forget(request) is False  # too late: nothing to acknowledge
        assert writer.verify_forgotten(max_.user_id, [FACE_MAX], "Max Moe") == []
        writer.leave(reader.origin)
        assert [o.origin for o in writer.live_orchestrators(60)] == [writer.origin]
    finally:
        feed.close()
        writer.close()
        reader.close()


# -- two orchestrators -----------------------------------------------------------------------------

def _on_loop(o: Any, fn: Callable[[], Any]) -> Any:
    """Run `fn` on orchestrator `o`'s event loop (where its streams record and cut) and return its result."""

    async def call() -> Any:
        return fn()

    return asyncio.run_coroutine_threadsafe(call(), o._loop).result(10)


def _record(rec: Any, steps: list[tuple[str | None, np.ndarray | None, np.ndarray | None]]) -> None:
    """One tick per (transcript line, face poll, voice poll), each part optional, as a stream records them.
    A step belongs to whoever's poll is nearest (memory/chunk.py), so a line at Ann's step is hers."""
    for line, face, voice in steps:
        rec.tick(0, SPEAK, LISTEN, PCM, "")
        if line is not None:
            rec.transcript_line(line)
        if face is not None:
            rec.face(face)
        if voice is not None:
            rec.voice(voice)


def _has_max(chunk: Any, distance: float) -> list[str]:
    """What of Max a cut chunk still holds: his name in the text, a poll near his face or voice key."""
    out = [t for _, t in chunk.client_transcript + chunk.monologue if "Max" in t or "Moe" in t]
    for which, key in (("faces", FACE_MAX), ("voices", VOICE_MAX)):
        out += [f"{which} poll at step {s}" for s, v in getattr(chunk, which)
                if 1.0 - float(np.dot(v, key) / np.linalg.norm(v)) <= distance]
    return out


@contextlib.contextmanager
def _two_orchestrators(backend: Any, tmp_path: Any, **memory: Any) -> Iterator[tuple[Any, Any, Any, dict]]:
    """A and B on `backend`'s database, `memory` overriding [memory] keys; yields (a, b, store, users)
    with users Max Moe (face and voice keys) and Ann Lee (face key), and B registered as live."""
    from egomem.memory import open_store
    from tests.conftest import test_config
    from tests.orchestrator_harness import OrchestratorThread, orchestrator_config, wait_until

    cfgs = []
    for name in ("a", "b"):
        d = tmp_path / name
        d.mkdir()
        cfg = backend.configure(orchestrator_config(test_config(d), d, identify_models=False, retrieval=False))
        cfg.memory.change_poll_s = 0.1
        for k, v in memory.items():
            setattr(cfg.memory, k, v)
        cfgs.append(cfg)
    store = open_store(cfgs[0].memory)
    max_, ann = store.create_user("Max Moe"), store.create_user("Ann Lee")
    store.add_key(max_.user_id, "face", FACE_MODEL, FACE_MAX)
    store.add_key(max_.user_id, "voice", VOICE_MODEL, VOICE_MAX)
    store.add_key(ann.user_id, "face", FACE_MODEL, FACE_ANN)
    try:
        with OrchestratorThread(cfgs[0]) as a, OrchestratorThread(cfgs[1]) as b:
            live = lambda: {o.origin for o in store.live_orchestrators(cfgs[0].memory.orchestrator_live_s)}  # noqa: E731
            wait_until(lambda: {a.services.store.origin, b.services.store.origin} <= live(), 15)
            try:
                yield a, b, store, {"max": max_, "ann": ann}
            finally:  # a FakeStream never ends by itself: closed here, the app's shutdown does not wait for it
                for o in (a, b):
                    _on_loop(o, lambda o=o: [o.services.drop_stream(k) for k in list(o.services.streams)])
    finally:
        store.close()


def _stream_on(b: Any, user_id: str) -> Any:
    """A FakeStream of `user_id` opened on B, its recorder redacting as a real stream's does."""
    from egomem.orchestrator.recording import Recorder
    from tests.orchestrator_harness import FakeStream, wait_until

    st = FakeStream(user_id)
    st.recorder = Recorder("b-ann", record_audio=False, redactor=b.services.forgets)
    b._loop.call_soon_threadsafe(b.services.add_stream, "b-ann", st)
    wait_until(lambda: "b-ann" in b.services.streams, 5)
    return st


def _forget(a: Any, user_id: str) -> dict:
    from egomem.client import EgoMemClient
    from tests.orchestrator_harness import ADMIN_TOKEN, run

    async def go() -> dict:
        async with EgoMemClient(a.url, ADMIN_TOKEN) as c:
            return await c.forget(user_id)

    return run(go())


def test_a_forget_through_one_orchestrator_redacts_what_another_recorded(backend, tmp_path):
    with _two_orchestrators(backend, tmp_path) as (a, b, store, users):
        max_, ann = users["max"], users["ann"]
        st = _stream_on(b, ann.user_id)
        _on_loop(b, lambda: _record(st.recorder, [("I sailed with Max Moe on Sunday", near(FACE_ANN, 1), None),
                                                  ("the lake was calm", near(FACE_ANN, 2), None),
                                                  (None, near(FACE_MAX, 3), None), (None, None, near(VOICE_MAX, 4))]))
        distance = b.cfg.memory.forget_face_distance
        assert len(_has_max(_on_loop(b, lambda: _copy_cut(st.recorder)), distance)) == 3  # it was there

        res = _forget(a, max_.user_id)
        assert res["verified_leftovers"] == [] and res["receipt"]["leftovers"] == []
        assert res["unacknowledged"] == []  # B acknowledged (A waits for no one else)
        assert res["ack_wait_s"] < a.cfg.memory.forget_prepare_timeout_s

        chunk = _on_loop(b, st.recorder.cut)  # what B hands to the memory worker after the forget
        assert _has_max(chunk, distance) == [], chunk
        assert [t for _, t in chunk.client_transcript] == [f"I sailed with {MARKER} on Sunday", "the lake was calm"]
        assert len(chunk.faces) == 2 and chunk.voices == []  # Ann's polls stay, Max's go
        assert store.resolve_user(max_.user_id) is None
        from tests.orchestrator_harness import wait_until

        wait_until(lambda: len(b.services.forgets) == 0, 5)  # B let go of his names and keys


def _copy_cut(rec: Any) -> Any:
    """What `rec.cut()` would hand over now, leaving the recording as it is."""
    import copy

    return copy.deepcopy(rec).cut()


def test_an_orchestrator_that_never_acknowledges_delays_the_forget_by_the_timeout_at_most(backend, tmp_path):
    """A registered orchestrator that does not answer ("ghost": its row is fresh, no process behind it)
    holds the forget for `forget_prepare_timeout_s`, no longer, and is named in the answer and the log.
    Meanwhile B, which acknowledged, records the person again and cuts a chunk: it comes out redacted."""
    from tests.orchestrator_harness import wait_until

    timeout = 3.0
    with _two_orchestrators(backend, tmp_path, forget_prepare_timeout_s=timeout) as (a, b, store, users):
        max_, ann = users["max"], users["ann"]
        st = _stream_on(b, ann.user_id)
        store.heartbeat("ghost-host:8000", origin="ghost")
        answer: dict = {}
        started = time.monotonic()
        worker = threading.Thread(target=lambda: answer.update(_forget(a, max_.user_id)), daemon=True)
        worker.start()
        wait_until(lambda: store.forget_announcements(60), 10)
        (announced,) = store.forget_announcements(60)
        wait_until(lambda: b.services.store.origin in store.forget_acks(announced.request_id), timeout)
        assert worker.is_alive()  # A still waits for the ghost
        _on_loop(b, lambda: _record(st.recorder, [("Max Moe just waved at us", near(FACE_ANN, 5), None),
                                                  (None, near(FACE_MAX, 6), None)]))
        chunk = _on_loop(b, st.recorder.cut)  # cut while the forget is pending
        assert _has_max(chunk, b.cfg.memory.forget_face_distance) == [], chunk
        assert [t for _, t in chunk.client_transcript] == [f"{MARKER} just waved at us"] and len(chunk.faces) == 1
        worker.join(60)
        elapsed = time.monotonic() - started

    assert [u["origin"] for u in answer["unacknowledged"]] == ["ghost"], answer
    assert answer["unacknowledged"][0]["label"] == "ghost-host:8000"
    assert timeout <= answer["ack_wait_s"] < timeout + 1.0  # the wait ends at the timeout
    assert answer["verified_leftovers"] == [] and elapsed < timeout + 30  # then the forget runs as always


def test_an_announced_forget_that_never_happens_expires(backend, tmp_path):
    """The forgetting process died after announcing: B takes the announcement up, acknowledges, redacts
    chunks meanwhile, and lets go after `forget_prepare_ttl_s`; Max is not forgotten."""
    from tests.orchestrator_harness import wait_until

    ttl = 1.5
    with _two_orchestrators(backend, tmp_path, forget_prepare_timeout_s=0.5, forget_prepare_ttl_s=ttl,
                            orchestrator_heartbeat_s=0.2, orchestrator_live_s=2.0) as (a, b, store, users):
        st = _stream_on(b, users["ann"].user_id)
        request = store.announce_forget(users["max"].user_id)  # as A would, before dying
        wait_until(lambda: b.services.store.origin in store.forget_acks(request), 5)
        assert len(b.services.forgets) == 1
        _on_loop(b, lambda: _record(st.recorder, [("Max Moe is here", None, None)]))
        assert [t for _, t in _on_loop(b, st.recorder.cut).client_transcript] == [f"{MARKER} is here"]
        wait_until(lambda: len(b.services.forgets) == 0, ttl + 5)
        _on_loop(b, lambda: _record(st.recorder, [("Max Moe is here", None, None)]))
        assert [t for _, t in _on_loop(b, st.recorder.cut).client_transcript] == ["Max Moe is here"]
        assert store.resolve_user(users["max"].user_id) is not None
