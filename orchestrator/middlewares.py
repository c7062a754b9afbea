"""Middlewares, one concern each: errors (JSON, nothing internal leaks) and limits (body size, counting).
Auth is in auth.py."""

from __future__ import annotations

import logging
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
    except Exception:  # noqa: BLE001 - logged with an id; the client sees only the id
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

