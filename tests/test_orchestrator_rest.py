"""REST, auth, health, metrics and OpenAPI through a real aiohttp server on loopback (no Triton needed)."""

from __future__ import annotations

import aiohttp
import pytest

from egomem.client import ApiError, EgoMemClient
from egomem.memory import open_store
from egomem.orchestrator.auth import AuthConfigError, TokenTable
from egomem.orchestrator.openapi import spec
from tests.conftest import test_config
from tests.orchestrator_harness import (
    ADMIN_TOKEN,
    FORGED_TOKEN,
    STREAM_TOKEN,
    OrchestratorThread,
    orchestrator_config,
    run,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("orch_rest")
    cfg = orchestrator_config(test_config(d), d, identify_models=False, retrieval=False)
    store = open_store(cfg.memory)
    ada = store.create_user("Ada")
    bob = store.create_user("Bob")
    store.add_fact(ada.user_id, "lives in Paris")
    store.add_relation(ada.user_id, bob.user_id, "colleague")
    store.close()
    with OrchestratorThread(cfg) as orch:
        orch.ids = {"ada": ada.user_id, "bob": bob.user_id}
        yield orch


ADMIN_ROUTES = [("GET", "/api/users"), ("GET", "/api/users/{ada}"), ("PATCH", "/api/users/{ada}"),
                ("DELETE", "/api/users/{ada}"), ("POST", "/api/users/{ada}/merge"), ("GET", "/api/users/{ada}/facts"),
                ("POST", "/api/users/{ada}/facts"), ("DELETE", "/api/facts/x"), ("GET", "/api/users/{ada}/relations"),
                ("POST", "/api/users/{ada}/relations"), ("GET", "/api/sessions"), ("GET", "/api/sessions/x"),
                ("GET", "/api/oplog"), ("GET", "/api/jobs"), ("GET", "/api/streams"), ("GET", "/api/nope")]


def test_every_admin_route_needs_an_admin_token(server):
    async def go():
        out = {}
        async with aiohttp.ClientSession() as http:
            for method, path in ADMIN_ROUTES:
                url = server.url + path.format(**server.ids)
                for label, headers in [("none", {}), ("forged", {"Authorization": f"Bearer {FORGED_TOKEN}"}),
                                       ("basic", {"Authorization": "Basic YWRhOmFkYQ=="}),
                                       ("stream", {"Authorization": f"Bearer {STREAM_TOKEN}"})]:
                    async with http.request(method, url, headers=headers, json={"name": "Mallory"}) as r:
                        out[(method, path, label)] = (r.status, await r.text())
        return out

    out = run(go())
    for (method, path, label), (status, body) in out.items():
        assert status == (403 if label == "stream" else 401), (method, path, label, status)
        assert "Ada" not in body and "Paris" not in body and "Bob" not in body  # nothing leaks
    store = open_store(server.cfg.memory)  # and nothing changed
    assert store.get_user(server.ids["ada"]).name == "Ada"
    store.close()


def test_chat_needs_a_stream_token(server):
    async def go():
        async with aiohttp.ClientSession() as http:
            codes = []
            for q in ["", f"?token={FORGED_TOKEN}"]:
                with pytest.raises(aiohttp.WSServerHandshakeError) as e:
                    await http.ws_connect(server.url.replace("http", "ws") + "/api/chat" + q)
                codes.append(e.value.status)
            return codes

    assert run(go()) == [401, 401]


def test_public_endpoints_and_metrics(server):
    async def go():
        async with EgoMemClient(server.url, None) as c:
            health = await c.health()
            ready = await c.ready()
            metrics = await c.metrics()
            api = await c.request("GET", "/openapi.json")
        return health, ready, metrics, api

    health, ready, metrics, api = run(go())
    assert health == {"status": "ok"}
    assert ready is False  # no tritonserver behind this one
    for name in ("egomem_tick_seconds_bucket", "egomem_open_streams 0", "egomem_tick_deadline_misses_total",
                 "egomem_refresh_seconds_count", "egomem_identification_seconds_count",
                 "egomem_memory_queue_depth", "egomem_triton_errors_total"):
        assert name in metrics
    assert api["openapi"].startswith("3.") and "/api/users/{user_id}" in api["paths"]


def test_openapi_describes_exactly_the_registered_routes(server):
    registered = set()
    for route in server.app.router.routes():
        info = route.resource.get_info() if route.resource else {}
        path = info.get("path") or info.get("formatter")
        if route.method != "HEAD":
            registered.add((route.method.lower(), path))
    described = {(m, p) for p, ops in spec()["paths"].items() for m in ops}
    assert registered == described


def test_admin_rest_reads_and_changes_memory(server):
    ada = server.ids["ada"]

    async def go():
        async with EgoMemClient(server.url, ADMIN_TOKEN) as c:
            users = await c.users()
            prof = await c.user(ada)
            await c.rename(ada, "Ada Lovelace")
            fid = await c.add_fact(ada, "plays chess")
            facts = await c.facts(ada)
            rels = await c.relations(ada)
            errors = []
            for call in (c.request("POST", f"/api/users/{ada}/facts", {"text": ""}),
                         c.request("PATCH", f"/api/users/{ada}", [1, 2]),
                         c.user("no-such-user"),
                         c.request("GET", "/api/oplog", after="x")):
                with pytest.raises(ApiError) as e:
                    await call
                errors.append(e.value.status)
            log = await c.oplog(ada)
            carol = None
            return users, prof, fid, facts, rels, errors, log, carol

    users, prof, fid, facts, rels, errors, log, _ = run(go())
    assert {u["name"] for u in users} >= {"Ada", "Bob"}
    assert "name: Ada" in prof["rendered"] and "lives in Paris" in prof["rendered"]
    assert {f["text"] for f in facts} == {"lives in Paris", "plays chess"}
    assert rels[0]["other_name"] == "Bob" and rels[0]["relation"] == "colleague"
    assert errors == [400, 400, 404, 400]
    assert any(e["op"] for e in log) and len(log) >= 3


def test_forget_removes_the_user_verifiably(server):
    bob = server.ids["bob"]

    async def go():
        async with EgoMemClient(server.url, ADMIN_TOKEN) as c:
            res = await c.forget(bob)
            with pytest.raises(ApiError) as e:
                await c.user(bob)
            rels = await c.relations(server.ids["ada"])
            return res, e.value.status, rels

    res, status, rels = run(go())
    assert res["verified_leftovers"] == [] and res["receipt"]["leftovers"] == []
    assert status == 404 and rels == []


def test_body_limit_and_token_table_rules(server):
    async def go():
        async with EgoMemClient(server.url, ADMIN_TOKEN) as c:
            with pytest.raises(ApiError) as e:
                await c.request("POST", f"/api/users/{server.ids['ada']}/facts", {"text": "x" * 2_000_000})
            return e.value.status

    assert run(go()) == 413
    with pytest.raises(AuthConfigError, match="no API tokens"):
        TokenTable({})
    with pytest.raises(AuthConfigError, match="scope"):
        TokenTable({"a" * 20: "root"})
    t = TokenTable.load(None, f"{'s' * 20}:stream,{'a' * 20}:admin")
    assert t.scope_of("s" * 20) == "stream" and t.scope_of("a" * 20) == "admin" and t.scope_of("x" * 20) is None


def test_anonymous_chat_admits_token_less_chats_only():
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from egomem.orchestrator.auth import auth_middleware

    async def ok(request):
        return web.json_response({"scope": request["scope"]})

    async def go():
        app = web.Application(middlewares=[auth_middleware(TokenTable({STREAM_TOKEN: "stream"}), anonymous_chat=True)])
        app.router.add_get("/api/chat", ok)
        app.router.add_get("/api/users", ok)
        async with TestClient(TestServer(app, host="127.0.0.1")) as c:
            chat = await c.get("/api/chat")
            forged = await c.get("/api/chat", headers={"Authorization": f"Bearer {FORGED_TOKEN}"})
            admin = await c.get("/api/users")
            return chat.status, await chat.json(), forged.status, admin.status

    assert run(go()) == (200, {"scope": "stream"}, 401, 401)  # a wrong token is still refused
