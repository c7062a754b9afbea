"""The OpenAPI 3.1 description of the REST API (served at /openapi.json). A test checks that every
route the app registers is described here and nothing else is. Parameters and request bodies come
from each handler's validation schema (validate.py), so the document says what the server checks."""

from __future__ import annotations

from typing import Any

from aiohttp import web

# (method, path, summary, scope); inputs come from the handlers' schemas
ENDPOINTS: list[tuple[str, str, str, str | None]] = [
    ("get", "/healthz", "Liveness: the process answers.", None),
    ("get", "/readyz", "Readiness: a Triton replica has the dialog models ready (503 otherwise); per replica its state and streams.", None),
    ("get", "/metrics", "Prometheus metrics (text format 0.0.4).", None),
    ("get", "/openapi.json", "This description.", None),
    ("get", "/api/chat", "WebSocket: Moshi's binary protocol plus EgoMem's kinds (README 'Chat protocol'). "
                         "Token in the Authorization header or ?token=.", "stream"),
    ("get", "/api/users", "List users.", "admin"),
    ("get", "/api/users/{user_id}", "A user's profile and its rendered Level-1 text.", "admin"),
    ("patch", "/api/users/{user_id}", "Rename a user.", "admin"),
    ("delete", "/api/users/{user_id}", "Forget a user: keys, memories, relations, sessions, transcripts; "
                                      "returns the receipt, a verification scan and the orchestrators that did "
                                      "not acknowledge its announcement.", "admin"),
    ("post", "/api/users/{user_id}/merge", "Merge another user into this one.", "admin"),
    ("get", "/api/users/{user_id}/facts", "Current facts and preferences (?history=1: also superseded ones).",
     "admin"),
    ("post", "/api/users/{user_id}/facts", "Add a fact.", "admin"),
    ("delete", "/api/facts/{item_id}", "Retract a fact or preference (kept in history).", "admin"),
    ("get", "/api/users/{user_id}/relations", "Relations touching the user, both directions.", "admin"),
    ("post", "/api/users/{user_id}/relations", "Record 'other is user's <relation>'.", "admin"),
    ("get", "/api/sessions", "Sessions (?user_id=, ?stream_id=).", "admin"),
    ("get", "/api/sessions/{session_id}", "One session with its transcript.", "admin"),
    ("get", "/api/oplog", "The append-only memory-operation log (?user_id=, ?after=, ?limit=).", "admin"),
    ("get", "/api/jobs", "Memory jobs (?status=queued|running|done|dead).", "admin"),
    ("get", "/api/streams", "Open chat streams and who each is talking to.", "admin"),
]

INPUT_ERROR = "#/components/schemas/InputError"  # {"error": "<field>: <why>", "field": "<field>"}


def _schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(method, path) -> the handler's validation schemas (path, query, body)."""
    from .rest import routes

    return {(r.method.lower(), r.path): getattr(r.handler, "schemas", {})
            for r in routes if isinstance(r, web.RouteDef)}


def spec() -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    schemas = _schemas()
    for method, path, summary, scope in ENDPOINTS:
        inputs = schemas.get((method, path), {})
        op: dict[str, Any] = {"summary": summary, "responses": {"200": {"description": "OK"}}}
        params = [{"name": p.strip("{}"), "in": "path", "required": True, "schema": {"type": "string"}}
                  for p in path.split("/") if p.startswith("{")]
        for p in params:
            field = inputs.get("path", {}).get(p["name"])
            if field is not None:
                p["schema"] = field.openapi()
        params += [{"name": k, "in": "query", "required": False, "schema": f.openapi()}
                   for k, f in inputs.get("query", {}).items()]
        if params:
            op["parameters"] = params
        if any(p["in"] == "path" for p in params):
            op["responses"]["404"] = {"description": "No such object"}
        if scope:
            op["security"] = [{"bearer": [scope]}]
            op["responses"]["401"] = {"description": "Missing or invalid token"}
            if scope == "admin":
                op["responses"]["403"] = {"description": "Token lacks the admin scope"}
        body = inputs.get("body")
        if body is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "additionalProperties": False,
                "required": [k for k, f in body.items() if getattr(f, "required", False)],
                "properties": {k: f.openapi() for k, f in body.items()}}}}}
        if inputs.get("path") or inputs.get("query") or body is not None:
            op["responses"]["400"] = {"description": "Invalid input; the body names the field",
                                      "content": {"application/json": {"schema": {"$ref": INPUT_ERROR}}}}
        paths.setdefault(path, {})[method] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "EgoMem orchestrator", "version": "0.1.0",
                 "description": "Chat streams with lifelong memory of people; REST over the memory store."},
        "components": {"schemas": {"InputError": {"type": "object", "required": ["error", "field"], "properties": {
                           "error": {"type": "string"}, "field": {"type": "string"}}}},
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                                      "description": "scopes: stream (chat), admin (memory)"}}},
        "paths": paths,
    }
