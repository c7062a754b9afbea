"""Middlewares, one concern each: errors (JSON, nothing internal leaks) and limits (body size, counting).
Auth is in auth.py. Also the log filter that keeps tokens out of every log line (`RedactTokens`)."""

from __future__ import annotations

import logging
import re
import uuid

from aiohttp import web

from egomem.memory import StoreError, VersionConflict

from .metrics import Metrics

log = logging.getLogger(__name__)


@web.middleware
async def errors(request: web.Request, handler) -> web.StreamResponse:
    """Store refusals -> 400/409 with the store's message; anything unexpected -> 500 with an id to grep."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status >= 400 and e.content_type != "application/json":
            return web.json_response({"error": e.reason}, status=e.status, headers=_keep(e))
        raise
    except VersionConflict as e:
        return web.json_response({"error": str(e)}, status=409)
    except StoreError as e:
        return web.json_response({"error": str(e)}, status=400)
    except Exception:  # logged with an id; the client sees only the id
        err = uuid.uuid4().hex[:12]
        log.exception("request %s %s failed (error id %s)", request.method, request.path, err)
        return web.json_response({"error": f"internal error (id {err}); see the orchestrator log"}, status=500)


def _keep(e: web.HTTPException) -> dict[str, str]:
    return {k: v for k, v in e.headers.items() if k.lower() in ("allow", "www-authenticate")}


def limits(max_body_bytes: int, metrics: Metrics):
    @web.middleware
    async def limit(request: web.Request, handler) -> web.StreamResponse:
        metrics.inc("egomem_http_requests_total")
        if request.content_length is not None and request.content_length > max_body_bytes:
            return web.json_response({"error": f"body over {max_body_bytes} bytes (orchestrator.max_body_bytes)"},
                                     status=413)
        return await handler(request)

    return limit


# -- tokens never reach a log ---------------------------------------------------------------------
_NAME = "".join(f"(?:{c}|%{ord(c):02x})" for c in "token")  # also percent-encoded: tok%65n= is token=
_QUERY_TOKEN = re.compile(rf"(?i)((?:^|[?&;\s/])(?:access_)?{_NAME}(?:=|%3d))[^&\s\"'#]+")  # in a request line or URL
_AUTH_HEADER = re.compile(r"(?i)\b(authorization[\"']?\s*[:=]\s*[\"']?)[^\"'\r\n,}]+")  # Authorization: <any scheme>
_BEARER = re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/=-]+")
REDACTED = "[redacted]"
_PLAIN_RECORD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def redact(text: str) -> str:
    """`token=` values and Authorization/Bearer credentials replaced by [redacted]."""
    text = _QUERY_TOKEN.sub(r"\1" + REDACTED, text)
    text = _AUTH_HEADER.sub(r"\1" + REDACTED, text)
    return _BEARER.sub(r"\1" + REDACTED, text)


class RedactTokens(logging.Filter):
    """Rewrites a record in place before any handler formats it: its message, its `extra` fields
    (aiohttp's access log passes the request line there too) and its traceback text."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a broken format string is logged as it is
            return True
        record.msg, record.args = redact(msg), ()
        for k, v in list(vars(record).items()):
            if k in _PLAIN_RECORD:
                continue
            if isinstance(v, str):
                setattr(record, k, redact(v))
            elif isinstance(v, dict):
                setattr(record, k, {kk: redact(vv) if isinstance(vv, str) else vv for kk, vv in v.items()})
        if record.exc_info and not record.exc_text:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        elif record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


REDACT_LOGGERS = ("aiohttp.access", "aiohttp.server", "aiohttp.web", "aiohttp.websocket", "aiohttp.client")


def install_log_redaction() -> None:
    """Filter the aiohttp loggers (the access log names the request line, query included) and every
    handler of the root logger (which all of the orchestrator's own loggers reach). Idempotent."""
    targets: list[logging.Filterer] = [logging.getLogger(n) for n in REDACT_LOGGERS]
    targets += logging.getLogger().handlers
    for t in targets:
        if not any(isinstance(f, RedactTokens) for f in t.filters):
            t.addFilter(RedactTokens())
