"""The memory store on both backends (the `backend` fixture: real SQLite files, and a real PostgreSQL
server): history, forget, merge, the op log, the job queue, migrations and concurrent writers
(threads and processes). Tests marked `sqlite_only` check what only SQLite has (WAL, its files)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading

import numpy as np
import pytest

from egomem.config import IdentityConfig
from egomem.identity import StoreBackedIdentifier
from egomem.identity.identify import FACE_MODEL_IDS, VOICE_MODEL_IDS
from egomem.memory.errors import StoreError, VersionConflict
from egomem.memory.redact import MARKER, mentions, name_pattern, redact
from egomem.memory.sqlite import SQLiteMemoryStore
from egomem.memory.store import PROFILE_LINE_LABELS, MemoryStore
from egomem.memory.types import ItemDecision, NewKey, PersonaUpdate, Provenance, SessionCommit

PY = sys.executable
FACE_MODEL, VOICE_MODEL = FACE_MODEL_IDS["dlib"], VOICE_MODEL_IDS["resemblyzer"]  # the [identity] defaults


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def unit(seed: int, d: int = 128) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(d).astype(np.float32)
    return v / np.linalg.norm(v)


def test_supersede_keeps_history_and_logs_reasons(backend):
    s = backend.open()
    u = s.create_user("Ada")
    a = s.add_item(u.user_id, "fact", "lives in Paris", key="lives_in")
    b = s.supersede_item(a, "lives in Rome", reason="said she moved")
    p = s.add_item(u.user_id, "preference", "jazz", polarity="like")
    s.retract_item(p, reason="no longer true")

    assert [f.text for f in s.facts(u.user_id)] == ["lives in Rome"]
    assert s.preferences(u.user_id) == []
    hist = {i.item_id: i for i in s.items(u.user_id, history=True)}
    assert hist[a].invalid_at is not None and hist[a].superseded_by == b and hist[a].text == "lives in Paris"
    assert hist[b].invalid_at is None and hist[b].key == "lives_in"
    assert hist[p].invalid_at is not None and hist[p].superseded_by is None
    ops = [(e.op, e.target, e.reason) for e in s.op_log(u.user_id)]
    assert ("supersede", f"memory_items:{a}", "said she moved") in ops
    assert ("retract", f"memory_items:{p}", "no longer true") in ops
    with pytest.raises(StoreError, match="no longer current"):
        s.supersede_item(a, "lives in Oslo")


def test_op_log_is_append_only(backend):
    s = backend.open()
    s.create_user("Ada")
    c = s._conn()
    with pytest.raises(backend.db_error, match="append-only"):
        c.execute("UPDATE op_log SET reason = 'x'")
    with pytest.raises(backend.db_error, match="append-only"):
        c.execute("DELETE FROM op_log")
    # forget's guard lets it redact the free text (reason, detail), never rewrite what happened
    c.execute("BEGIN")
    c.execute("INSERT INTO forget_guard (active) VALUES (1)")
    for col, val in [("op", "'x'"), ("user_id", "'someone'"), ("ts", "0"), ("actor", "'x'"), ("target", "'x'")]:
        c.execute("SAVEPOINT attempt")  # PostgreSQL aborts the whole transaction on an error, SQLite the statement
        with pytest.raises(backend.db_error, match="append-only"):
            c.execute(f"UPDATE op_log SET {col} = {val}")
        c.execute("ROLLBACK TO SAVEPOINT attempt")
    c.execute("UPDATE op_log SET reason = 'redacted'")
    c.execute("ROLLBACK")
    assert len(s.op_log()) == 1 and s.op_log()[0].reason != "redacted" and s.op_log()[0].op == "create_user"


def _populate_zelda(s: MemoryStore) -> tuple[str, str, list[np.ndarray]]:
    """Zelda (to forget) and Bob (to keep), linked both ways, with a processed session."""
    bob = s.create_user("Bob")
    s.add_fact(bob.user_id, "plays chess", key="hobby")
    face, voice = unit(1), unit(2, 256)
    prov = Provenance("memory_manager", "rule_fallback", session_id="sess-z", llm_model="rule-based-fallback")
    s.commit_session(SessionCommit(
        session_id="sess-z", stream_id="st", chunk_index=0, start_step=0, end_step=99, valid_from=5.0,
        provenance=prov, new_user_id="zid-0123456789abcdef", name="Zelda Quixbury",
        keys=[NewKey("face", FACE_MODEL, face), NewKey("voice", VOICE_MODEL, voice)],
        decisions=[ItemDecision("add", "fact", "Zelda Quixbury lives in Oslo", "lives_in"),
                   ItemDecision("add", "preference", "sailing", polarity="like")],
        persona=[PersonaUpdate(3, 0.9, 0.7, "Zelda Quixbury talks to everyone")],
        summary="Zelda Quixbury talked about sailing", relations=[("Bob", "friend"), ("Quentin Zorblat", "brother")],
        transcript="USER (client transcript): my name is Zelda Quixbury", transcript_source="client+monologue"))
    zid = "zid-0123456789abcdef"
    s.add_relation(bob.user_id, zid, "neighbour")
    s.put_llm_response("h1", "sess-z", "m", "extract", {"name": "Zelda Quixbury"})
    s.add_dead_letter("llm", "update", {"messages": "Zelda Quixbury ..."}, "HTTP 500", 4, session_id="sess-z")
    return zid, bob.user_id, [face, voice]


def test_forget_leaves_no_trace_in_any_table_index_or_file(backend):
    s = backend.open()
    zid, bob, vectors = _populate_zelda(s)
    ident = StoreBackedIdentifier(s, IdentityConfig())  # the one identifier, [identity] defaults
    assert ident.identify(vectors[0][None], None).user_id == zid
    assert s.verify_forgotten(zid, vectors, "Zelda Quixbury")  # the scan does see her before

    receipt = s.forget_user(zid, Provenance("admin", "manual"), reason="user asked")
    assert receipt.leftovers == [] and receipt.wal_clean
    assert receipt.deleted["biometric_keys"] == 2 and receipt.deleted["sessions"] == 1
    assert s.verify_forgotten(zid, vectors, "Zelda Quixbury") == []
    assert s.verify_forgotten(zid, vectors, "Quentin Zorblat") == []  # the brother only she mentioned
    # not in the bytes of the database files either (sqlite: secure_delete + WAL truncated; postgres: VACUUM FULL)
    raw = backend.raw_bytes(s)
    for needle in [zid.encode(), b"Zelda Quixbury", b"Quentin Zorblat"] + [v.astype("<f4").tobytes() for v in vectors]:
        assert needle not in raw
    s = backend.open()
    # Bob keeps his own memories; the forget itself is logged, naming no one
    assert [f.text for f in s.facts(bob)] == ["plays chess"] and s.relations(bob) == []
    last = s.op_log()[-1]
    assert last.op == "forget" and last.user_id is None and last.detail["forget_id"] == receipt.forget_id
    assert zid not in StoreBackedIdentifier(s, IdentityConfig()).indexed_users()
    assert ident.identify(vectors[0][None], None).user_id is None  # the live index rebuilt itself
    assert s.dead_letters() == [] and s.get_llm_response("h1") is None


def test_postgres_forget_waits_for_a_reader_that_began_before_it(tmp_path, pg_server):
    """VACUUM FULL copies a deleted row version a running transaction may still see: a reader whose snapshot
    predates the forget would keep her id in the table files. The forget waits for it to end, then scrubs."""
    import psycopg

    from tests.memory_helpers import StoreBackend

    backend = StoreBackend("postgres", tmp_path, pg_server, prefix="snap")
    s = backend.open()
    zid, _, vectors = _populate_zelda(s)
    reader = psycopg.connect(backend.target())
    reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    assert reader.execute("SELECT COUNT(*) FROM memory_items WHERE user_id = %s", (zid,)).fetchone()[0] > 0
    ended = threading.Event()

    def end_later() -> None:
        ended.wait(0.5)
        reader.commit()
        ended.set()

    t = threading.Thread(target=end_later)
    t.start()
    try:
        receipt = s.forget_user(zid, Provenance("admin", "manual"), reason="user asked")
    finally:
        ended.set()
        t.join()
        reader.close()
    assert receipt.leftovers == [] and receipt.wal_clean
    assert zid.encode() not in backend.raw_bytes(s)


def test_redaction_rule_whole_name_words_case_whitespace_json():
    pat = name_pattern(["Zoë  Quist"])
    assert redact("met zoë quist's dog; ZOË\nQUIST too", pat) == f"met {MARKER}'s dog; {MARKER} too"
    assert redact("Zoë called; Zoë Quistberg and MacZoë Quist", pat) == "Zoë called; Zoë Quistberg and MacZoë Quist"
    raw = json.dumps({"people": [["Zoë Quist", "colleague"]], "n": 3}, sort_keys=True)  # stored as Zo\u00eb
    assert "Zoë" not in raw and mentions(raw, pat)
    assert json.loads(redact(raw, pat)) == {"people": [[MARKER, "colleague"]], "n": 3}
    assert not mentions(redact(raw, pat), pat) and redact(b"Zo\xc3\xab Quist", pat) == b"Zo\xc3\xab Quist"
    assert name_pattern(["unknown_user", "  "]) is None


def test_forget_redacts_the_name_from_other_users_memories(backend):
    """Ann mentions Zoë Quist by name in a transcript, facts (one superseded), a summary, persona
    evidence, an op-log reason, an LLM answer and a dead letter; forget(Zoë) leaves the name nowhere."""
    s = backend.open()
    zoe = s.create_user("Zoë Quist")
    s.add_key(zoe.user_id, "face", "m_face", unit(7))
    s.add_fact(zoe.user_id, "builds radar antennas")
    ann = s.create_user("Ann Lee")
    s.add_fact(ann.user_id, "plays chess", key="hobby")
    prov = Provenance("memory_manager", "rule_fallback", session_id="sess-a", llm_model="rule-based-fallback")
    s.commit_session(SessionCommit(
        session_id="sess-a", stream_id="st-a", chunk_index=0, start_step=0, end_step=99, valid_from=5.0,
        provenance=prov, user_id=ann.user_id,
        decisions=[ItemDecision("add", "fact", "works with Zoë Quist", "colleague",
                                reason="said her colleague ZOË QUIST helps her")],
        persona=[PersonaUpdate(4, 0.8, 0.6, "admires zoë quist")],
        summary="Ann talked about her colleague Zoë  Quist and chess", relations=[("Zoë Quist", "colleague")],
        transcript="USER: my colleague Zoë Quist from work\nUSER: Zoë was late", transcript_source="client+monologue"))
    old = next(i for i in s.facts(ann.user_id) if "Zoë" in i.text)
    s.supersede_item(old.item_id, "works with Zoë Quist on radar", reason="Zoë Quist moved teams")
    s.put_llm_response("ha", "sess-a", "m", "extract", {"relations": [["Zoë Quist", "colleague"]]})
    s.add_dead_letter("llm", "update", {"messages": "Ann: Zoë Quist ..."}, "HTTP 500", 4, session_id="sess-a")
    assert s.relations(ann.user_id)  # the mention made the relation to the real Zoë

    receipt = s.forget_user(zoe.user_id, reason="asked to be forgotten")
    assert receipt.leftovers == [] and receipt.wal_clean
    for cell in ["sessions.transcript", "summaries.text", "persona.evidence", "op_log.reason",
                 "llm_calls.response", "dead_letters.payload"]:
        assert receipt.redacted.get(cell, 0) >= 1, cell
    assert receipt.redacted["memory_items.text"] == 2  # the superseded (history) row too
    assert s.verify_forgotten(zoe.user_id, name="Zoë Quist") == []
    raw = backend.raw_bytes(s)
    for needle in ["Zoë Quist", "ZOË QUIST", "zoë quist", "Zoë  Quist", "Zo\\u00eb Quist", zoe.user_id]:
        assert needle.encode() not in raw, needle

    s = backend.open()
    # Ann's memories stay, readable, with the marker where the name was; the first name alone stays
    assert sorted(f.text for f in s.facts(ann.user_id)) == ["plays chess", f"works with {MARKER} on radar"]
    hist = sorted(i.text for i in s.items(ann.user_id, "fact", history=True))
    assert hist == ["plays chess", f"works with {MARKER}", f"works with {MARKER} on radar"]
    assert s.summaries(ann.user_id)[0].text == f"Ann talked about her colleague {MARKER} and chess"
    assert s.persona(ann.user_id)[4].evidence == f"admires {MARKER}"
    assert s.get_session("sess-a").transcript == f"USER: my colleague {MARKER} from work\nUSER: Zoë was late"
    assert s.get_llm_response("ha") == {"relations": [[MARKER, "colleague"]]}
    assert s.dead_letters()[0].payload == {"messages": f"Ann: {MARKER} ..."}
    assert s.relations(ann.user_id) == [] and [u.name for u in s.list_users()] == ["Ann Lee"]
    assert f"said her colleague {MARKER} helps her" in [e.reason for e in s.op_log(ann.user_id)]
    last = s.op_log()[-1]
    assert last.op == "forget" and last.detail["redacted"] == receipt.redacted
    with pytest.raises(backend.db_error, match="append-only"):  # the log is still append-only
        s._conn().execute("UPDATE op_log SET reason = 'x'")
    s.close()


def test_merge_users_moves_everything_and_leaves_a_tombstone(backend):
    s = backend.open()
    a, b = s.create_user("Ada"), s.create_user()
    s.add_key(b.user_id, "face", "m", unit(3))
    s.add_item(b.user_id, "fact", "has a cat")
    s.update_persona(b.user_id, [PersonaUpdate(0, 0.2, 0.9, "x")])
    s.update_persona(a.user_id, [PersonaUpdate(0, 0.8, 0.3, "y")])
    s.add_relation(a.user_id, b.user_id, "friend")
    gen = s.keys_generation()
    kept = s.merge_users(a.user_id, b.user_id, reason="same person, two faces")
    assert kept.name == "Ada" and s.keys_generation() > gen
    assert s.resolve_user(b.user_id).user_id == a.user_id and s.get_user(b.user_id).merged_into == a.user_id
    assert [f.text for f in s.facts(a.user_id)] == ["has a cat"]
    assert s.persona(a.user_id)[0].value == pytest.approx(0.2)  # the more confident one
    assert s.relations(a.user_id) == []  # a self-relation makes no sense
    assert {k.user_id for k in s.list_keys()} == {a.user_id}
    assert [u.user_id for u in s.list_users()] == [a.user_id]
    with pytest.raises(StoreError, match="merged into"):
        s.add_item(b.user_id, "fact", "x")


def test_commit_session_is_idempotent_and_version_guarded(backend):
    s = backend.open()
    u = s.create_user("Ada")
    prov = Provenance("t", "manual", session_id="s1")
    c = SessionCommit("s1", "st", 0, 0, 9, 1.0, prov, user_id=u.user_id, expected_version=u.version,
                      decisions=[ItemDecision("add", "fact", "likes tea")], summary="tea talk")
    assert s.commit_session(c) is True
    before = (s.items(u.user_id, history=True), s.summaries(u.user_id), len(s.op_log()), s.get_user(u.user_id).version)
    assert s.commit_session(c) is False  # the same session again changes nothing
    assert (s.items(u.user_id, history=True), s.summaries(u.user_id), len(s.op_log()),
            s.get_user(u.user_id).version) == before
    stale = SessionCommit("s2", "st", 0, 10, 19, 2.0, prov, user_id=u.user_id, expected_version=u.version,
                          decisions=[ItemDecision("add", "fact", "x")])
    with pytest.raises(VersionConflict):
        s.commit_session(stale)
    assert s.get_session("s2") is None and len(s.facts(u.user_id)) == 1  # nothing of it was written


def test_job_queue_survives_restart_leases_retries_and_dead_letters(backend):
    clock = Clock()
    s = backend.open(clock=clock)
    j1 = s.enqueue_job("memory_chunk", "k1", {"chunk_dir": "/a"}, max_attempts=2)
    assert s.enqueue_job("memory_chunk", "k1", {"chunk_dir": "/other"}).job_id == j1.job_id  # idempotent by key
    s.enqueue_job("memory_chunk", "k2", {"chunk_dir": "/b"})
    claimed = s.claim_job("w1", lease_s=10)
    assert claimed.job_id == j1.job_id and claimed.attempts == 1
    s.close()

    s = backend.open(clock=clock)  # restart: jobs, payloads and the lease are still there
    jobs = {j.key: j for j in s.list_jobs()}
    assert jobs["k1"].status == "running" and jobs["k1"].payload == {"chunk_dir": "/a"}
    assert jobs["k2"].status == "queued"
    j2 = s.claim_job("w2", 10)
    assert j2.key == "k2" and s.complete_job(j2.job_id, "w2", {}) is True
    assert s.claim_job("w2", 10) is None  # k1 is still leased to w1
    clock.t += 11  # w1 died: its lease runs out and w2 takes the job over
    again = s.claim_job("w2", 10)
    assert again.job_id == j1.job_id and again.attempts == 2 and again.worker == "w2"
    assert s.complete_job(j1.job_id, "w1", {}) is False  # the dead worker's late completion is refused
    dead = s.fail_job(j1.job_id, "w2", "boom", retry_in_s=5)
    assert dead.status == "dead"  # 2 of 2 attempts used
    letters = s.dead_letters()
    assert len(letters) == 1 and letters[0].source == "job" and letters[0].payload["payload"] == {"chunk_dir": "/a"}
    back = s.requeue_dead_letter(letters[0].dl_id)
    assert back.status == "queued" and back.attempts == 0 and s.dead_letters() == []
    j = s.claim_job("w3", 10)
    assert j.job_id == j1.job_id
    assert s.fail_job(j.job_id, "w3", "flaky", retry_in_s=30).status == "queued"
    assert s.claim_job("w3", 10) is None  # not before its retry time
    clock.t += 31
    assert s.claim_job("w3", 10).job_id == j1.job_id
    assert s.complete_job(j1.job_id, "w3", {"ok": 1}) is True
    done = s.get_job(j1.job_id)
    assert done.status == "done" and done.payload is None and done.result == {"ok": 1}


def test_forward_migration_and_refusing_a_newer_schema(backend, monkeypatch):
    mod = backend.connection_module  # where the backend's store reads MIGRATIONS / SCHEMA_VERSION
    real, current = dict(mod.MIGRATIONS), mod.SCHEMA_VERSION
    monkeypatch.setattr(mod, "MIGRATIONS", {1: real[1]})  # a database made by the first release
    monkeypatch.setattr(mod, "SCHEMA_VERSION", 1)
    s = backend.open()
    u = s.create_user("Ada")
    assert s.schema_version() == 1
    s.close()
    nxt = dict(real)
    nxt[current + 1] = "ALTER TABLE users ADD COLUMN locale TEXT;\nCREATE INDEX users_name ON users(name);"
    monkeypatch.setattr(mod, "MIGRATIONS", nxt)
    monkeypatch.setattr(mod, "SCHEMA_VERSION", current + 1)
    s = backend.open()
    assert s.schema_version() == current + 1 and s.get_user(u.user_id).name == "Ada"
    assert "locale" in backend.columns(s, "users")
    with pytest.raises(backend.db_error, match="only forget"):  # the guarded op-log trigger is in place
        s._conn().execute("UPDATE op_log SET reason = 'x'")
    s.close()
    monkeypatch.setattr(mod, "SCHEMA_VERSION", current)
    with pytest.raises(StoreError, match="newer than this code"):
        backend.open()


def test_concurrent_writers_threads_one_user(backend):
    s = backend.open(busy_timeout_s=60)
    u = s.create_user("Ada")
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        try:
            for i in range(15):
                s.add_item(u.user_id, "fact", f"fact {w}-{i}")
                s.update_persona(u.user_id, [PersonaUpdate(w, 1.0, 0.1, f"w{w}")])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(f.text for f in s.facts(u.user_id)) == sorted(f"fact {w}-{i}" for w in range(8) for i in range(15))
    assert s.get_user(u.user_id).version == 8 * 15 * 2  # every write serialised, none lost
    assert len(s.persona(u.user_id)) == 8
    assert s.persona(u.user_id)[0].confidence == pytest.approx(1 - 0.9 ** 15, abs=1e-5)


_PROC = """
import sys
if sys.argv[4] == "sqlite":
    from egomem.memory.sqlite import SQLiteMemoryStore as Store
else:
    from egomem.memory.postgres import PostgresMemoryStore as Store
s = Store(sys.argv[1], busy_timeout_s=60)
w, shared = int(sys.argv[2]), sys.argv[3]
own = s.create_user(f"user{w}")
for i in range(20):
    s.add_item(own.user_id, "fact", f"own {w}-{i}")
    s.add_item(shared, "fact", f"shared {w}-{i}")
print(own.user_id)
"""


def test_concurrent_writer_processes_same_and_different_users(backend):
    s = backend.open()
    shared = s.create_user("Shared").user_id
    procs = [subprocess.Popen([PY, "-c", _PROC, backend.target(), str(w), shared, backend.name],
                              stdout=subprocess.PIPE, text=True) for w in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, outs
    own_ids = [o.strip() for o, _ in outs]
    for w, uid in enumerate(own_ids):
        assert sorted(f.text for f in s.facts(uid)) == sorted(f"own {w}-{i}" for i in range(20))
    assert len(s.facts(shared)) == 80 and s.get_user(shared).version == 80
    assert len(s.list_users()) == 5


def test_profile_rendering_and_neighbour_memories(backend):
    s = backend.open()
    ada, bo = s.create_user("Ada"), s.create_user("Bo")
    s.add_item(ada.user_id, "fact", "lives in Paris")
    s.add_item(ada.user_id, "preference", "jazz", polarity="like")
    s.add_preference(ada.user_id, "rain", "dislike")
    s.update_persona(ada.user_id, [PersonaUpdate(74, 1.0, 0.8, "loves music")])
    s.add_summary(ada.user_id, "talked about a concert")
    s.add_relation(ada.user_id, bo.user_id, "brother")
    s.add_item(bo.user_id, "fact", "is a pilot")
    text = s.render_profile(ada.user_id)
    lines = text.splitlines()
    assert lines[0] == "name: Ada" and "people: Bo (brother)" in lines and "fact: lives in Paris" in lines
    assert "likes: jazz" in lines and "dislikes: rain" in lines and "persona: Likes music" in lines
    assert "earlier: talked about a concert" in lines
    assert {ln.split(": ", 1)[0] for ln in lines} == set(PROFILE_LINE_LABELS)  # what eval-dialog's read-out count reads
    short = s.render_profile(ada.user_id, max_chars=40)
    assert len(short) <= 40 and short.startswith("name: Ada")
    n = s.neighbour_memories(ada.user_id)
    assert [(x.name, x.relation, x.inverse, x.items) for x in n] == [("Bo", "brother", False, ["is a pilot"])]
    back = s.neighbour_memories(bo.user_id)
    assert back[0].name == "Ada" and back[0].inverse is True and "lives in Paris" in back[0].items


@pytest.mark.sqlite_only
def test_store_opens_a_new_database_while_another_process_writes_to_it(tmp_path):
    """SQLite only (WAL). A worker and an orchestrator opening the same new file together: switching it to WAL needs the file to
    itself and SQLite refuses that at once (no busy wait) while another connection holds its write lock; the
    store retries for its busy timeout instead of failing the open."""
    path = tmp_path / "new.sqlite3"
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)  # still a rollback journal
    other.execute("CREATE TABLE t (x)")
    other.execute("BEGIN IMMEDIATE")
    other.execute("INSERT INTO t VALUES (1)")
    release = threading.Timer(0.3, lambda: other.execute("COMMIT"))
    release.start()
    store = SQLiteMemoryStore(path)
    release.join()
    assert store.create_user("Ada").name == "Ada"
    other.close()
    fresh = sqlite3.connect(path)
    assert fresh.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    fresh.close()


def test_open_store_picks_the_configured_backend(backend):
    from egomem.config import load_config
    from egomem.memory import open_store
    from egomem.memory.postgres import PostgresMemoryStore

    s = open_store(backend.configure(load_config(env={})).memory)
    assert isinstance(s, backend.store_class) and s.create_user("Ada").name == "Ada"
    s.close()
    with pytest.raises(StoreError, match="needs memory.dsn"):  # the factory's own check, past config validation
        PostgresMemoryStore("")



def test_op_log_ids_are_never_reused_after_forget_deletes_the_newest_rows(backend) -> None:
    """A reader following the log after the last id it saw (the SQLite change feed) must find every
    later row: forget deletes the person's rows, and their ids must not come back (SQLite schema v5)."""
    s = backend.open()
    ann, eve = s.create_user("Ann"), s.create_user("Eve")
    s.add_fact(eve.user_id, "likes chess")  # the newest rows are Eve's
    seen = s.last_op_id()
    s.forget_user(eve.user_id)
    s.add_fact(ann.user_id, "likes tennis")
    after = s.op_log(after_op_id=seen)
    assert [r.op for r in after][:1] == ["forget"] and any(r.user_id == ann.user_id for r in after)
    assert all(r.op_id > seen for r in after)
