"""PostgreSQL backend of `MemoryStore` (egomem/memory/store.py): storage only, psycopg 3.

connection.py  connections, transactions, locks, migrations (schema.py)
forget.py      PostgreSQL's half of forget: VACUUM FULL, redaction of text cells, the cell and file scans

The rest is the SQL both backends share (egomem/memory/sql/): the op log and row helpers, people,
items, sessions (commit_session), forget, the two-phase forget's coordination (coordination.py), jobs
(claimed FOR UPDATE SKIP LOCKED), LLM answers.
`memory.backend = "postgres"` with `memory.dsn` selects it (factory.py `open_store`).
"""

from __future__ import annotations

from egomem.memory.postgres.connection import Connections
from egomem.memory.postgres.forget import PostgresForget
from egomem.memory.sql.coordination import ForgetCoordination
from egomem.memory.sql.items import Items
from egomem.memory.sql.jobs import Jobs
from egomem.memory.sql.llm_cache import LLMAnswers
from egomem.memory.sql.people import People
from egomem.memory.sql.sessions import Sessions
from egomem.memory.store import MemoryStore


class PostgresMemoryStore(Sessions, PostgresForget, ForgetCoordination, People, Items, Jobs, LLMAnswers, Connections,
                          MemoryStore):
    """`PostgresMemoryStore(dsn, busy_timeout_s=30, job_max_attempts=5, clock=time.time,
    forget_face_distance=0.30, forget_voice_distance=0.35)`: see connection.py for the arguments."""


__all__ = ["PostgresMemoryStore"]
