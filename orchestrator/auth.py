"""Bearer-token auth with two scopes: `stream` (may open chats) and `admin` (may also read and change memory).

Tokens come from a JSON file ({"<token>": "stream"|"admin"}) and/or `$EGOMEM_TOKENS`
("<token>:<scope>,..."). Only SHA-256 digests are kept in memory and compared in constant time.
A request names its token in `Authorization: Bearer <token>`, or — for Moshi's own clients, which
cannot set headers — in the `?token=` query parameter of `/api/chat` only.

401: no token or an unknown (forged) one. 403: a valid token without the route's scope. Neither
response says anything about which tokens exist.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Literal

from aiohttp import web

Scope = Literal["stream", "admin"]
SCOPES: tuple[Scope, ...] = ("stream", "admin")
PUBLIC = {"/healthz", "/readyz", "/metrics", "/openapi.json"}  # no token needed (no memory in them)
QUERY_TOKEN_PATHS = {"/api/chat"}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class AuthConfigError(RuntimeError):
    """No usable tokens: the service refuses to start open to everyone."""


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class TokenTable:
    """token digest -> scope."""

    def __init__(self, tokens: dict[str, Scope]):
        for t, s in tokens.items():
            if s not in SCOPES:
                raise AuthConfigError(f"token scope {s!r} is not one of {SCOPES}")
            if len(t) < 16:
                raise AuthConfigError("tokens must be at least 16 characters (use `secrets.token_urlsafe()`)")
        self._scopes = [(_digest(t), s) for t, s in tokens.items()]
        if not self._scopes:
            raise AuthConfigError("no API tokens configured: set orchestrator.tokens_file or $EGOMEM_TOKENS "
                                  "(`egomem serve` writes one for you at <server.run_dir>/tokens.json)")

    def scope_of(self, token: str) -> Scope | None:
        d = _digest(token)
        found: Scope | None = None
        for digest, scope in self._scopes:  # no early exit: timing says nothing about the table
            if hmac.compare_digest(digest, d):
                found = scope
        return found

    @classmethod
    def load(cls, file: Path | None, env_value: str | None) -> TokenTable:
        tokens: dict[str, Scope] = {}
        if file is not None and Path(file).is_file():
            try:
                data = json.loads(Path(file).read_text())
            except json.JSONDecodeError as e:
                raise AuthConfigError(f"tokens file {file} is not JSON: {e}") from None
            if not isinstance(data, dict):
                raise AuthConfigError(f'tokens file {file} must be a JSON object {{"<token>": "stream"|"admin"}}')
            tokens.update(data)
        for part in (env_value or "").split(","):
            if part.strip():
                tok, _, scope = part.strip().rpartition(":")
                if not tok:
                    raise AuthConfigError("token variable entries are '<token>:<scope>' separated by commas")
                tokens[tok] = scope
        return cls(tokens)


def _token_of(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    if header:
        kind, _, tok = header.partition(" ")
        return tok.strip() if kind.lower() == "bearer" and tok.strip() else None
    if request.path in QUERY_TOKEN_PATHS:
        return request.query.get("token") or None
    return None


def required_scope(path: str) -> Scope | None:
    if path in PUBLIC:
        return None
    if path in QUERY_TOKEN_PATHS:
        return "stream"
    return "admin"  # every other route reads or changes memory


def _deny(status: int, message: str) -> web.Response:
    headers = {"WWW-Authenticate": 'Bearer realm="egomem"'} if status == 401 else None
    return web.json_response({"error": message}, status=status, headers=headers)


def auth_middleware(table: TokenTable, anonymous_chat: bool = False) -> Callable:
    """`anonymous_chat`: a chat without any token is let in with the `stream` scope (Moshi's clients)."""

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        need = required_scope(request.path)
        if need is None:
            return await handler(request)
        token = _token_of(request)
        if token is None and anonymous_chat and need == "stream" and "Authorization" not in request.headers:
            request["scope"] = "stream"
            return await handler(request)
        if token is None:
            return _deny(401, "missing bearer token (Authorization: Bearer <token>)")
        scope = table.scope_of(token)
        if scope is None:
            return _deny(401, "invalid token")
        if need == "admin" and scope != "admin":
            return _deny(403, "this token's scope does not allow this route (needs 'admin')")
        request["scope"] = scope
        return await handler(request)

    return auth
