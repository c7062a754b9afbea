"""The LLM agents against a local server speaking the OpenAI protocol: valid answers, malformed
JSON, schema violations, 429 / 500 / timeouts with retries, dead letters, the transcription endpoint."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from llm_server import FakeOpenAIServer
from test_memory_manager import ColumnLabeler, chunk_a, chunk_b

from egomem.config import load_config
from egomem.memory.agents import EXTRACT_SCHEMA, LLMExtractor, LLMUpdateAgent
from egomem.memory.chunk import submit_chunk
from egomem.memory.llm import LLMClient, LLMFailed
from egomem.memory.persona import PERSONA_KEYS
from egomem.memory.sqlite import SQLiteMemoryStore
from egomem.memory.transcribe import Transcriber
from egomem.memory.worker import build_manager, process_next_job

EXTRACTED = {"summary": "Zelda talked about moving.", "name": "Zelda",
             "facts": [{"key": "lives_in", "text": "lives in Oslo"}],
             "preferences": [{"item": "sailing", "polarity": "like"}],
             "persona": [{"dimension": "likes_travel", "value": 0.9, "confidence": 0.7, "evidence": "loves trips"}],
             "relations": [{"person": "Marta", "relation": "sister"}]}


@pytest.fixture()
def server():
    srv = FakeOpenAIServer().start()
    yield srv
    srv.stop()


def llm_cfg(server: FakeOpenAIServer, tmp: Path, **llm):
    cfg = load_config(env={})
    cfg.llm.base_url, cfg.llm.model = server.base_url, "fake-model"
    cfg.llm.api_key_env = "EGOMEM_TEST_LLM_KEY"
    cfg.llm.timeout_s, cfg.llm.max_attempts, cfg.llm.backoff_base_s = 1.0, 4, 0.01
    cfg.memory.database, cfg.memory.chunk_dir = tmp / "m.db", tmp / "chunks"
    cfg.memory.extractor, cfg.memory.job_retry_base_s = "llm", 0.0
    for k, v in llm.items():
        setattr(cfg.llm, k, v)
    return cfg


def respond(req: dict) -> dict:
    """A stand-in model: extraction from the scripted answer; updates supersede a same-key fact."""
    system, user = req["messages"][0]["content"], req["messages"][1]["content"]
    if system.startswith("You maintain"):
        city = re.search(r"live in (\w+)", user)
        out = json.loads(json.dumps(EXTRACTED))
        out["facts"][0]["text"] = f"lives in {city.group(1) if city else 'Oslo'}"
        return out
    stored = json.loads(user.split("Stored profile:\n", 1)[1].split("\n\nCandidates", 1)[0])
    cands = json.loads(user.split("Candidates from the new conversation:\n", 1)[1])
    decisions = []
    for f in cands["facts"]:
        old = [s for s in stored["facts"] if s["key"] == f["key"]]
        if old and old[0]["text"] == f["text"]:
            continue
        decisions.append({"action": "supersede" if old else "add", "kind": "fact", "text": f["text"], "key": f["key"],
                          "target_id": old[0]["id"] if old else None, "reason": "moved" if old else "new"})
    return {"decisions": decisions, "name": {"action": "keep", "value": None, "reason": "known"}}


def test_answer_validated_cached_and_sent_as_json_mode(server, tmp_path, monkeypatch):
    monkeypatch.setenv("EGOMEM_TEST_LLM_KEY", "k")
    store = SQLiteMemoryStore(tmp_path / "m.db")
    client = LLMClient(llm_cfg(server, tmp_path).llm, store)
    server.push(("ok", EXTRACTED))
    ex, info = LLMExtractor(client).extract("USER (client transcript): hi", None, "sess1")
    assert ex.facts == [("lives_in", "lives in Oslo")] and ex.relations == [("Marta", "sister")]
    assert ex.persona[0].dim == PERSONA_KEYS["likes_travel"] and info.origin == "llm:fake-model" and info.prompt_hash
    req = server.requests[0]
    assert req["model"] == "fake-model" and req["response_format"] == {"type": "json_object"}
    assert req["temperature"] == 0.0
    # a re-run (e.g. after a crash) replays the stored answer instead of asking again
    ex2, _ = LLMExtractor(client).extract("USER (client transcript): hi", None, "sess1")
    assert ex2 == ex and len(server.requests) == 1


def test_malformed_and_schema_violations_are_retried(server, tmp_path, monkeypatch):
    monkeypatch.setenv("EGOMEM_TEST_LLM_KEY", "k")
    bad_schema = dict(EXTRACTED, facts=[{"key": "x"}])  # a fact without text
    server.push(("malformed", "{not json"), ("ok", bad_schema), ("malformed", "```json\n" + json.dumps(EXTRACTED) + "\n```"))
    client = LLMClient(llm_cfg(server, tmp_path).llm, None)
    a = client.complete_json("extract", [{"role": "user", "content": "x"}], EXTRACT_SCHEMA)
    assert a.attempts == 3 and a.data == EXTRACTED  # the fenced answer on the 3rd try is accepted


def test_429_500_and_timeout_back_off_then_succeed(server, tmp_path, monkeypatch):
    monkeypatch.setenv("EGOMEM_TEST_LLM_KEY", "k")
    server.push(("status", 429), ("status", 500), ("timeout", 2.0), ("ok", EXTRACTED))
    slept: list[float] = []
    client = LLMClient(llm_cfg(server, tmp_path).llm, None, sleep=slept.append)
    a = client.complete_json("extract", [{"role": "user", "content": "x"}], EXTRACT_SCHEMA)
    assert a.attempts == 4 and len(server.requests) == 4
    assert len(slept) == 3 and slept[0] < slept[1] < slept[2]  # exponential backoff


def test_exhausted_retries_go_to_dead_letters_and_are_replayable(server, tmp_path, monkeypatch):
    monkeypatch.setenv("EGOMEM_TEST_LLM_KEY", "k")
    cfg = llm_cfg(server, tmp_path, max_attempts=2)
    cfg.memory.job_max_attempts = 1
    store = SQLiteMemoryStore(cfg.memory.database, job_max_attempts=1)
    server.push(("status", 500), ("status", 503))
    job = submit_chunk(store, cfg.memory.chunk_dir, chunk_a())
    mgr = build_manager(cfg, store, labeler=ColumnLabeler())
    dead = process_next_job(mgr, cfg, "w")
    assert dead.status == "dead" and "LLMFailed" in dead.error
    letters = {d.source: d for d in store.dead_letters()}
    assert set(letters) == {"llm", "job"}
    llm = letters["llm"]
    assert llm.stage == "extract" and llm.attempts == 2 and "HTTP 503" in llm.error
    assert llm.payload["model"] == "fake-model" and "Zelda" in llm.payload["messages"][1]["content"]
    assert store.list_sessions() == [] and store.list_users() == []  # nothing half-written
    assert Path(job.payload["chunk_dir"]).is_dir()  # the chunk is kept for the replay
    # the endpoint recovers; an operator requeues the dead job and it completes
    server.responder = respond
    store.requeue_dead_letter(letters["job"].dl_id)
    done = process_next_job(mgr, cfg, "w")
    assert done.status == "done"
    assert store.dead_letters() == []  # the LLM letter of that session is resolved too
    assert [r.resolution for r in store.dead_letters(unresolved_only=False)] == ["succeeded on a later try", "requeued"]


def test_client_errors_are_not_retried(server, tmp_path, monkeypatch):
    monkeypatch.setenv("EGOMEM_TEST_LLM_KEY", "k")
    server.push(("status", 401))
    store = SQLiteMemoryStore(tmp_path / "m.db")
    client = LLMClient(llm_cfg(server, tmp_path).llm, store, sleep=lambda s: None)
    with pytest.raises(LLMFailed, match="HTTP 401") as e:
        client.complete_json("update", [{"role": "user", "content": "x"}], EXTRACT_SCHEMA, session_id="s")
    assert e.value.attempts == 1 and len(server.requests) == 1
    assert store.dead_letters()[0].dl_id == e.value.dl_id


def test_llm_pipeline_records_model_and_prompt_hash(server, tmp_path, monkeypatch):
    monkeypatch.setenv("EGOMEM_TEST_LLM_KEY", "k")
    cfg = llm_cfg(server, tmp_path)
    server.responder = respond
    store = SQLiteMemoryStore(cfg.memory.database)
    mgr = build_manager(cfg, store, labeler=ColumnLabeler())
    assert isinstance(mgr.extractor, LLMExtractor) and isinstance(mgr.updater, LLMUpdateAgent)
    zelda = mgr.process_chunk(chunk_a())[0].user_id
    mgr.process_chunk(chunk_b())  # "I live in Rome now." -> the update agent supersedes Paris
    assert [f.text for f in store.facts(zelda)] == ["lives in Rome"]
    hist = store.facts(zelda, history=True)
    assert [f.text for f in hist if f.invalid_at is not None] == ["lives in Paris"]
    sup = [e for e in store.op_log(zelda) if e.op == "supersede"][0]
    assert sup.reason == "moved" and sup.llm_model == "fake-model"
    assert re.fullmatch(r"extract=[0-9a-f]{64};update=[0-9a-f]{64}", sup.prompt_hash)
    assert all(i.origin == "llm:fake-model" for i in hist)
    assert store.persona(zelda)[PERSONA_KEYS["likes_travel"]].confidence > 0.7  # two sessions of travel evidence


def test_transcription_endpoint_when_configured_else_marked_fallback(server, tmp_path, monkeypatch):
    monkeypatch.setenv("EGOMEM_TEST_LLM_KEY", "k")
    cfg = llm_cfg(server, tmp_path)
    cfg.asr.backend, cfg.asr.base_url = "openai", server.base_url
    audio = (0.1 * np.sin(np.arange(24000) / 10)).astype(np.float32)
    asr = Transcriber(cfg.asr, cfg.llm)
    t = asr.transcribe(audio, 24000, [], [(5, "hello")])
    assert t.source == "asr:whisper-1"
    assert t.text.splitlines() == ["USER (asr:whisper-1): my name is Zelda and I live in Oslo.",
                                   "ASSISTANT (inner monologue): hello"]
    assert server.transcriptions == [{"model": "whisper-1", "bytes": 44 + 2 * 16000}]  # 16 kHz 16-bit WAV
    plain = asr.transcribe(audio, 24000, [(9, "b."), (3, "a.")], [(5, "hi")])  # client lines win: no upload
    assert plain.source == "client+monologue" and len(server.transcriptions) == 1
    assert plain.text.splitlines() == ["USER (client transcript): a. b.", "ASSISTANT (inner monologue): hi"]


def test_a_known_users_dead_letters_are_forgotten_with_them(server, tmp_path, monkeypatch):
    monkeypatch.setenv("EGOMEM_TEST_LLM_KEY", "k")
    store = SQLiteMemoryStore(tmp_path / "m.db")
    u = store.create_user("Yolanda Vexley")
    client = LLMClient(llm_cfg(server, tmp_path, max_attempts=1).llm, store)
    server.push(("status", 500))
    from egomem.memory.agents import Extraction

    with pytest.raises(LLMFailed):
        LLMUpdateAgent(client).decide(store.profile(u.user_id), Extraction(facts=[(None, "has a boat")]), "sx")
    assert [d.user_id for d in store.dead_letters()] == [u.user_id]
    assert store.forget_user(u.user_id).leftovers == []
    assert store.dead_letters(unresolved_only=False) == []
