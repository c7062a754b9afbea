"""REST over the memory store (admin scope): users, facts, relations, sessions, the operation log,
forget; plus /healthz, /readyz and /metrics (app.py serves /openapi.json, openapi.py's description of
these routes). Store calls are blocking SQLite, so each runs in a worker thread; the event loop (and
every stream's tick) never waits on disk or on a lock held across a model call. Every input is
checked by its route's schema (validate.py): a bad one is a 400 naming the field."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from aiohttp import web

from egomem.memory import StoreError
from egomem.memory.types import Provenance

from .forgets import await_acks, complete_here, prepare_here
from .replicas import STREAM_MODELS
from .services import SERVICES, Services
from .validate import ID_PATTERN, INT64_MAX, Bool, Inputs, Int, Str, validated

log = logging.getLogger(__name__)
routes = web.RouteTableDef()
ADMIN = Provenance(actor="admin_api", origin="manual")
OPLOG_CAP = 10_000  # rows one /api/oplog page may return
# Admin work runs in its own few threads: a burst of admin requests neither takes the default pool's
# threads from the streams (identify, retrieve, memory hand-over) nor starves the event loop of the
# GIL. Measured on 2 cores, 450 `/api/oplog?limit=10000` (1 300 rows) 16 at a time: event-loop lag
# max 506 ms on the 6-thread default pool, 218 ms with these 2 threads.
REST_THREADS = 2
_POOL = ThreadPoolExecutor(max_workers=REST_THREADS, thread_name_prefix="egomem-rest")

ID = Str(required=True, max_len=128, pattern=ID_PATTERN)
OPTIONAL_ID = Str(max_len=128, pattern=ID_PATTERN)
REASON = Str(max_len=1000, default="", doc="Why (kept in the operation log).")
USER = {"user_id": ID}
JOB_STATES = ("queued", "running", "done", "dead")


def _s(request: web.Request) -> Services:
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


async def _json(obj: Any, status: int = 200) -> web.Response:
    """Serialised in a worker thread: a 10 000-row op-log page is tens of ms of CPU, not the loop's."""
    text = await _run(lambda: json.dumps(_plain(obj)))
    return web.Response(text=text, status=status, content_type="application/json")


async def _run(fn, *args, **kwargs):
    """`fn` in one of the REST threads (not asyncio's default pool, which the streams use)."""
    return await asyncio.get_running_loop().run_in_executor(_POOL, functools.partial(fn, *args, **kwargs))


async def _user(request: web.Request, user_id: str):
    user = await _run(_s(request).store.resolve_user, user_id)
    if user is None:
        raise web.HTTPNotFound(text=json.dumps({"error": "no such user"}), content_type="application/json")
    return user


# -- health ----------------------------------------------------------------------------------------
@routes.get("/healthz")
async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})  # no worker thread: liveness never queues behind the store


@routes.get("/readyz")
async def readyz(request: web.Request) -> web.Response:
    """Ready when at least one Triton replica has the stream models ready (asked now, never cached)."""
    s = _s(request)
    replicas = await s.replicas.probe()
    ready = {m: any(r.models.get(m, False) for r in replicas) for m in STREAM_MODELS}
    ok = any(r.ready for r in replicas)
    return await _json({"ready": ok, "models": ready, "free_stream_slots": s.free_slots,
                        "replicas": [{"replica": r.index, "ready": r.ready, "streams": r.streams} for r in replicas]},
                       status=200 if ok else 503)


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    """Queue gauges are counted by the database (one GROUP BY), not by loading every job row."""
    s = _s(request)
    try:
        counts = await _run(s.store.job_counts)
        dead = await _run(s.store.dead_letter_count)
        s.metrics.set("egomem_memory_queue_depth", counts.get("queued", 0) + counts.get("running", 0))
        s.metrics.set("egomem_memory_dead_letters", dead)
    except StoreError:
        pass
    return web.Response(text=s.metrics.render(), content_type="text/plain", charset="utf-8",
                        headers={"X-Prometheus-Format": "0.0.4"})


# -- users -----------------------------------------------------------------------------------------
@routes.get("/api/users")
@validated()
async def list_users(request: web.Request, v: Inputs) -> web.Response:
    users = await _run(_s(request).store.list_users)
    return await _json({"users": users})


@routes.get("/api/users/{user_id}")
@validated(path=USER)
async def get_user(request: web.Request, v: Inputs) -> web.Response:
    s = _s(request)
    user = await _user(request, v.path["user_id"])
    profile = await _run(s.store.profile, user.user_id)
    rendered = await _run(s.store.render_profile, user.user_id, s.cfg.memory.profile_max_chars)
    return await _json({"profile": profile, "rendered": rendered})


@routes.patch("/api/users/{user_id}")
@validated(path=USER, body={"name": Str(required=True, max_len=200, doc="The new name."), "reason": REASON})
async def rename_user(request: web.Request, v: Inputs) -> web.Response:
    user = await _user(request, v.path["user_id"])
    return await _json({"user": await _run(_s(request).store.rename_user, user.user_id, v.body["name"], ADMIN,
                                     v.body["reason"])})


@routes.post("/api/users/{user_id}/merge")
@validated(path=USER, body={"drop_user_id": Str(required=True, max_len=128, pattern=ID_PATTERN,
                                                doc="The user merged into this one (then gone)."),
                            "reason": REASON})
async def merge_user(request: web.Request, v: Inputs) -> web.Response:
    user = await _user(request, v.path["user_id"])
    kept = await _run(_s(request).store.merge_users, user.user_id, v.body["drop_user_id"], ADMIN, v.body["reason"])
    return await _json({"user": kept})


@routes.delete("/api/users/{user_id}")
@validated(path=USER, query={"reason": REASON})
async def forget_user(request: web.Request, v: Inputs) -> web.Response:
    """Forget: keys, memories, relations, sessions, transcripts, every name the user has had wherever
    others' memories (and queued memory chunks) mention it; live streams stop using the user at once
    and reload others' (redacted) profiles. The check scans the cells and the database's raw bytes.

    Two phases (forgets.py): announced first, so every orchestrator sharing the store (this one too)
    redacts its streams' recordings while the names and keys are still there and acknowledges; the
    forget waits for the live ones' acknowledgements at most `memory.forget_prepare_timeout_s`, and
    lists those that did not acknowledge (their recordings may still hold the person) in `unacknowledged`."""
    s = _s(request)
    user = await _user(request, v.path["user_id"])
    m = s.cfg.memory
    await _run(s.store.purge_coordination, m.forget_prepare_ttl_s, m.forget_prepare_ttl_s)  # dead forgetters' rows
    request_id = await _run(s.store.announce_forget, user.user_id, ADMIN)
    pending = await prepare_here(s, user.user_id, request_id)  # this process's streams, as the others do theirs
    try:
        waited = time.monotonic()
        unacked = await await_acks(s, request_id)
        waited = time.monotonic() - waited
        if unacked:
            log.warning("forget %s: %d orchestrator(s) did not acknowledge within memory.forget_prepare_timeout_s "
                        "= %.1f s; what their streams recorded of the person and not yet cut may reach memory: %s",
                        request_id, len(unacked), m.forget_prepare_timeout_s,
                        ", ".join(f"{o.label} ({o.origin})" for o in unacked))
        receipt = await _run(s.store.forget_user, user.user_id, ADMIN, v.query["reason"])
        complete_here(s, request_id)  # once more: what the streams recorded while the others acknowledged
    finally:
        s.forgets.drop(request_id)  # the forget failed or was cancelled: stop redacting here (others: their TTL)
    if s.perception is not None:
        await _run(s.perception.forget)  # never waits behind a retrieval; the identifier's lock may be busy
    for stream in list(s.streams.values()):
        stream.forget_user(user.user_id)
    leftovers = await _run(s.store.verify_forgotten, user.user_id, (), pending.names)
    now = time.time()
    return await _json({
        "receipt": receipt, "verified_leftovers": leftovers, "request_id": request_id, "ack_wait_s": round(waited, 3),
        "unacknowledged": [{"origin": o.origin, "label": o.label, "heartbeat_age_s": round(now - o.heartbeat_at, 3)}
                           for o in unacked]})


# -- facts, relations ---------------------------------------------------------------------------------
@routes.get("/api/users/{user_id}/facts")
@validated(path=USER, query={"history": Bool(doc="Also superseded and retracted items.")})
async def facts(request: web.Request, v: Inputs) -> web.Response:
    user = await _user(request, v.path["user_id"])
    items = await _run(_s(request).store.items, user.user_id, None, v.query["history"])
    return await _json({"items": items})


@routes.post("/api/users/{user_id}/facts")
@validated(path=USER, body={"text": Str(required=True, max_len=4000, doc="The fact."),
                            "key": Str(max_len=200, doc="Slot it fills (a new fact with the key supersedes)."),
                            "reason": REASON})
async def add_fact(request: web.Request, v: Inputs) -> web.Response:
    user = await _user(request, v.path["user_id"])
    item_id = await _run(_s(request).store.add_fact, user.user_id, v.body["text"], v.body["key"] or None, ADMIN,
                         v.body["reason"])
    return await _json({"item_id": item_id}, status=201)


@routes.delete("/api/facts/{item_id}")
@validated(path={"item_id": ID}, query={"reason": REASON})
async def retract_fact(request: web.Request, v: Inputs) -> web.Response:
    await _run(_s(request).store.retract_item, v.path["item_id"], ADMIN, v.query["reason"])
    return await _json({"retracted": v.path["item_id"]})


@routes.get("/api/users/{user_id}/relations")
@validated(path=USER)
async def relations(request: web.Request, v: Inputs) -> web.Response:
    user = await _user(request, v.path["user_id"])
    rels = await _run(_s(request).store.relations, user.user_id)
    return await _json({"relations": [{**_plain(r), "other_name": name} for r, name in rels]})


@routes.post("/api/users/{user_id}/relations")
@validated(path=USER, body={"other_user_id": Str(required=True, max_len=128, pattern=ID_PATTERN),
                            "relation": Str(required=True, max_len=200, doc="What the other is to the user.")})
async def add_relation(request: web.Request, v: Inputs) -> web.Response:
    user = await _user(request, v.path["user_id"])
    rid = await _run(_s(request).store.add_relation, user.user_id, v.body["other_user_id"], v.body["relation"], ADMIN)
    return await _json({"relation_id": rid}, status=201)


# -- sessions, op log, streams, jobs ------------------------------------------------------------------
@routes.get("/api/sessions")
@validated(query={"user_id": OPTIONAL_ID, "stream_id": OPTIONAL_ID})
async def sessions(request: web.Request, v: Inputs) -> web.Response:
    rows = await _run(_s(request).store.list_sessions, v.query["user_id"] or None, v.query["stream_id"] or None)
    return await _json({"sessions": rows})


@routes.get("/api/sessions/{session_id}")
@validated(path={"session_id": ID})
async def session(request: web.Request, v: Inputs) -> web.Response:
    row = await _run(_s(request).store.get_session, v.path["session_id"])
    if row is None:
        raise web.HTTPNotFound(text=json.dumps({"error": "no such session"}), content_type="application/json")
    return await _json({"session": row})


@routes.get("/api/oplog")
@validated(query={"user_id": OPTIONAL_ID,
                  "after": Int(0, INT64_MAX, 0, doc="Entries after this op_id."),
                  "limit": Int(1, OPLOG_CAP, 1000, doc="Entries at most.")})
async def oplog(request: web.Request, v: Inputs) -> web.Response:
    q = v.query
    rows = await _run(_s(request).store.op_log, q["user_id"] or None, q["after"], q["limit"])
    return await _json({"entries": rows})


@routes.get("/api/jobs")
@validated(query={"status": Str(max_len=16, choices=JOB_STATES)})
async def jobs(request: web.Request, v: Inputs) -> web.Response:
    store = _s(request).store
    rows = await _run(lambda: [{k: val for k, val in _plain(j).items() if k != "payload"}
                               for j in store.list_jobs(v.query["status"] or None)])
    return await _json({"jobs": rows})


@routes.get("/api/streams")
@validated()
async def streams(request: web.Request, v: Inputs) -> web.Response:
    s = _s(request)
    rows = [{"stream_id": k, "user_id": st.user_id, "ticks": st.ticks, "opened_at": st.opened_at}
            for k, st in s.streams.items()]
    return await _json({"streams": rows, "free_slots": s.free_slots})
