"""The SQL both backends of `MemoryStore` run (SQLite: egomem/memory/sqlite/, PostgreSQL:
egomem/memory/postgres/), written once with `?` placeholders in the SQL the two databases share.

base.py       the connection shape, row helpers, the op log, the locking hooks
people.py     users, rename, merge, name history, biometric keys
items.py      facts, preferences, summaries, persona, relations, the profile snapshot
sessions.py   session rows; commit_session on the primitives (the rules: memory/commit.py)
forget.py     forget, redaction of queued chunks, verify_forgotten (the backend scrubs and scans)
coordination.py  the two-phase forget: orchestrator registry, forget announcements, acknowledgements
jobs.py       the job queue and dead letters (memory/jobqueue.py `JobQueue`)
llm_cache.py  LLM answers (memory/llmcache.py `LLMCache`)

A backend adds connections, transactions, migrations and the forget hooks.
"""
