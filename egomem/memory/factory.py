"""`open_store(cfg)`: the backend named by `MemoryConfig` (kept apart from the interface in
store.py, so the interface never imports a backend and a backend imports only the interface)."""

from __future__ import annotations

from typing import Any

from egomem.memory.errors import StoreError
from egomem.memory.sqlite import SQLiteMemoryStore
from egomem.memory.store import MemoryStore


def open_store(cfg: Any) -> MemoryStore:
    """The store named by `MemoryConfig`: `cfg.backend` "sqlite" (`cfg.database`, the default) or
    "postgres" (`cfg.dsn`; psycopg is imported only then)."""
    backend = getattr(cfg, "backend", "sqlite")
    common = dict(busy_timeout_s=getattr(cfg, "busy_timeout_s", 30.0),
                  job_max_attempts=getattr(cfg, "job_max_attempts", 5),
                  forget_face_distance=getattr(cfg, "forget_face_distance", 0.30),
                  forget_voice_distance=getattr(cfg, "forget_voice_distance", 0.35))
    if backend == "sqlite":
        return SQLiteMemoryStore(cfg.database, synchronous=getattr(cfg, "synchronous", "FULL"), **common)
    if backend == "postgres":
        from egomem.memory.postgres import PostgresMemoryStore

        return PostgresMemoryStore(getattr(cfg, "dsn", ""), **common)
    raise StoreError(f"memory.backend = {backend!r} is not a backend; use 'sqlite' or 'postgres'")
