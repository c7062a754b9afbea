"""The demo scenario end to end: real tritonserver (codec, dialog, face, speaker, text encoders), the
real orchestrator on loopback, the memory worker over SQLite on disk with the shipped episodic trigger,
real WebSocket clients, the dialog model decoded as shipped. Asserts who was recognised when, what entered each
MemChunk, that the model greets a recognised person by name on its own text channel, and what the store holds
after day 1 and after forget. The Level-2 query is injected (`inject_query=True`): the shipped model writes none
(README model card)."""

from __future__ import annotations

import threading

import pytest

from egomem.demo import PEOPLE, run_scenario
from egomem.memory import open_store
from egomem.memory.worker import run_worker
from tests.conftest import DATA, test_config, triton_server
from tests.orchestrator_harness import ADMIN_TOKEN, STREAM_TOKEN, OrchestratorThread, orchestrator_config, run


@pytest.fixture(scope="module")
def shipped_triton(tmp_path_factory):
    """A tritonserver of its own with the dialog model decoded as shipped (turn starts drawn at the checkpoint's
    own start temperature, `dialog.start_temperature = "auto"`), as `egomem demo` serves it; the session's
    `triton` decodes greedily so other tests can replay a stream tick for tick, and greedily the model stays
    silent."""
    with triton_server(test_config(tmp_path_factory.mktemp("triton_shipped"), mimi={"max_streams": 8})) as server:
        yield server


@pytest.fixture(scope="module")
def scenario(shipped_triton, tmp_path_factory):
    for m in ("mimi_codec", "dialog_lm", "face_encoder", "speaker_encoder", "text_encoder"):
        shipped_triton.load(m)
    d = tmp_path_factory.mktemp("orch_e2e")
    cfg = orchestrator_config(test_config(d), d, shipped_triton.grpc_url, accept_model_text=True)
    cfg.memory.extractor = "rules"  # no LLM key in tests: the offline rule extractor (it says so in the log)
    stop = threading.Event()
    worker = threading.Thread(target=run_worker, args=(cfg, stop), daemon=True)  # the shipped trigger cuts sessions
    worker.start()
    try:
        with OrchestratorThread(cfg) as orch:
            result = run(run_scenario(orch.url, STREAM_TOKEN, ADMIN_TOKEN, DATA / "identity", seconds=6.0,
                                      poll_s=cfg.orchestrator.poll_interval_s, job_timeout_s=240, inject_query=True))
            metrics = orch.services.metrics
            yield cfg, result, metrics
    finally:
        stop.set()
        worker.join(60)


def test_day1_enrols_both_people_with_what_they_said(scenario):
    _, r, _ = scenario
    assert r["day1_users"] == sorted(p.name for p in PEOPLE)
    sonja, filippo = r["day1_profiles"]["Sonja"], r["day1_profiles"]["Filippo"]
    assert sonja.startswith("name: Sonja") and "lives in Paris" in sonja and "tennis" in sonja
    assert "Sonja (colleague)" in filippo and "works as engineer" in filippo


def test_day2_each_is_recognised_at_the_first_poll_and_their_profile_fills_l1(scenario):
    _, r, _ = scenario
    for p in PEOPLE:
        day2 = r["day2"][p.name]
        assert [(name, poll) for name, _, poll in day2["recognised"]] == [(p.name, 1)]
        assert day2["recognised"][0][1] == r["user_ids"][p.name]
        assert len(day2["l1"]) == 1 and day2["l1"][0].startswith(f"name: {p.name}")


def test_day2_the_served_model_greets_a_recognised_person_by_name(scenario):
    """#15: the model's own text channel holds the person's name within a few seconds of recognition. Turn
    starts are drawn (T = 1) and ticks follow the wall clock, so a visit may miss: the shipped file greeted
    17 of 18 day-2 visits by name in `bench/bench_demo.py` runs (sessions 50-51), Sonja 1.0-1.8 s and Filippo
    (who is still talking) 1.3-7.6 s after recognition. Both visits missing is what fails here; a model that
    does not read its Level-1 MemChunk never names them."""
    _, r, _ = scenario
    after = {p.name: r["day2"][p.name]["name_after_s"] for p in PEOPLE}
    assert any(s is not None and s <= 8.0 for s in after.values()), (after, {
        p.name: r["day2"][p.name]["model_said"] for p in PEOPLE})


def test_a_relation_query_lands_the_colleagues_facts_in_l2(scenario):
    _, r, _ = scenario
    sonja = r["day2"]["Sonja"]
    assert sonja["retrieval"] and "Filippo (colleague): works as engineer" in sonja["retrieval"][0]
    assert sonja["l2"] == ["\n".join(sonja["retrieval"][0])]
    assert r["day2"]["Filippo"]["l2"] == []  # no query on his stream, no L2 refresh


def test_forget_leaves_nothing_of_the_user(scenario):
    cfg, r, _ = scenario
    sonja = r["user_ids"]["Sonja"]
    assert r["after_forget_users"] == ["Filippo"]
    assert r["forget"]["verified_leftovers"] == []
    store = open_store(cfg.memory)
    try:
        assert store.resolve_user(sonja) is None and store.list_keys(user_id=sonja) == []
        filippo = r["user_ids"]["Filippo"]
        assert store.relations(filippo) == [] and store.list_keys(user_id=filippo)  # his keys stay
    finally:
        store.close()


def test_metrics_saw_the_streams(scenario):
    _, _, m = scenario
    assert m.get("egomem_streams_total") == 4 and m.get("egomem_open_streams") == 0
    assert m.get("egomem_identification_seconds") >= 2 and m.get("egomem_refresh_seconds") >= 3
    assert m.get("egomem_memory_jobs_total") >= 4
