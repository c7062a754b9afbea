"""The OpenAPI 3.1 description of the REST API (served at /openapi.json). A test checks that every
route the app registers is described here and nothing else is."""

from __future__ import annotations

from typing import Any

# (method, path, summary, scope, json body fields or None)
ENDPOINTS: list[tuple[str, str, str, str | None, dict[str, str] | None]] = [
    ("get", "/healthz", "Liveness: the process answers.", None, None),
    ("get", "/readyz", "Readiness: Triton and the dialog models are ready (503 otherwise).", None, None),
    ("get", "/metrics", "Prometheus metrics (text format 0.0.4).", None, None),
    ("get", "/openapi.json", "This description.", None, None),
    ("get", "/api/chat", "WebSocket: Moshi's binary protocol plus EgoMem's kinds (README 'Chat protocol'). "
                         "Token in the Authorization header or ?token=.", "stream", None),
    ("get", "/api/users", "List users.", "admin", None),
    ("get", "/api/users/{user_id}", "A user's profile and its rendered Level-1 text.", "admin", None),
    ("patch", "/api/users/{user_id}", "Rename a user.", "admin", {"name": "string", "reason": "string"}),
    ("delete", "/api/users/{user_id}", "Forget a user: keys, memories, relations, sessions, transcripts; "
                                      "returns the receipt and a verification scan.", "admin", None),
    ("post", "/api/users/{user_id}/merge", "Merge another user into this one.", "admin",
     {"drop_user_id": "string", "reason": "string"}),
    ("get", "/api/users/{user_id}/facts", "Current facts and preferences (?history=1: also superseded ones).",
     "admin", None),
    ("post", "/api/users/{user_id}/facts", "Add a fact.", "admin", {"text": "string", "key": "string", "reason": "string"}),
    ("delete", "/api/facts/{item_id}", "Retract a fact or preference (kept in history).", "admin", None),
    ("get", "/api/users/{user_id}/relations", "Relations touching the user, both directions.", "admin", None),
    ("post", "/api/users/{user_id}/relations", "Record 'other is user's <relation>'.", "admin",
     {"other_user_id": "string", "relation": "string"}),
    ("get", "/api/sessions", "Sessions (?user_id=, ?stream_id=).", "admin", None),
    ("get", "/api/sessions/{session_id}", "One session with its transcript.", "admin", None),
    ("get", "/api/oplog", "The append-only memory-operation log (?user_id=, ?after=, ?limit=).", "admin", None),
    ("get", "/api/jobs", "Memory jobs (?status=queued|running|done|dead).", "admin", None),
    ("get", "/api/streams", "Open chat streams and who each is talking to.", "admin", None),
]


def spec() -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for method, path, summary, scope, body in ENDPOINTS:
        op: dict[str, Any] = {"summary": summary, "responses": {"200": {"description": "OK"}}}
        params = [p.strip("{}") for p in path.split("/") if p.startswith("{")]
        if params:
            op["parameters"] = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}} for p in params]
            op["responses"]["404"] = {"description": "No such object"}
        if scope:
            op["security"] = [{"bearer": [scope]}]
            op["responses"]["401"] = {"description": "Missing or invalid token"}
            if scope == "admin":
                op["responses"]["403"] = {"description": "Token lacks the admin scope"}
        if body:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "properties": {k: {"type": t} for k, t in body.items()}}}}}
            op["responses"]["400"] = {"description": "Malformed body"}
        paths.setdefault(path, {})[method] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "EgoMem orchestrator", "version": "0.1.0",
                 "description": "Chat streams with lifelong memory of people; REST over the memory store."},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                                      "description": "scopes: stream (chat), admin (memory)"}}},
        "paths": paths,
    }
