"""Forget leaves nothing behind (issue #11), on both store backends (the `backend` fixture: real
SQLite files, and a real PostgreSQL server) and real chunk files:
(a) memory jobs still queued or running when the forget lands cannot bring the person back;
(b) the raw bytes of the database (SQLite: file and WAL; PostgreSQL: the tables' files) hold neither
the id nor the name afterwards;
(c) every name the person ever had is redacted, not only the current one;
plus (`sqlite_only`) the owner-only file modes of the database and the memory chunks."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import numpy as np
import pytest

from egomem.config import load_config
from egomem.memory.chunk import StreamChunk, submit_chunk
from egomem.memory.commit import derived_id
from egomem.memory.redact import MARKER, name_pattern
from egomem.memory.sqlite import SQLiteMemoryStore
from egomem.memory.store import MemoryStore
from egomem.memory.types import ItemDecision, Provenance, SessionCommit
from egomem.memory.worker import build_manager, process_next_job
from tests.memory_helpers import FACE_B, FACE_Z, VOICE_Z, ColumnLabeler, make_chunk, near


class GatedLabeler(ColumnLabeler):
    """Holds the worker right after it loaded the chunk, until the test lets it go (a forget lands meanwhile)."""

    def __init__(self) -> None:
        self.entered, self.go, self.calls = threading.Event(), threading.Event(), 0

    def label(self, tokens: np.ndarray) -> np.ndarray:
        self.calls += 1
        if self.calls == 1:
            self.entered.set()
            assert self.go.wait(60)
        return super().label(tokens)


def enrol_chunk() -> StreamChunk:
    return make_chunk("s1", 0, [
        {"span": (10, 60), "face": FACE_Z, "voice": VOICE_Z, "user": [(12, "Hi, my name is Zelda."), (25, "I live in Paris.")]},
        {"span": (90, 140), "face": FACE_B, "user": [(95, "I'm 40 years old.")]},
    ], audio=True)


def pending_chunk() -> StreamChunk:
    """Zelda talks (her face and voice), then Bob talks about her; the model names her too."""
    return make_chunk("s1", 1, [
        {"span": (10, 60), "face": FACE_Z, "voice": VOICE_Z,
         "user": [(15, "I live in Rome now."), (30, "My brother is called Quentin.")],
         "monologue": [(12, "Welcome back,"), (13, " Zelda.")]},
        {"span": (90, 140), "face": FACE_B,
         "user": [(95, "I like football."), (110, "My friend Zelda told me about Rome.")],
         "monologue": [(100, "Say hi to"), (101, " Zelda"), (102, " from me.")]},
    ], audio=True)


def cfg_for(tmp: Path, backend=None):
    cfg = load_config(env={})
    cfg.memory.database = tmp / "memory.sqlite3"
    if backend is not None:
        backend.configure(cfg)
    cfg.memory.chunk_dir = tmp / "chunks"
    cfg.memory.extractor = "rules"
    cfg.memory.job_retry_base_s = 0.0
    return cfg


def assert_zelda_gone(store: MemoryStore, zelda: str, vecs: list[np.ndarray], bob: str) -> None:
    """Nobody is Zelda again: no user of her name or with a key like hers, none of her facts
    anywhere; Bob's memories from the same chunk are kept (her name in them redacted)."""
    users = store.list_users()
    assert all("Zelda" not in u.name and "Quentin" not in u.name for u in users), [u.name for u in users]
    for k in store.list_keys():
        for v in (FACE_Z, VOICE_Z):
            if k.vector.shape == v.shape:
                assert float(k.vector @ v) < 0.5, (k.user_id, k.modality)
    texts = [i.text for u in users for i in store.items(u.user_id, history=True)]
    texts += [sm.text for u in users for sm in store.summaries(u.user_id)]
    assert not any("Rome" in t and "lives" in t for t in texts), texts
    assert ("football", "like") in [(p.text, p.polarity) for p in store.preferences(bob)]
    sess = [x for x in store.list_sessions(stream_id="s1") if x.chunk_index == 1 and x.user_id == bob]
    assert len(sess) == 1 and f"My friend {MARKER} told me about Rome." in sess[0].transcript
    assert f"Say hi to {MARKER} from me." in sess[0].transcript
    assert store.verify_forgotten(zelda, vecs, ["Zelda"]) == []
    assert not any(e.user_id == zelda for e in store.op_log())


def test_a_queued_job_cannot_bring_a_forgotten_person_back(tmp_path, backend):
    cfg = cfg_for(tmp_path, backend)
    store = backend.open()
    mgr = build_manager(cfg, store, labeler=ColumnLabeler())
    out = mgr.process_chunk(enrol_chunk())
    zelda, bob = out[0].user_id, out[1].user_id
    assert store.get_user(zelda).name == "Zelda"
    vecs = [k.vector for k in store.list_keys(user_id=zelda)]
    job = submit_chunk(store, cfg.memory.chunk_dir, pending_chunk())

    receipt = store.forget_user(zelda, reason="asked to be forgotten")
    assert receipt.leftovers == []
    chunks = store.op_log()[-1].detail["chunks"]
    assert chunks["chunks"] == 1 and chunks["faces"] == 5 and chunks["voices"] == 5, chunks
    # the files themselves no longer hold her: no poll of hers, her lines gone, her audio silenced
    c = StreamChunk.load(Path(job.payload["chunk_dir"]))
    assert c.redactions == 1 and store.get_job(job.job_id).status == "queued"
    assert [t for t, _ in c.faces] == [95, 105, 115, 125, 135] and c.voices == []
    assert [t for _, t in c.client_transcript] == ["I like football.", f"My friend {MARKER} told me about Rome."]
    assert "Zelda" not in " ".join(t for _, t in c.monologue) and (100, "Say hi to") in c.monologue
    assert not c.listen_audio[10 * 1920:61 * 1920].any() and c.listen_audio[90 * 1920:141 * 1920].all()

    done = process_next_job(mgr, cfg, "w1")
    assert done.status == "done", done.error
    assert_zelda_gone(store, zelda, vecs, bob)
    raw = backend.raw_bytes(store)
    assert b"Zelda" not in raw and zelda.encode() not in raw


def test_a_running_job_that_read_the_chunk_before_the_forget_cannot_commit_it(tmp_path, backend):
    cfg = cfg_for(tmp_path, backend)
    store = backend.open()
    out = build_manager(cfg, store, labeler=ColumnLabeler()).process_chunk(enrol_chunk())
    zelda, bob = out[0].user_id, out[1].user_id
    vecs = [k.vector for k in store.list_keys(user_id=zelda)]
    job = submit_chunk(store, cfg.memory.chunk_dir, pending_chunk())
    gate = GatedLabeler()
    mgr = build_manager(cfg, store, labeler=gate)
    result: list = []
    worker = threading.Thread(target=lambda: result.append(process_next_job(mgr, cfg, "w1")))
    worker.start()
    try:
        assert gate.entered.wait(60)  # the worker holds the lease and the chunk as it was
        assert store.get_job(job.job_id).status == "running"
        store.forget_user(zelda, reason="asked to be forgotten")
        assert store.get_job(job.job_id).max_attempts == job.max_attempts + 1  # the refusal costs no attempt
        # an LLM answer the running job stores after the forget, made from the unredacted text
        store.put_llm_response("late", derived_id("session", "s1", 1, 10, 60), "m", "extract", {"name": "Zelda"})
    finally:
        gate.go.set()
        worker.join(60)
    first = result[0]
    assert first.status == "queued" and "ChunkRedacted" in first.error, first
    assert store.get_llm_response("late") is None  # dropped with the refused commit
    assert store.list_sessions(stream_id="s1") and all(x.chunk_index == 0 for x in store.list_sessions(stream_id="s1"))
    again = process_next_job(mgr, cfg, "w1")  # the retry reads the redacted files
    assert again.status == "done", again.error
    assert_zelda_gone(store, zelda, vecs, bob)


def test_raw_database_bytes_hold_no_trace_and_the_check_reads_them(backend, monkeypatch):
    """SQLite: secure_delete zeroes deleted cells, but forget's own deletes rebalance pages while the
    person's later rows still exist, leaving stale copies in the pages' unallocated gaps. PostgreSQL:
    a deleted or updated row stays in the table file until a vacuum; VACUUM FULL writes new files."""
    def populate(db: str) -> tuple[MemoryStore, str]:
        s = backend.open(db, synchronous="NORMAL")
        others = [s.create_user(f"Other {i}") for i in range(10)]
        victim = s.create_user("Victor Vexley")
        for r in range(100):
            s.add_fact(victim.user_id, f"Victor Vexley fact {r} " + "v" * 300)
            s.add_fact(others[r % 10].user_id, f"short {r}")
        return s, victim.user_id

    s, vid = populate("a")
    receipt = s.forget_user(vid)
    assert receipt.leftovers == [] and receipt.wal_clean
    raw = backend.raw_bytes(s, "a")
    for needle in (vid.encode(), vid[:8].encode(), b"Victor Vexley", b"victor vexley"):
        assert needle not in raw, needle

    # the proof scan reads the file's bytes, not only its cells: without the VACUUM it sees the stale copies
    monkeypatch.setattr(backend.store_class, "_scrub", lambda self: True)
    s, vid = populate("b")
    receipt = s.forget_user(vid)
    assert any("(id," in h and h.endswith(" byte matches)") for h in receipt.leftovers), receipt.leftovers
    assert all(h.endswith("matches)") for h in receipt.leftovers), receipt.leftovers  # files only: no cell holds it
    assert any("(id," in h for h in s.verify_forgotten(vid))
    s.close()


def test_every_name_the_person_had_is_redacted(backend):
    s = backend.open()
    max_ = s.create_user("Max Moe")
    s.rename_user(max_.user_id, "Maximilian Moe-Ortega", reason="corrected by Max Moe")  # PATCH /api/users/{id}
    ann = s.create_user("Ann Lee")
    s.add_fact(ann.user_id, "works with Max Moe on radar", reason="Ann said Max Moe is her colleague")
    s.add_fact(ann.user_id, "lunches with Maximilian Moe-Ortega")
    s.commit_session(SessionCommit(
        session_id="sess-a", stream_id="st", chunk_index=0, start_step=0, end_step=9, valid_from=5.0,
        provenance=Provenance("memory_manager", "rule_fallback", session_id="sess-a"), user_id=ann.user_id,
        summary="Ann talked about max moe", transcript="USER: Max  Moe and I build radars",
        decisions=[ItemDecision("add", "fact", "admires MAX MOE", reason="said so")]))
    assert s.name_history(max_.user_id) == ["Maximilian Moe-Ortega", "Max Moe"]

    receipt = s.forget_user(max_.user_id)
    assert receipt.leftovers == []
    assert sorted(f.text for f in s.facts(ann.user_id)) == sorted(
        [f"works with {MARKER} on radar", f"lunches with {MARKER}", f"admires {MARKER}"])
    assert s.summaries(ann.user_id)[0].text == f"Ann talked about {MARKER}"
    assert s.get_session("sess-a").transcript == f"USER: {MARKER} and I build radars"
    logged = " ".join(f"{e.reason} {e.detail}" for e in s.op_log())
    assert "Max" not in logged and "Moe" not in logged, logged
    assert s.verify_forgotten(max_.user_id, name=["Max Moe", "Maximilian Moe-Ortega"]) == []
    raw = backend.raw_bytes(s)
    for needle in (b"Max Moe", b"max moe", b"MAX MOE", b"Maximilian", max_.user_id.encode()):
        assert needle not in raw, needle


@pytest.mark.sqlite_only
def test_database_and_chunk_files_are_owner_only(tmp_path):
    """SQLite only: the modes of its database files (and of the chunk files, which do not depend on the backend)."""
    old = os.umask(0o022)  # the usual umask: without care, files come out 0644 and folders 0755
    try:
        db = tmp_path / "runs" / "memory.sqlite3"
        s = SQLiteMemoryStore(db)
        s.create_user("Ada")
        files = [p for p in db.parent.iterdir()]
        assert {p.name for p in files} >= {"memory.sqlite3", "memory.sqlite3-wal", "memory.sqlite3-shm"}
        for p in files:
            assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
        assert stat.S_IMODE(db.parent.stat().st_mode) == 0o700
        s.close()
        os.chmod(db, 0o644)  # a database made by an older version: narrowed on open
        SQLiteMemoryStore(db).close()
        assert stat.S_IMODE(db.stat().st_mode) == 0o600

        s = SQLiteMemoryStore(tmp_path / "m2.sqlite3")
        job = submit_chunk(s, tmp_path / "memory_chunks", enrol_chunk())
        folder = Path(job.payload["chunk_dir"])
        for d in (tmp_path / "memory_chunks", folder.parent, folder):
            assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
        for f in folder.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
        # a forget's rewrite keeps them owner-only
        from egomem.memory.chunk import redact_chunk

        pat = name_pattern(["Zelda"])
        assert redact_chunk(folder, pat, {"face": [FACE_Z]}, {}, {"face": 0.3, "voice": 0.35})
        for f in folder.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
        s.close()
    finally:
        os.umask(old)


def test_redact_chunk_splits_names_across_pieces_and_keeps_others():
    from egomem.memory.chunk import redact_pieces

    pat = name_pattern(["Max Moe"])
    pieces = [(1, "Hello"), (2, " Max"), (3, " Moe,"), (4, " and"), (5, " max moe again")]
    out, n = redact_pieces(pieces, pat)
    assert n == 2 and " ".join(t.strip() for _, t in out) == f"Hello {MARKER} , and {MARKER} again"
    assert redact_pieces([(1, "Maxine Moe"), (2, "Max Moexx")], pat) == ([(1, "Maxine Moe"), (2, "Max Moexx")], 0)


def test_forget_through_the_served_api_redacts_every_name_and_scans_the_file(tmp_path, backend):
    """PATCH renames Max, DELETE forgets him: the old name and the new one are gone from Ann's facts
    and the op log as the API returns them, the verification scans the database bytes, and the
    database file holds neither name nor id."""
    from egomem.client import EgoMemClient
    from egomem.memory import open_store
    from tests.conftest import test_config
    from tests.orchestrator_harness import ADMIN_TOKEN, OrchestratorThread, orchestrator_config, run

    cfg = backend.configure(orchestrator_config(test_config(tmp_path), tmp_path, identify_models=False,
                                                retrieval=False))
    store = open_store(cfg.memory)
    max_, ann = store.create_user("Max Moe"), store.create_user("Ann Lee")
    store.add_fact(ann.user_id, "works with Max Moe on radar")
    store.close()
    with OrchestratorThread(cfg) as o:
        async def go():
            async with EgoMemClient(o.url, ADMIN_TOKEN) as c:
                await c.rename(max_.user_id, "Maximilian Moe")
                await c.add_fact(ann.user_id, "sails with Maximilian Moe")
                res = await c.forget(max_.user_id)
                return res, await c.facts(ann.user_id, history=True), await c.oplog()

        res, facts, ops = run(go())
    assert res["verified_leftovers"] == [] and res["receipt"]["leftovers"] == [], res
    assert res["receipt"]["redacted"]["memory_items.text"] == 2
    assert sorted(f["text"] for f in facts) == [f"sails with {MARKER}", f"works with {MARKER} on radar"]
    assert "Max" not in str(ops) and max_.user_id not in str(ops)
    raw = backend.raw_bytes(open_store(cfg.memory))
    for needle in (b"Max Moe", b"Maximilian", max_.user_id.encode()):
        assert needle not in raw, needle


def test_the_check_reads_waiting_chunks_and_reports_one_it_cannot_redact(tmp_path, monkeypatch, backend):
    from egomem.memory.sql import forget as shared_forget

    store = backend.open()
    zelda = store.create_user("Zelda")
    chunks = tmp_path / "chunks"
    named = submit_chunk(store, chunks, make_chunk("s1", 0, [{"span": (90, 140), "face": FACE_B,
                                                              "user": [(95, "My friend Zelda is here.")]}], audio=True))
    broken = submit_chunk(store, chunks, make_chunk("s1", 1, [{"span": (90, 140), "user": [(95, "Hello Zelda.")]}], audio=True))
    (Path(broken.payload["chunk_dir"]) / "arrays.npz").write_bytes(b"not a zip")
    real = shared_forget.redact_chunk
    monkeypatch.setattr(shared_forget, "redact_chunk", lambda folder, *a: {} if folder.name == "00000000" else real(folder, *a))
    receipt = store.forget_user(zelda.user_id)
    assert any(h.startswith("chunk ") and h.endswith("00000000 of job " + named.job_id + " (name, 1 matches)")
               for h in receipt.leftovers), receipt.leftovers
    assert any("00000001 (unreadable" in h for h in receipt.leftovers), receipt.leftovers
    store.close()


def test_a_recording_not_yet_cut_loses_the_person_before_it_becomes_a_chunk():
    """An open stream's recorder (orchestrator/recording.py) holds polls and lines that become a chunk
    only at the next cut: the forget redacts them in memory first."""
    from egomem.memory.chunk import redact_recording
    from orchestrator.recording import Recorder

    rec = Recorder("live", record_audio=True)
    for step in range(60):
        rec.tick(0, np.zeros(8, np.int64), np.zeros(8, np.int64), np.full(1920, 0.5, np.float32), "")
        if step in (5, 15):
            rec.face(near(FACE_Z, step))
            rec.voice(near(VOICE_Z, step))
        if step in (40, 50):
            rec.face(near(FACE_B, step))
        if step == 8:
            rec.transcript_line("I live in Rome now.")
        if step == 45:
            rec.transcript_line("My friend Zelda moved to Rome.")
    counts = redact_recording(rec, name_pattern(["Zelda"]), {"face": [FACE_Z], "voice": [VOICE_Z]},
                              {"face": [FACE_B]}, {"face": 0.3, "voice": 0.35})
    assert counts["faces"] == 2 and counts["voices"] == 2 and counts["client_transcript_dropped"] == 1
    chunk = rec.cut()
    assert [t for t, _ in chunk.faces] == [40, 50] and chunk.voices == []
    assert chunk.client_transcript == [(45, f"My friend {MARKER} moved to Rome.")]
    assert not chunk.listen_audio[:28 * 1920].any() and chunk.listen_audio[28 * 1920:].all()  # steps 0..27: hers


@pytest.mark.sqlite_only
def test_a_chunk_cut_before_the_forget_reaches_the_queue_first_and_is_redacted(tmp_path):
    """SQLite only (its write lock holds the hand-off back). A stream cut its recording (naming Zelda) just before an admin forgets her; the chunk's way into
    the job queue is still under way (here: held behind the database's write lock). The forget waits
    for the hand-off (`Services.handoffs_done`), so its pass over the queue finds and redacts the chunk,
    instead of the chunk landing unredacted after it."""
    import asyncio
    import sqlite3
    import time

    from egomem.client import EgoMemClient
    from egomem.memory import open_store
    from egomem.memory.chunk import StreamChunk
    from orchestrator.recording import Recorder
    from tests.conftest import test_config
    from tests.orchestrator_harness import ADMIN_TOKEN, OrchestratorThread, orchestrator_config, run

    cfg = orchestrator_config(test_config(tmp_path), tmp_path, identify_models=False, retrieval=False)
    store = open_store(cfg.memory)
    zelda = store.create_user("Zelda")
    store.close()
    rec = Recorder("live", record_audio=False)
    for step in range(20):
        rec.tick(0, np.zeros(8, np.int64), np.zeros(8, np.int64), np.zeros(1920, np.float32), "")
        if step == 5:
            rec.transcript_line("My friend Zelda says hi.")
    with OrchestratorThread(cfg) as o:
        services = o.services
        blocker = sqlite3.connect(cfg.memory.database, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")  # the database's write lock: the chunk's job insert waits for it

        async def hand_off():  # what Stream.flush_memory does: cut, then submit in a worker thread
            with services.handoff():
                chunk = rec.cut()
                return await asyncio.to_thread(submit_chunk, services.store, cfg.memory.chunk_dir, chunk)

        handoff = asyncio.run_coroutine_threadsafe(hand_off(), o._loop)
        time.sleep(0.3)  # cut, and blocked in its insert
        result: dict[str, object] = {}

        async def forget():
            async with EgoMemClient(o.url, ADMIN_TOKEN) as c:
                result["forget"] = await c.forget(zelda.user_id)

        admin = threading.Thread(target=lambda: run(forget()))
        admin.start()
        time.sleep(1.0)
        assert "forget" not in result  # it waits for the hand-off, which waits for the lock
        blocker.execute("COMMIT")
        blocker.close()
        job = handoff.result(60)
        admin.join(60)
    res = result["forget"]
    assert res["verified_leftovers"] == [], res
    chunk = StreamChunk.load(Path(job.payload["chunk_dir"]))
    assert chunk.client_transcript and not any("Zelda" in t for _, t in chunk.client_transcript), chunk.client_transcript
    assert any(MARKER in t for _, t in chunk.client_transcript)
