"""The orchestrator's aiohttp application: `init(cfg) -> web.Application`, and `main` to serve it.

Dependencies point one way: this module builds the app from the routes (ws.py, rest.py), which read
the shared resources (`Services`, under the `SERVICES` app key, both in services.py); nothing imports
this module but `__main__`. The resources are opened and closed by the `services_ctx` cleanup context.
Middlewares, outermost first: errors, limits, auth. Routes: `/api/chat` (ws.py), the REST API (rest.py)
and `/openapi.json`, its description (openapi.py, which reads rest.py's routes).
"""

from __future__ import annotations

import asyncio
import logging
import logging.handlers
import os
import queue
import re
from collections.abc import AsyncIterator

from aiohttp import web

from egomem.config import Config, load_config
from egomem.memory import open_store
from egomem.stack import tokens_path

from .auth import TokenTable, auth_middleware
from .changes import CHANGES, ChangeApplier
from .metrics import Metrics
from .middlewares import errors, install_log_redaction, limits
from .openapi import spec
from .perception import Perception
from .replicas import Replicas
from .rest import routes
from .services import CONFIG, METRICS, SERVICES, Services
from .ws import chat

log = logging.getLogger(__name__)
STREAMS_CLOSE_S = 5.0  # at shutdown, open chats get this long to flush their memory and end their sequences
STORE_CLOSE_WAIT_S = 5.0  # at shutdown, how long store calls still running in worker threads get to return
CHANGE_FEED_READY_S = 10.0  # at start, how long to wait for the change feed to listen before serving anyway


async def services_ctx(app: web.Application) -> AsyncIterator[None]:
    cfg = app[CONFIG]
    oc = cfg.orchestrator
    store = await asyncio.to_thread(open_store, cfg.memory)
    metrics = app[METRICS]
    replicas = await Replicas(cfg, metrics).start()
    perception = None
    if oc.identify_models or oc.retrieval:
        perception = await asyncio.to_thread(Perception, cfg, replicas.client, store, oc.retrieval)
    services = Services(cfg, store, metrics, perception, replicas)
    app[SERVICES] = services
    changes = app[CHANGES] = ChangeApplier(services, asyncio.get_running_loop()).start()  # others' changes
    if not await asyncio.to_thread(changes.feed.ready.wait, CHANGE_FEED_READY_S):
        log.warning("orchestrator: the store's change feed is not listening yet; changes made elsewhere "
                    "reach this process's streams once it is (check memory.dsn and the server)")
    where = cfg.memory.database if cfg.memory.backend == "sqlite" else f"postgres {_dsn_without_password(cfg.memory.dsn)}"
    log.info("orchestrator: Triton at %s (%d of them ready), store %s, %d stream slots",
             ", ".join(r.url for r in replicas.replicas), sum(r.ready for r in replicas.replicas), where, oc.max_streams)
    yield
    services.stop_streams()  # streams end their Triton sequences and flush memory
    await services.closed_streams(STREAMS_CLOSE_S)
    await changes.close()
    if perception is not None:
        perception.close()
    await replicas.close()
    # A task cancelled above (the change applier's heartbeat) cancels its await, not the store call its worker
    # thread is running: give such calls STORE_CLOSE_WAIT_S to return before the store closes its connections
    # under them (closing a SQLite connection in use segfaults). Bounded: a thread that only ends once the store
    # closes must not hold shutdown forever. The loop is ending, so its default executor can go too.
    try:
        await asyncio.wait_for(asyncio.shield(asyncio.get_running_loop().shutdown_default_executor()),
                               STORE_CLOSE_WAIT_S)
    except TimeoutError:
        log.warning("orchestrator: store calls still running after %.0f s; closing the store anyway",
                    STORE_CLOSE_WAIT_S)
    store.close()


async def _close_sockets(app: web.Application) -> None:
    """On shutdown, close open chats so their handlers finish (flushing memory) before resources go."""
    services = app.get(SERVICES)
    if services:
        services.stop_streams()


async def openapi_json(request: web.Request) -> web.Response:
    return web.json_response(spec())


def init(cfg: Config | None = None) -> web.Application:
    cfg = cfg or load_config()
    oc = cfg.orchestrator
    install_log_redaction()  # ?token= values and Authorization headers never reach a log line
    table = TokenTable.load(tokens_path(cfg), os.environ.get(oc.tokens_env))
    metrics = Metrics()
    middlewares = [errors, limits(oc.max_body_bytes, metrics), auth_middleware(table, oc.anonymous_chat)]
    app = web.Application(middlewares=middlewares, client_max_size=oc.max_body_bytes)
    app[CONFIG] = cfg
    app[METRICS] = metrics
    app.cleanup_ctx.append(services_ctx)
    app.on_shutdown.append(_close_sockets)
    app.router.add_get("/api/chat", chat)
    app.add_routes(routes)
    app.router.add_get("/openapi.json", openapi_json)
    return app


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m egomem.orchestrator", description="Run the orchestrator alone "
                                "(tritonserver must be up; `egomem serve` starts everything).")
    p.add_argument("--config", help="TOML config file (default: $EGOMEM_CONFIG, else built-in defaults)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    listener = _log_from_a_thread()
    try:
        cfg = load_config(args.config)
        web.run_app(init(cfg), host=cfg.orchestrator.host, port=cfg.orchestrator.port, print=None)
    finally:
        listener.stop()  # writes what is still queued


def _log_from_a_thread() -> logging.handlers.QueueListener:
    """Records (every request's access-log line among them) are queued by the event loop and written
    by a thread, so a slow disk never stalls a tick. The redaction filter (init) sits on the queue side."""
    root = logging.getLogger()
    q: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    listener = logging.handlers.QueueListener(q, *root.handlers, respect_handler_level=True)
    root.handlers = [logging.handlers.QueueHandler(q)]
    listener.start()
    return listener


def _dsn_without_password(dsn: str) -> str:
    """The DSN as it may be logged: a password in it (URI or key=value form) replaced by ***."""
    return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", re.sub(r"(password\s*=\s*)\S+", r"\1***", dsn))


if __name__ == "__main__":
    main()

