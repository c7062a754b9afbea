"""Shared helpers for the memory tests: a labeler test double, hand-made stream chunks whose
sessions, transcript lines and face/voice polls the test chooses, and `StoreBackend` (the store
tests run on SQLite and on PostgreSQL)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from egomem.memory.chunk import StreamChunk
from egomem.memory.segment import spans_to_labels

T = 160  # steps per test chunk (12.8 s)


class ColumnLabeler:
    """Test double for the trigger model: the test writes each step's label into the text-token column."""

    def label(self, tokens: np.ndarray) -> np.ndarray:
        return tokens[:, 0] % 4


def unit(seed: int, d: int = 128) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(d).astype(np.float32)
    return v / np.linalg.norm(v)


def near(v: np.ndarray, seed: int) -> np.ndarray:
    """Another sighting of the same face: a little noise."""
    return v + 0.05 * unit(seed + 1000, v.shape[0])


FACE_Z, VOICE_Z, FACE_B = unit(1), unit(2, 256), unit(3)


def make_chunk(stream: str, index: int, sessions: list[dict], audio: bool = False) -> StreamChunk:
    """sessions: dicts with span=(start, end), user=[(step, text)], face=vec|None, voice=vec|None and
    optionally monologue=[(step, text)]; `audio` adds a constant listen channel (user audio to redact)."""
    tokens = np.random.default_rng(index).integers(0, 2048, size=(T, 17))
    tokens[:, 0] = spans_to_labels([s["span"] for s in sessions], T)  # the labeler test double reads these
    chunk = StreamChunk(stream, index, 1000.0 + index * T * 0.08, tokens,
                        listen_audio=np.full(T * 1920, 0.25, np.float32) if audio else None)
    for k, s in enumerate(sessions):
        a, b = s["span"]
        chunk.client_transcript += s["user"]
        chunk.monologue += s.get("monologue", [(a + 2, "Nice to talk to you.")])
        for j, step in enumerate(range(a + 5, b, 10)):
            if s.get("face") is not None:
                chunk.faces.append((step, near(s["face"], 10 * index + j + 100 * k)))
            if s.get("voice") is not None:
                chunk.voices.append((step, near(s["voice"], 10 * index + j + 100 * k)))
    return chunk


class StoreBackend:
    """One backend the store tests run on (the `backend` fixture, conftest.py): opens stores on this
    test's own database (the same one on every call, so a reopen is a restart) and reads what only
    the backend can tell (its driver's error class, a table's columns, the raw bytes of its files).

    sqlite: `<tmp_path>/<db>.db`; postgres: database `<prefix>_<db>` on the session's pgserver."""

    def __init__(self, name: str, tmp_path: Path, server_uri: str | None = None, prefix: str = ""):
        self.name, self._tmp, self._uri, self._prefix = name, tmp_path, server_uri, prefix
        self._made: list[str] = []
        if name == "sqlite":
            import sqlite3

            from egomem.memory.sqlite import SQLiteMemoryStore
            from egomem.memory.sqlite import connection as module

            self.store_class, self.connection_module, self.db_error = SQLiteMemoryStore, module, sqlite3.DatabaseError
        else:
            import psycopg

            from egomem.memory.postgres import PostgresMemoryStore
            from egomem.memory.postgres import connection as module

            self.store_class, self.connection_module, self.db_error = PostgresMemoryStore, module, psycopg.Error

    def target(self, db: str = "m") -> str:
        """The path (sqlite) or DSN (postgres) of database `db`, created empty on first use."""
        if self.name == "sqlite":
            return str(self._tmp / f"{db}.db")
        name = f"{self._prefix}_{db}"
        if name not in self._made:
            self._admin(f'CREATE DATABASE "{name}"')
            self._made.append(name)
        return self._uri.replace("/postgres?", f"/{name}?", 1)

    def open(self, db: str = "m", **kw: Any) -> Any:
        """A store on database `db`; keywords as the store takes them (sqlite-only ones are dropped for postgres)."""
        if self.name == "postgres":
            kw.pop("synchronous", None)
        return self.store_class(self.target(db), **kw)

    def configure(self, cfg: Any, db: str = "m") -> Any:
        """Point `cfg.memory` at database `db` of this backend."""
        cfg.memory.backend = self.name
        if self.name == "sqlite":
            cfg.memory.database = Path(self.target(db))
        else:
            cfg.memory.dsn = self.target(db)
        return cfg

    def columns(self, store: Any, table: str) -> list[str]:
        if self.name == "sqlite":
            return [r[1] for r in store._conn().execute(f"PRAGMA table_info({table})")]
        return [r[0] for r in store._conn().execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = ?", (table,))]

    def raw_bytes(self, store: Any, db: str = "m") -> bytes:
        """Every byte of the store's files (sqlite: the database, WAL, shm; postgres: its tables'
        files, after a CHECKPOINT); closes the store."""
        if self.name == "sqlite":
            store.close()
            path = Path(self.target(db))
            return b"".join(p.read_bytes() for p in path.parent.iterdir() if p.name.startswith(path.name))
        c = store._conn()
        c.execute("CHECKPOINT")
        files = store._data_files(c)
        assert files, "the test server's data files should be readable"
        raw = b"".join(f.read_bytes() for f in files)
        store.close()
        return raw

    def drop(self) -> None:
        for name in self._made:
            self._admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def _admin(self, sql: str) -> None:
        import psycopg

        with psycopg.connect(self._uri, autocommit=True) as c:
            c.execute(sql)
