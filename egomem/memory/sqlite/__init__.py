"""SQLite backend of `MemoryStore` (egomem/memory/store.py): storage only, one module per concern.

connection.py  connections, transactions, migrations (schema.py), the op log
people.py      users, rename, merge, name history, biometric keys
items.py       facts, preferences, summaries, persona, relations, the profile snapshot
sessions.py    session rows; commit_session on SQLite's primitives (the rules: memory/commit.py)
forget.py      forget, redaction of others' rows and queued chunks, verify_forgotten
jobs.py        the job queue and dead letters (memory/jobqueue.py `JobQueue`)
llm_cache.py   LLM answers (memory/llmcache.py `LLMCache`)
"""

from __future__ import annotations

from egomem.memory.sqlite.connection import Connections
from egomem.memory.sqlite.forget import Forget
from egomem.memory.sqlite.items import Items
from egomem.memory.sqlite.jobs import Jobs
from egomem.memory.sqlite.llm_cache import LLMAnswers
from egomem.memory.sqlite.people import People
from egomem.memory.sqlite.sessions import Sessions
from egomem.memory.store import MemoryStore


class SQLiteMemoryStore(Sessions, Forget, People, Items, Jobs, LLMAnswers, Connections, MemoryStore):
    """`SQLiteMemoryStore(path, busy_timeout_s=30, synchronous='FULL', job_max_attempts=5, clock=time.time,
    forget_face_distance=0.30, forget_voice_distance=0.35)`: see connection.py for the arguments."""


__all__ = ["SQLiteMemoryStore"]
