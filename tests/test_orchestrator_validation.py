"""REST input validation, /metrics job counts and token redaction in the logs (issue #11), through
the real app on loopback (no Triton needed) and, for the log, the real `python -m egomem.orchestrator`
process writing its log file.

Each bad input below answered 500 (or was silently stored, or bypassed the row cap) before
orchestrator/validate.py: it must be a 400 whose JSON body names the field, and must change nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import aiohttp
import pytest
import yarl

from egomem.memory import open_store
from egomem.orchestrator.openapi import spec
from egomem.orchestrator.rest import OPLOG_CAP, routes
from egomem.stack import to_toml
from tests.conftest import test_config
from tests.orchestrator_harness import ADMIN_TOKEN, STREAM_TOKEN, OrchestratorThread, orchestrator_config, run


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("orch_validation")
    cfg = orchestrator_config(test_config(d), d, identify_models=False, retrieval=False)
    store = open_store(cfg.memory)
    ada, bob = store.create_user("Ada"), store.create_user("Bob")
    fact = store.add_fact(ada.user_id, "lives in Paris")
    for i in range(30):
        store.add_fact(bob.user_id, f"fact {i}")
    store.close()
    with OrchestratorThread(cfg) as orch:
        orch.ids = {"ada": ada.user_id, "bob": bob.user_id, "fact": fact}
        yield orch


def _send(server, calls: list[tuple[str, str, bytes | str | None]]) -> list[tuple[int, dict]]:
    async def go():
        out = []
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"}
        async with aiohttp.ClientSession() as http:
            for method, path, body in calls:
                async with http.request(method, server.url + path.format(**server.ids), data=body,
                                        headers=headers) as r:
                    text = await r.text()
                    out.append((r.status, json.loads(text) if r.content_type == "application/json" else text))
        return out

    return run(go())


DEEP = "[" * 100_000 + "]" * 100_000  # json.loads: RecursionError
BAD = [  # (method, path, raw body, the field the 400 must name)
    # the 9 kinds of 500 / silent damage found in issue #11
    ("POST", "/api/users/{ada}/facts", json.dumps({"text": "x", "key": 5}), "key"),
    ("POST", "/api/users/{ada}/facts", json.dumps({"text": "x", "key": {"a": 1}}), "key"),
    ("POST", "/api/users/{ada}/facts", json.dumps({"text": "x", "reason": ["why"]}), "reason"),
    ("PATCH", "/api/users/{ada}", json.dumps({"name": "A", "reason": 7}), "reason"),
    ("POST", "/api/users/{ada}/facts", DEEP, "body"),
    ("POST", "/api/users/{ada}/facts", '{"text": "\\ud800"}', "text"),  # a lone surrogate
    ("PATCH", "/api/users/{ada}", '{"name": "Ada \\udfff"}', "name"),
    ("GET", "/api/oplog?after=99999999999999999999999", None, "after"),  # past SQLite's int64
    ("GET", "/api/oplog?limit=-1", None, "limit"),  # SQLite: LIMIT -1 = no limit
    # and their relatives
    ("GET", "/api/oplog?after=-1", None, "after"),
    ("GET", f"/api/oplog?limit={OPLOG_CAP + 1}", None, "limit"),
    ("GET", "/api/oplog?limit=0", None, "limit"),
    ("GET", "/api/oplog?after=1e3", None, "after"),
    ("GET", "/api/oplog?after=1&after=2", None, "after"),
    ("GET", "/api/oplog?lmit=5", None, "lmit"),
    ("POST", "/api/users/{ada}/merge", json.dumps({"drop_user_id": "{bob}", "reason": 1}), "reason"),
    ("POST", "/api/users/{ada}/merge", json.dumps({"drop_user_id": ["x"]}), "drop_user_id"),
    ("POST", "/api/users/{ada}/relations", json.dumps({"other_user_id": 5, "relation": "friend"}), "other_user_id"),
    ("POST", "/api/users/{ada}/relations", json.dumps({"other_user_id": "{bob}", "relation": True}), "relation"),
    ("POST", "/api/users/{ada}/relations", '{"other_user_id": "{bob}", "relation": "\\ud83d"}', "relation"),
    ("POST", "/api/users/{ada}/facts", json.dumps({"text": "x" * 4001}), "text"),
    ("POST", "/api/users/{ada}/facts", json.dumps({"text": "   "}), "text"),
    ("POST", "/api/users/{ada}/facts", json.dumps({"text": "a\u0000b"}), "text"),
    ("POST", "/api/users/{ada}/facts", json.dumps({"text": "x", "sneaky": 1}), "sneaky"),
    ("POST", "/api/users/{ada}/facts", '{"text": NaN}', "body"),
    ("POST", "/api/users/{ada}/facts", b'{"text": "\xff"}', "body"),
    ("POST", "/api/users/{ada}/facts", "[1, 2]", "body"),
    ("POST", "/api/users/{ada}/facts", "", "body"),
    ("POST", "/api/users/{ada}/facts", '{"text": [[[[[[[[[["x"]]]]]]]]]]}', "body"),
    ("GET", "/api/users/{ada}/facts?history=maybe", None, "history"),
    ("GET", "/api/jobs?status=exploded", None, "status"),
    ("GET", "/api/sessions?user_id=%3Cscript%3E", None, "user_id"),
    ("GET", "/api/users/a%00b", None, "user_id"),
    ("DELETE", "/api/facts/" + "f" * 129, None, "item_id"),
    ("DELETE", "/api/users/{bob}?reason=" + "r" * 1001, None, "reason"),
]


def test_bad_inputs_get_a_400_naming_the_field_and_change_nothing(server):
    store = open_store(server.cfg.memory)
    ops_before = len(store.op_log(limit=100_000))
    res = _send(server, [(m, p, b.replace("{bob}", server.ids["bob"]) if isinstance(b, str) else b)
                         for m, p, b, _ in BAD])
    ops_after = len(store.op_log(limit=100_000))
    users = {u.name for u in store.list_users()}
    store.close()
    for (method, path, _, field), (status, body) in zip(BAD, res):
        assert status == 400, (method, path, field, status, body)
        assert body["field"] == field and body["error"].startswith(f"{field}: "), (method, path, body)
    assert ops_after == ops_before and users == {"Ada", "Bob"}  # nothing was written


def test_good_inputs_still_work_and_limit_caps_the_page(server):
    ada = server.ids["ada"]
    res = _send(server, [
        ("GET", "/api/oplog?limit=2", None),
        ("GET", "/api/oplog?after=9223372036854775807", None),  # the largest op_id SQLite holds: none after
        ("POST", "/api/users/{ada}/facts", json.dumps({"text": "  plays chess  ", "key": "hobby", "reason": "told us"})),
        ("GET", "/api/users/{ada}/facts?history=1", None),
        ("PATCH", "/api/users/{ada}", json.dumps({"name": "Ada Lovelace 💡", "reason": "full name"})),
        ("GET", "/api/jobs?status=queued", None),
        ("GET", "/api/sessions?user_id={ada}", None),
    ])
    assert [s for s, _ in res] == [200, 200, 201, 200, 200, 200, 200], res
    assert len(res[0][1]["entries"]) == 2 and res[1][1]["entries"] == []
    assert {i["text"]: i["key"] for i in res[3][1]["items"]}["plays chess"] == "hobby"
    assert res[4][1]["user"]["name"] == "Ada Lovelace 💡"
    store = open_store(server.cfg.memory)
    log = [e for e in store.op_log(ada) if e.op == "rename"]
    store.close()
    assert log[-1].reason == "full name"


def test_openapi_states_exactly_what_the_handlers_check(server):
    doc = spec()
    for r in routes:
        schemas = getattr(r.handler, "schemas", None)
        op = doc["paths"][r.path][r.method.lower()]
        if schemas is None:  # the public endpoints take no input
            assert "requestBody" not in op and "parameters" not in op, r.path
            continue
        body = schemas["body"]
        if body is None:
            assert "requestBody" not in op, r.path
        else:
            s = op["requestBody"]["content"]["application/json"]["schema"]
            assert set(s["properties"]) == set(body) and s["additionalProperties"] is False, r.path
            assert set(s["required"]) == {k for k, f in body.items() if getattr(f, "required", False)}
        params = {(p["in"], p["name"]) for p in op.get("parameters", [])}
        assert params == {("path", k) for k in schemas["path"]} | {("query", k) for k in schemas["query"]}, r.path
        assert "400" in op["responses"] or not (schemas["path"] or schemas["query"] or body is not None), r.path
    oplog = {p["name"]: p["schema"] for p in doc["paths"]["/api/oplog"]["get"]["parameters"]}
    assert oplog["limit"]["minimum"] == 1 and oplog["limit"]["maximum"] == OPLOG_CAP


def test_metrics_count_jobs_and_dead_letters_in_the_database(server):
    store = open_store(server.cfg.memory)
    for i in range(3):
        store.enqueue_job("memory_chunk", f"k{i}", {"i": i})
    running = store.claim_job("w", 60.0)
    dead = store.enqueue_job("memory_chunk", "doomed", {}, max_attempts=1)
    while (j := store.claim_job("w", 60.0)) and j.job_id != dead.job_id:
        store.fail_job(j.job_id, "w", "retry later", 3600.0)  # back to queued, not ready for an hour
    store.fail_job(dead.job_id, "w", "boom", 0.0)
    counts = store.job_counts()
    store.close()
    assert running is not None and counts == {"queued": 2, "running": 1, "dead": 1}

    text = _send(server, [("GET", "/metrics", None)])[0][1]
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert values["egomem_memory_queue_depth"] == "3" and values["egomem_memory_dead_letters"] == "1"


def test_tokens_never_reach_the_orchestrator_log(tmp_path):
    """The real process (`python -m egomem.orchestrator`, as `egomem serve` starts it) writes its log
    to a file; a chat token in ?token= and admin tokens in Authorization headers must not appear."""
    cfg = orchestrator_config(test_config(tmp_path), tmp_path, identify_models=False, retrieval=False)
    conf = tmp_path / "egomem.toml"
    conf.write_text(to_toml(cfg))
    log_path = tmp_path / "orchestrator.log"
    url = f"http://127.0.0.1:{cfg.orchestrator.port}"
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "egomem.orchestrator", "--config", str(conf)], stdout=logf,
                                stderr=subprocess.STDOUT, env=dict(os.environ, EGOMEM_CONFIG=str(conf)))
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url + "/healthz", timeout=2).read()
                break
            except (urllib.error.URLError, OSError):
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.2)

        async def go():
            async with aiohttp.ClientSession() as http:
                for q in (f"?token={STREAM_TOKEN}", f"?x=1&tok%65n={STREAM_TOKEN}"):  # sent as written
                    async with http.get(yarl.URL(url + "/api/chat" + q, encoded=True)) as r:  # 400: not a WebSocket
                        await r.read()
                async with http.get(url + "/api/users", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as r:
                    assert r.status == 200
                async with http.get(url + f"/api/users?token={ADMIN_TOKEN}") as r:  # refused, still logged
                    assert r.status in (400, 401)

        run(go())
        time.sleep(0.5)
    finally:
        proc.terminate()
        proc.wait(30)
    log = log_path.read_text()
    assert "/api/chat?token=[redacted]" in log and "tok%65n=[redacted]" in log  # the requests were logged
    assert STREAM_TOKEN not in log and ADMIN_TOKEN not in log
