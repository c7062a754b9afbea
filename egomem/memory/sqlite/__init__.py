"""SQLite backend of `MemoryStore` (egomem/memory/store.py): storage only.

connection.py  connections, transactions, migrations (schema.py)
forget.py      SQLite's half of forget: VACUUM + WAL truncation, redaction in SQL, the file scan

The rest is shared with the PostgreSQL backend (egomem/memory/sql/): the op log and row helpers
(base.py), people.py, items.py, sessions.py (commit_session; its rules: memory/commit.py), forget.py,
coordination.py (the two-phase forget), jobs.py (memory/jobqueue.py `JobQueue`), llm_cache.py
(memory/llmcache.py `LLMCache`).
"""

from __future__ import annotations

from egomem.memory.sql.coordination import ForgetCoordination
from egomem.memory.sql.items import Items
from egomem.memory.sql.jobs import Jobs
from egomem.memory.sql.llm_cache import LLMAnswers
from egomem.memory.sql.people import People
from egomem.memory.sql.sessions import Sessions
from egomem.memory.sqlite.connection import Connections
from egomem.memory.sqlite.forget import SQLiteForget
from egomem.memory.store import MemoryStore


class SQLiteMemoryStore(Sessions, SQLiteForget, ForgetCoordination, People, Items, Jobs, LLMAnswers, Connections,
                        MemoryStore):
    """`SQLiteMemoryStore(path, busy_timeout_s=30, synchronous='FULL', job_max_attempts=5, clock=time.time,
    forget_face_distance=0.30, forget_voice_distance=0.35)`: see connection.py for the arguments."""


__all__ = ["SQLiteMemoryStore"]
