"""REST over the memory store (admin scope): users, facts, relations, sessions, the operation log,
forget; plus /healthz, /readyz, /metrics and /openapi.json. Store calls are blocking SQLite, so
each runs in a worker thread; the event loop (and every stream's tick) never waits on disk."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import numpy as np
from aiohttp import web

from egomem.memory import StoreError
from egomem.memory.types import Provenance

from .openapi import spec
from .services import Services

routes = web.RouteTableDef()
ADMIN = Provenance(actor="admin_api", origin="manual")


def _s(request: web.Request) -> Services:
    from .app import SERVICES

    return request.app[SERVICES]


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.name != "vector"}
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.json_response(_plain(obj), status=status)


async def _run(fn, *args, **kwargs):
    return await asyncio.to_thread(fn, *args, **kwargs)


async def _body(request: web.Request, *required: str) -> dict[str, Any]:
    try:
        data = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise web.HTTPBadRequest(text=json.dumps({"error": "body must be a JSON object"}),
                                 content_type="application/json") from None
    if not isinstance(data, dict):
        raise web.HTTPBadRequest(text=json.dumps({"error": "body must be a JSON object"}), content_type="application/json")
    missing = [k for k in required if not isinstance(data.get(k), str) or not data[k].strip()]
    if missing:
        raise web.HTTPBadRequest(text=json.dumps({"error": f"missing or empty string field(s): {', '.join(missing)}"}),
                                 content_type="application/json")
    return data


async def _user(request: web.Request):
    user = await _run(_s(request).store.resolve_user, request.match_info["user_id"])
    if user is None:
        raise web.HTTPNotFound(text=json.dumps({"error": "no such user"}), content_type="application/json")
    return user


# -- health ----------------------------------------------------------------------------------------
@routes.get("/healthz")
async def healthz(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


@routes.get("/readyz")
async def readyz(request: web.Request) -> web.Response:
    s = _s(request)
    models = ["mimi_codec", "dialog_lm"]
    ready = {m: await s.triton.is_ready(m) for m in models}
    ok = all(ready.values())
    return _json({"ready": ok, "models": ready, "free_stream_slots": s.free_slots}, status=200 if ok else 503)


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    s = _s(request)
    try:
        queued = await _run(s.store.list_jobs, "queued")
        running = await _run(s.store.list_jobs, "running")
        dead = await _run(s.store.dead_letters)
        s.metrics.set("egomem_memory_queue_depth", len(queued) + len(running))
        s.metrics.set("egomem_memory_dead_letters", len(dead))
    except StoreError:
        pass
    return web.Response(text=s.metrics.render(), content_type="text/plain", charset="utf-8",
                        headers={"X-Prometheus-Format": "0.0.4"})


@routes.get("/openapi.json")
async def openapi(request: web.Request) -> web.Response:
    return web.json_response(spec())


# -- users -----------------------------------------------------------------------------------------
@routes.get("/api/users")
async def list_users(request: web.Request) -> web.Response:
    users = await _run(_s(request).store.list_users)
    return _json({"users": users})


@routes.get("/api/users/{user_id}")
async def get_user(request: web.Request) -> web.Response:
    s = _s(request)
    user = await _user(request)
    profile = await _run(s.store.profile, user.user_id)
    rendered = await _run(s.store.render_profile, user.user_id, s.cfg.memory.profile_max_chars)
    return _json({"profile": profile, "rendered": rendered})


@routes.patch("/api/users/{user_id}")
async def rename_user(request: web.Request) -> web.Response:
    body = await _body(request, "name")
    user = await _user(request)
    return _json({"user": await _run(_s(request).store.rename_user, user.user_id, body["name"].strip(), ADMIN,
                                     body.get("reason", ""))})


@routes.post("/api/users/{user_id}/merge")
async def merge_user(request: web.Request) -> web.Response:
    body = await _body(request, "drop_user_id")
    user = await _user(request)
    kept = await _run(_s(request).store.merge_users, user.user_id, body["drop_user_id"], ADMIN, body.get("reason", ""))
    return _json({"user": kept})


@routes.delete("/api/users/{user_id}")
async def forget_user(request: web.Request) -> web.Response:
    """Forget: keys, memories, relations, sessions, transcripts, and the name wherever others' memories
    mention it; live streams stop using the user at once and reload others' (redacted) profiles."""
    s = _s(request)
    user = await _user(request)
    receipt = await _run(s.store.forget_user, user.user_id, ADMIN, request.query.get("reason", ""))
    if s.perception is not None:
        s.perception.forget()
    for stream in list(s.streams.values()):
        stream.forget_user(user.user_id)
    leftovers = await _run(s.store.verify_forgotten, user.user_id, (), user.name)
    return _json({"receipt": receipt, "verified_leftovers": leftovers})


# -- facts, relations ---------------------------------------------------------------------------------
@routes.get("/api/users/{user_id}/facts")
async def facts(request: web.Request) -> web.Response:
    user = await _user(request)
    history = request.query.get("history", "") in ("1", "true")
    items = await _run(_s(request).store.items, user.user_id, None, history)
    return _json({"items": items})


@routes.post("/api/users/{user_id}/facts")
async def add_fact(request: web.Request) -> web.Response:
    body = await _body(request, "text")
    user = await _user(request)
    item_id = await _run(_s(request).store.add_fact, user.user_id, body["text"].strip(), body.get("key"), ADMIN,
                         body.get("reason", ""))
    return _json({"item_id": item_id}, status=201)


@routes.delete("/api/facts/{item_id}")
async def retract_fact(request: web.Request) -> web.Response:
    await _run(_s(request).store.retract_item, request.match_info["item_id"], ADMIN, request.query.get("reason", ""))
    return _json({"retracted": request.match_info["item_id"]})


@routes.get("/api/users/{user_id}/relations")
async def relations(request: web.Request) -> web.Response:
    user = await _user(request)
    rels = await _run(_s(request).store.relations, user.user_id)
    return _json({"relations": [{**_plain(r), "other_name": name} for r, name in rels]})


@routes.post("/api/users/{user_id}/relations")
async def add_relation(request: web.Request) -> web.Response:
    body = await _body(request, "other_user_id", "relation")
    user = await _user(request)
    rid = await _run(_s(request).store.add_relation, user.user_id, body["other_user_id"], body["relation"].strip(), ADMIN)
    return _json({"relation_id": rid}, status=201)


# -- sessions, op log, streams, jobs ------------------------------------------------------------------
@routes.get("/api/sessions")
async def sessions(request: web.Request) -> web.Response:
    q = request.query
    rows = await _run(_s(request).store.list_sessions, q.get("user_id"), q.get("stream_id"))
    return _json({"sessions": rows})


@routes.get("/api/sessions/{session_id}")
async def session(request: web.Request) -> web.Response:
    row = await _run(_s(request).store.get_session, request.match_info["session_id"])
    if row is None:
        raise web.HTTPNotFound(text=json.dumps({"error": "no such session"}), content_type="application/json")
    return _json({"session": row})


@routes.get("/api/oplog")
async def oplog(request: web.Request) -> web.Response:
    q = request.query
    try:
        after, limit = int(q.get("after", 0)), min(int(q.get("limit", 1000)), 10_000)
    except ValueError:
        raise web.HTTPBadRequest(text=json.dumps({"error": "after and limit are integers"}),
                                 content_type="application/json") from None
    rows = await _run(_s(request).store.op_log, q.get("user_id"), after, limit)
    return _json({"entries": rows})


@routes.get("/api/jobs")
async def jobs(request: web.Request) -> web.Response:
    rows = await _run(_s(request).store.list_jobs, request.query.get("status"))
    return _json({"jobs": [{k: v for k, v in _plain(j).items() if k != "payload"} for j in rows]})


@routes.get("/api/streams")
async def streams(request: web.Request) -> web.Response:
    s = _s(request)
    return _json({"streams": [{"stream_id": k, "user_id": v.user_id, "ticks": v.ticks, "opened_at": v.opened_at}
                              for k, v in s.streams.items()], "free_slots": s.free_slots})

