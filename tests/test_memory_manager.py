"""The memory manager end to end on real SQLite files, with the offline rule-based agents:
sessions -> users -> memories, updates with history, idempotency, a writer killed mid-job,
concurrent sessions of one user, and the worker loop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from egomem.config import load_config
from egomem.memory.chunk import StreamChunk, submit_chunk
from egomem.memory.segment import spans_to_labels
from egomem.memory.sqlite import SQLiteMemoryStore
from egomem.memory.types import UNKNOWN_USER
from egomem.memory.worker import build_manager, process_next_job, run_worker
from tests.memory_helpers import FACE_B, FACE_Z, VOICE_Z, ColumnLabeler, make_chunk, near, unit

PY = sys.executable
def chunk_a() -> StreamChunk:
    return make_chunk("s1", 0, [
        {"span": (10, 60), "face": FACE_Z, "voice": VOICE_Z,
         "user": [(12, "Hi, my name is Zelda."), (25, "I live in Paris."),
                  (35, "I really like jazz. My sister is called Marta.")]},
        {"span": (90, 140), "face": FACE_B, "user": [(95, "I'm 40 years old. I like football.")]},
    ])


def chunk_b() -> StreamChunk:
    return make_chunk("s1", 1, [
        {"span": (10, 60), "face": FACE_Z, "user": [(15, "I live in Rome now."), (30, "I don't like jazz.")]},
    ])


def cfg_for(tmp: Path, **memory):
    cfg = load_config(env={})
    cfg.memory.database = tmp / "memory.sqlite3"
    cfg.memory.chunk_dir = tmp / "chunks"
    cfg.memory.extractor = "rules"
    cfg.memory.job_retry_base_s = 0.0
    cfg.memory.worker_poll_s = 0.05
    for k, v in memory.items():
        setattr(cfg.memory, k, v)
    return cfg


def snapshot(db: Path) -> dict[str, list]:
    """Every table's content minus wall-clock columns and the job bookkeeping."""
    s = SQLiteMemoryStore(db)
    c = s._conn()
    out = {}
    for t in ["users", "biometric_keys", "memory_items", "summaries", "persona", "relations", "sessions",
              "llm_calls", "dead_letters", "op_log"]:
        cols = [r[1] for r in c.execute(f"PRAGMA table_info({t})") if r[1] not in ("created_at", "updated_at", "ts")]
        out[t] = sorted(map(repr, c.execute(f"SELECT {', '.join(cols)} FROM {t}").fetchall()))
    s.close()
    return out


def test_pipeline_new_users_then_update_with_history(tmp_path):
    cfg = cfg_for(tmp_path)
    store = SQLiteMemoryStore(cfg.memory.database)
    mgr = build_manager(cfg, store, labeler=ColumnLabeler())
    out_a = mgr.process_chunk(chunk_a())
    assert [(o.start_step, o.end_step, o.status, o.new_user) for o in out_a] == [
        (10, 60, "committed", True), (90, 140, "committed", True)]
    zelda, bob = out_a[0].user_id, out_a[1].user_id
    assert store.get_user(zelda).name == "Zelda" and store.get_user(bob).name == UNKNOWN_USER
    assert {k.modality for k in store.list_keys(user_id=zelda)} == {"face", "voice"}
    assert [f.text for f in store.facts(bob)] == ["is 40 years old"]

    out_b = mgr.process_chunk(chunk_b())
    assert out_b[0].user_id == zelda and not out_b[0].new_user  # recognised by face
    assert [f.text for f in store.facts(zelda)] == ["lives in Rome"]
    old = [f for f in store.facts(zelda, history=True) if f.text == "lives in Paris"][0]
    assert old.invalid_at == pytest.approx(chunk_b().start_time + 10 * 0.08) and old.superseded_by
    assert [(p.text, p.polarity) for p in store.preferences(zelda)] == [("jazz", "dislike")]
    assert len(store.list_keys(user_id=zelda)) == 2  # she already had a face key: none added
    # everything written says it came from the offline fallback
    items = store.items(zelda, history=True)
    assert items and all(i.origin == "rule_fallback" for i in items)
    ops = store.op_log(zelda)
    assert ops and all("offline fallback" in e.actor and e.llm_model == "rule-based-fallback" for e in ops
                       if e.op != "create_user" or e.session_id)
    assert store.summaries(zelda)[0].text.startswith("[offline fallback summary]")
    sess = store.get_session(out_a[0].session_id)
    assert sess.transcript_source == "client+monologue"
    assert sess.transcript.startswith("USER (client transcript): Hi, my name is Zelda.")
    assert "ASSISTANT (inner monologue): Nice to talk to you." in sess.transcript
    # social graph + Level-1 / Level-2 views
    marta = [n for n in store.neighbour_memories(zelda)]
    assert [(n.name, n.relation) for n in marta] == [("Marta", "sister")]
    text = store.render_profile(zelda)
    assert "fact: lives in Rome" in text and "Paris" not in text and "people: Marta (sister)" in text


def test_same_chunk_twice_changes_nothing(tmp_path):
    cfg = cfg_for(tmp_path)
    store = SQLiteMemoryStore(cfg.memory.database)
    mgr = build_manager(cfg, store, labeler=ColumnLabeler())
    mgr.process_chunk(chunk_a())
    before = snapshot(cfg.memory.database)
    again = mgr.process_chunk(chunk_a())
    assert [o.status for o in again] == ["already_done", "already_done"]
    assert snapshot(cfg.memory.database) == before
    j1 = submit_chunk(store, cfg.memory.chunk_dir, chunk_b())
    assert submit_chunk(store, cfg.memory.chunk_dir, chunk_b()).job_id == j1.job_id
    assert len(store.list_jobs()) == 1


_CRASHY = """
import sys, time
from pathlib import Path
from egomem.config import load_config
from egomem.memory.sqlite import SQLiteMemoryStore
from egomem.memory.worker import build_manager, process_next_job

class ColumnLabeler:
    def label(self, tokens):
        return tokens[:, 0] % 4

db, chunks, marker = sys.argv[1], sys.argv[2], sys.argv[3]
cfg = load_config(env={})
cfg.memory.database, cfg.memory.chunk_dir, cfg.memory.extractor = Path(db), Path(chunks), "rules"
cfg.memory.job_lease_s = 1.0
orig = SQLiteMemoryStore.commit_session
calls = []
def commit(self, m):
    calls.append(m.session_id)
    return orig(self, m)
def before_commit(self, c):
    if len(calls) == 2:  # inside the 2nd session's transaction, its rows written, not committed
        Path(marker).write_text("paused")
        time.sleep(600)
SQLiteMemoryStore.commit_session = commit
SQLiteMemoryStore._before_commit = before_commit
store = SQLiteMemoryStore(db)
process_next_job(build_manager(cfg, store, labeler=ColumnLabeler()), cfg, "crashy")
"""


def test_writer_killed_mid_job_loses_nothing_and_rerun_matches(tmp_path):
    # reference: the same chunks processed without a crash
    ref = cfg_for(tmp_path / "ref")
    ref_store = SQLiteMemoryStore(ref.memory.database)
    ref_mgr = build_manager(ref, ref_store, labeler=ColumnLabeler())
    ref_mgr.process_chunk(chunk_a())
    ref_store.close()

    cfg = cfg_for(tmp_path / "crash", job_lease_s=1.0)
    store = SQLiteMemoryStore(cfg.memory.database)
    job = submit_chunk(store, cfg.memory.chunk_dir, chunk_a())
    marker = tmp_path / "paused"
    proc = subprocess.Popen([PY, "-c", _CRASHY, str(cfg.memory.database), str(cfg.memory.chunk_dir), str(marker)])
    try:
        deadline = time.time() + 120
        while not marker.exists():
            assert proc.poll() is None, "the writer exited before reaching the crash point"
            assert time.time() < deadline, "the writer never reached the crash point"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)  # mid-transaction, mid-job
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    # the first session was committed and survives; nothing of the second one is visible
    sessions = store.list_sessions()
    assert [(s.start_step, s.end_step) for s in sessions] == [(10, 60)]
    assert sorted(u.name for u in store.list_users()) == ["Marta", "Zelda"]
    assert store.get_job(job.job_id).status == "running"
    # the lease runs out; another worker re-runs the job to the same result
    time.sleep(1.2)
    mgr = build_manager(cfg, store, labeler=ColumnLabeler())
    done = process_next_job(mgr, cfg, "rescuer")
    assert done.job_id == job.job_id and done.status == "done" and done.attempts == 2
    assert [s["status"] for s in done.result["sessions"]] == ["already_done", "committed"]
    store.close()
    assert snapshot(cfg.memory.database) == snapshot(ref.memory.database)


def test_concurrent_sessions_of_one_user_serialise_and_keep_history(tmp_path):
    cfg = cfg_for(tmp_path)
    store = SQLiteMemoryStore(cfg.memory.database)
    mgr = build_manager(cfg, store, labeler=ColumnLabeler())
    zelda = mgr.process_chunk(chunk_a())[0].user_id

    decided = threading.Barrier(2)
    slow = build_manager(cfg, store, labeler=ColumnLabeler())
    inner = slow.updater

    class BothReadFirst:
        """Both sessions read the same profile version before either commits: a real race."""

        calls = 0

        def decide(self, profile, ex, sid, job_id=None):
            BothReadFirst.calls += 1
            if BothReadFirst.calls <= 2:
                decided.wait(10)
            return inner.decide(profile, ex, sid, job_id)

    slow.updater = BothReadFirst()
    chunks = [make_chunk(f"cam{i}", 0, [{"span": (10, 60), "face": FACE_Z, "user": [(20, f"I live in {city}.")]}])
              for i, city in enumerate(["Lima", "Kyoto"])]
    errors = []

    def run(ch):
        try:
            slow.process_chunk(ch)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(ch,)) for ch in chunks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and BothReadFirst.calls == 3  # the loser re-read the profile and decided again
    current = [f.text for f in store.facts(zelda) if f.key == "lives_in"]
    assert len(current) == 1 and current[0] in ("lives in Lima", "lives in Kyoto")
    chain = sorted((f for f in store.facts(zelda, history=True) if f.key == "lives_in"), key=lambda f: f.valid_from)
    assert len(chain) == 3 and sum(f.invalid_at is None for f in chain) == 1
    assert len(store.list_sessions(user_id=zelda)) == 3


def test_worker_loop_processes_queue_and_cleans_up(tmp_path):
    cfg = cfg_for(tmp_path)
    store = SQLiteMemoryStore(cfg.memory.database)
    job = submit_chunk(store, cfg.memory.chunk_dir, chunk_a())
    folder = Path(job.payload["chunk_dir"])
    assert folder.is_dir()
    stop = threading.Event()
    th = threading.Thread(target=run_worker, args=(cfg, stop), kwargs={"labeler": ColumnLabeler()})
    th.start()
    try:
        deadline = time.time() + 60
        while store.get_job(job.job_id).status != "done":
            assert time.time() < deadline, store.get_job(job.job_id)
            time.sleep(0.05)
    finally:
        stop.set()
        th.join(30)
    assert not th.is_alive()
    assert not folder.exists()  # the raw chunk is gone once processed
    assert len(store.list_sessions()) == 2


def test_forget_after_the_pipeline(tmp_path):
    cfg = cfg_for(tmp_path)
    store = SQLiteMemoryStore(cfg.memory.database)
    mgr = build_manager(cfg, store, labeler=ColumnLabeler())
    zelda = mgr.process_chunk(chunk_a())[0].user_id
    mgr.process_chunk(chunk_b())
    vecs = [k.vector for k in store.list_keys(user_id=zelda)]
    receipt = store.forget_user(zelda, reason="asked to be forgotten")
    assert receipt.leftovers == []
    assert store.verify_forgotten(zelda, vecs, "Zelda") == []
    assert store.verify_forgotten(zelda, [], "Paris") == []  # her transcripts and facts are gone
    assert mgr.identifier.identify(np.stack([FACE_Z]), None).user_id is None
    assert len(store.list_sessions()) == 1  # Bob's session stays


def test_the_worker_identifies_with_the_live_streams_identifier_and_its_model_ids(tmp_path):
    """One identifier: the worker's is `egomem.identity`'s (s-norm, conflict rule), with the model ids
    and thresholds of [identity]; switching a backend switches the ids keys are written and searched under."""
    from egomem.identity import StoreBackedIdentifier
    from egomem.identity.identify import FACE_MODEL_IDS, VOICE_MODEL_IDS

    cfg = cfg_for(tmp_path)
    store = SQLiteMemoryStore(cfg.memory.database)
    mgr = build_manager(cfg, store, labeler=ColumnLabeler())
    assert isinstance(mgr.identifier, StoreBackedIdentifier)
    assert mgr.identifier.identifier.snorm is not None  # voices are s-normed, as on live streams
    zelda = mgr.process_chunk(chunk_a())[0].user_id
    assert {(k.modality, k.model_id) for k in store.list_keys(user_id=zelda)} == {
        ("face", FACE_MODEL_IDS["dlib"]), ("voice", VOICE_MODEL_IDS["resemblyzer"])}
    out = mgr.process_chunk(chunk_b())
    assert out[0].user_id == zelda and not out[0].new_user
    assert [f.text for f in store.facts(zelda)] == ["lives in Rome"]

    cfg.identity.face_backend = "deepface"  # the paper's face model: its keys are other vectors
    other = build_manager(cfg, SQLiteMemoryStore(tmp_path / "other.sqlite3"), labeler=ColumnLabeler())
    z2 = other.process_chunk(chunk_a())[0].user_id
    assert {k.model_id for k in other.store.list_keys(user_id=z2, modality="face")} == {FACE_MODEL_IDS["deepface"]}


def test_a_mentioned_person_who_later_talks_to_us_joins_the_graph(tmp_path):
    cfg = cfg_for(tmp_path)
    store = SQLiteMemoryStore(cfg.memory.database)
    mgr = build_manager(cfg, store, labeler=ColumnLabeler())
    zelda = mgr.process_chunk(chunk_a())[0].user_id  # "My sister is called Marta." -> a keyless Marta
    placeholder = [u for u in store.list_users() if u.name == "Marta"][0]
    out = mgr.process_chunk(make_chunk("s2", 0, [
        {"span": (10, 60), "face": unit(7), "user": [(12, "Hello, my name is Marta. I like tennis.")]}]))
    marta = out[0].user_id
    assert [u.user_id for u in store.list_users() if u.name == "Marta"] == [marta]
    assert store.resolve_user(placeholder.user_id).user_id == marta
    n = store.neighbour_memories(zelda)
    assert [(x.user_id, x.name, x.relation) for x in n] == [(marta, "Marta", "sister")]
    assert "likes tennis" in n[0].items
    assert any(e.op == "merge_users" for e in store.op_log(marta))


def test_segment_helpers_plain_decoder_and_windowed_labelling():
    from egomem.memory.segment import decode_sessions_plain, label_stream

    assert decode_sessions_plain(spans_to_labels([(2, 5), (7, 7), (9, 12)], 15)) == [(2, 5), (7, 7), (9, 12)]
    # broken sequences: a missed start, a start inside a session, a 0 inside, a session cut by the end
    assert decode_sessions_plain(np.array([2, 2, 0, 1, 2, 1, 2, 3, 0, 1, 2])) == [(0, 1), (3, 4), (5, 7), (9, 10)]
    seen = []

    class Recording:
        def label(self, tokens):
            seen.append(tokens.shape[0])
            return tokens[:, 0] % 4

    tokens = np.zeros((25, 17), np.int64)
    tokens[:, 0] = spans_to_labels([(3, 20)], 25)
    labels = label_stream(Recording(), tokens, window=10)
    assert seen == [10, 10, 5] and labels.tolist() == tokens[:, 0].tolist()
    with pytest.raises(ValueError, match=r"\[T, 17\]"):
        label_stream(Recording(), np.zeros((5, 16), np.int64))


# -- identity split: a session never mixes two people (real GE2E voices from tests/data/identity) ------

VOICE_DIR = Path(__file__).parent / "data" / "identity"
BG = 7  # the background code of both audio channels (digital silence)


@pytest.fixture(scope="module")
def real_voices() -> dict[str, list[np.ndarray]]:
    """GE2E embeddings of 2 s windows (0.5 s hop) of two LibriSpeech readers, two utterances each."""
    import soundfile as sf

    from egomem.config import IdentityConfig
    from egomem.identity.voice import ResemblyzerEncoder, VoiceActivity

    icfg = IdentityConfig()
    enc = ResemblyzerEncoder(icfg.voice_threshold_resemblyzer, VoiceActivity(icfg.vad_threshold))
    out: dict[str, list[np.ndarray]] = {}
    readers = {"A": ["2033-164914-0004", "2033-164914-0005"], "B": ["2414-128291-0003", "2414-128291-0009"]}
    for who, files in readers.items():
        for f in files:
            pcm, sr = sf.read(VOICE_DIR / f"{f}.flac", dtype="float32")
            for s in range(0, len(pcm) - 2 * sr + 1, sr // 2):
                e = enc.encode(pcm[s:s + 2 * sr], sr).embedding
                if e is not None:
                    out.setdefault(who, []).append(e)
    assert len(out["A"]) >= 6 and len(out["B"]) >= 3
    return out


def talk_chunk(stream: str, turns: list[tuple[str, str, int, int]], voices: dict, lines: list[tuple[int, str]],
               T: int = 360) -> StreamChunk:
    """turns: (who, side, first, last) with side 'user' (listen codes) or 'assistant' (speak codes and
    text words); `SpanLabeler(span)` plays the trigger. Voice polls as the orchestrator records them: every
    25 steps, the user speech of the last 38 steps (>= 13 steps of it), blended when two people were heard."""
    rng = np.random.default_rng(0)
    tokens = np.full((T, 17), BG, np.int64)
    tokens[:, 0] = 3  # text padding
    speaker = np.full(T, "", object)
    for who, side, a, b in turns:
        cols = slice(9, 17) if side == "user" else slice(1, 9)
        tokens[a:b + 1, cols] = rng.integers(100, 2048, size=(b - a + 1, 8))
        if side == "user":
            speaker[a:b + 1] = who
        else:
            tokens[a:b + 1:3, 0] = rng.integers(4, 4000, size=len(range(a, b + 1, 3)))  # a word every 3 steps
    chunk = StreamChunk(stream, 0, 5000.0, tokens, client_transcript=lines)
    used = {"A": 0, "B": 0}
    for t in range(24, T, 25):
        heard = speaker[max(0, t - 37):t + 1]
        people = {w: int(np.sum(heard == w)) for w in ("A", "B") if np.sum(heard == w)}
        if sum(people.values()) < 13:
            continue
        vecs = []
        for w in people:
            vecs.append(voices[w][used[w] % len(voices[w])])
            used[w] += 1
        m = np.mean(vecs, axis=0)
        chunk.voices.append((t, m / np.linalg.norm(m)))
    return chunk


class SpanLabeler:
    """Test double for the trigger: labels one fixed session, whatever the tokens."""

    def __init__(self, span: tuple[int, int]):
        self.span = span

    def label(self, tokens: np.ndarray) -> np.ndarray:
        return spans_to_labels([self.span], tokens.shape[0])


def switch_chunk(voices) -> StreamChunk:
    """A talks with the assistant, leaves; B starts 1 s later; the trigger sees one session."""
    turns = [("A", "user", 10, 59), ("A", "assistant", 64, 99), ("A", "user", 104, 149), ("A", "assistant", 154, 169),
             ("B", "user", 182, 229), ("B", "assistant", 234, 269), ("B", "user", 274, 330)]
    lines = [(12, "Hi, my name is Arthur."), (105, "I live in Oslo."),
             (185, "Hello, my name is Bruno."), (276, "I really like chess.")]
    return talk_chunk("switch", turns, voices, lines)


def test_identity_split_keeps_two_people_apart(tmp_path, real_voices):
    cfg = cfg_for(tmp_path)
    assert cfg.trigger.identity_split  # on by default
    store = SQLiteMemoryStore(cfg.memory.database)
    mgr = build_manager(cfg, store, labeler=SpanLabeler((10, 330)))
    chunk = switch_chunk(real_voices)
    assert mgr.sessions_of(chunk) == [(10, 169), (182, 330)]  # cut in the 1 s pause before B speaks
    out = mgr.process_chunk(chunk)
    assert [o.status for o in out] == ["committed", "committed"] and all(o.new_user for o in out)
    arthur, bruno = (store.get_user(o.user_id) for o in out)
    assert (arthur.name, bruno.name) == ("Arthur", "Bruno")
    assert [f.text for f in store.facts(arthur.user_id)] == ["lives in Oslo"]
    assert store.preferences(arthur.user_id) == []  # B's chess never reaches A's profile
    assert [(p.text, p.polarity) for p in store.preferences(bruno.user_id)] == [("chess", "like")]
    assert store.facts(bruno.user_id) == []
    # each new user's voice key is their own voice, not a blend: nearer their own windows
    key = {o.user_id: store.list_keys(user_id=o.user_id, modality="voice")[0].vector for o in out}
    mean = {w: np.mean(real_voices[w], axis=0) for w in "AB"}
    assert float(key[arthur.user_id] @ mean["A"]) > float(key[arthur.user_id] @ mean["B"])
    assert float(key[bruno.user_id] @ mean["B"]) > float(key[bruno.user_id] @ mean["A"])
    assert [o.status for o in mgr.process_chunk(chunk)] == ["already_done"] * 2  # idempotent

    # without the split the same chunk is ONE session and one profile gets both people's memories
    off = cfg_for(tmp_path / "off")
    off.trigger.identity_split = False
    store2 = SQLiteMemoryStore(off.memory.database)
    merged = build_manager(off, store2, labeler=SpanLabeler((10, 330))).process_chunk(chunk)
    assert len(merged) == 1
    assert [f.text for f in store2.facts(merged[0].user_id)] == ["lives in Oslo"]
    assert [p.text for p in store2.preferences(merged[0].user_id)] == ["chess"]


def test_identity_split_leaves_one_person_across_a_long_pause(tmp_path, real_voices):
    cfg = cfg_for(tmp_path)
    store = SQLiteMemoryStore(cfg.memory.database)
    mgr = build_manager(cfg, store, labeler=SpanLabeler((10, 330)))
    turns = [("A", "user", 10, 59), ("A", "assistant", 64, 99),  # 5 s of silence, then A again
             ("A", "user", 162, 209), ("A", "assistant", 214, 249), ("A", "user", 254, 330)]
    chunk = talk_chunk("pause", turns, real_voices, [(12, "Hi, my name is Arthur."), (256, "I live in Oslo.")])
    assert len(chunk.voices) >= 8
    assert mgr.sessions_of(chunk) == [(10, 330)]
    out = mgr.process_chunk(chunk)
    assert len(out) == 1 and store.get_user(out[0].user_id).name == "Arthur"


def test_no_client_line_is_dropped_outside_the_sessions(tmp_path):
    """A line before the trigger's session (a `--say` at step 0) and one after it both reach the
    session's user; a chunk where the trigger found no session at all gets a session for its lines."""
    from egomem.memory.manager import assign_lines

    assert assign_lines([(10, 60), (90, 140)], [(0, "a"), (30, "b"), (75, "c"), (76, "d"), (150, "e")]) == [
        [(0, "a"), (30, "b"), (75, "c")], [(76, "d"), (150, "e")]]  # inside, else nearest (earlier on a tie)
    assert assign_lines([], [(3, "x")]) == []

    cfg = cfg_for(tmp_path)
    store = SQLiteMemoryStore(cfg.memory.database)
    mgr = build_manager(cfg, store, labeler=ColumnLabeler())
    chunk = make_chunk("s1", 0, [{"span": (20, 80), "face": FACE_Z, "user": [(40, "I like jazz.")]}])
    chunk.client_transcript = [(0, "Hi, my name is Ada. I live in Lisbon.")] + chunk.client_transcript + [
        (150, "I love tennis.")]
    [out] = mgr.process_chunk(chunk)
    ada = store.resolve_user(out.user_id)
    assert ada.name == "Ada" and [f.text for f in store.facts(ada.user_id)] == ["lives in Lisbon"]
    assert sorted(p.text for p in store.preferences(ada.user_id)) == ["jazz", "tennis"]
    assert "my name is Ada" in store.get_session(out.session_id).transcript

    silent = make_chunk("s2", 0, [])  # the trigger sees no dialog, but the client said something
    silent.client_transcript = [(5, "My name is Bruno. I work as a chef.")]
    silent.faces = [(30, near(FACE_B, 1)), (60, near(FACE_B, 2))]
    [made] = mgr.process_chunk(silent)
    bruno = store.resolve_user(made.user_id)
    assert (made.start_step, made.end_step) == (5, 5) and bruno.name == "Bruno"
    assert [f.text for f in store.facts(bruno.user_id)] == ["works as chef"]
    assert {k.modality for k in store.list_keys(user_id=bruno.user_id)} == {"face"}  # the nearest poll's face
    assert mgr.process_chunk(silent)[0].status == "already_done"  # the made session is as idempotent as any
