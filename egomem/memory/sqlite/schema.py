"""The memory store's schema: tables, the schema version, and forward migrations.

The DDL is SQLite's but kept to what PostgreSQL also accepts with type renames (TEXT ids, REAL
epoch seconds, BLOB -> BYTEA, INTEGER PRIMARY KEY -> BIGSERIAL); the Postgres backend keeps its own
copy of these statements. `MIGRATIONS[v]` takes a database at version v-1 to version v; opening a
store runs the missing ones in order inside one transaction, so a crash mid-migration leaves the
old version intact. Never edit a released migration: append a new one.
"""

from __future__ import annotations

_V1 = """
CREATE TABLE users (
    user_id     TEXT PRIMARY KEY,
    name        TEXT NOT NULL,            -- 'unknown_user' until a name is learnt
    created_at  REAL NOT NULL,
    updated_at  REAL NOT NULL,
    version     INTEGER NOT NULL DEFAULT 0,  -- bumped by every write for this user (optimistic lock)
    merged_into TEXT                      -- set when merged away: a tombstone that resolves old ids
);
CREATE TABLE biometric_keys (
    key_id     TEXT PRIMARY KEY,
    user_id    TEXT NOT NULL REFERENCES users(user_id),
    modality   TEXT NOT NULL CHECK (modality IN ('face', 'voice')),
    model_id   TEXT NOT NULL,             -- which encoder made the vector (keys of different models never mix)
    dim        INTEGER NOT NULL,
    vector     BLOB NOT NULL,             -- float32 little-endian, L2-normalised
    session_id TEXT,
    created_at REAL NOT NULL
);
CREATE INDEX biometric_keys_user ON biometric_keys(user_id);
CREATE INDEX biometric_keys_model ON biometric_keys(modality, model_id);
CREATE TABLE memory_items (                -- facts and preferences; superseded, never overwritten
    item_id       TEXT PRIMARY KEY,
    user_id       TEXT NOT NULL REFERENCES users(user_id),
    kind          TEXT NOT NULL CHECK (kind IN ('fact', 'preference')),
    item_key      TEXT,                   -- attribute a conflict is judged on (e.g. 'lives_in'), or NULL
    text          TEXT NOT NULL,
    polarity      TEXT CHECK (polarity IN ('like', 'dislike')),  -- preferences only
    valid_from    REAL NOT NULL,
    invalid_at    REAL,                   -- NULL = current
    superseded_by TEXT,
    session_id    TEXT,
    origin        TEXT NOT NULL,          -- 'llm:<model>', 'rule_fallback', 'manual'
    created_at    REAL NOT NULL
);
CREATE INDEX memory_items_user ON memory_items(user_id, kind, invalid_at);
CREATE TABLE summaries (
    summary_id TEXT PRIMARY KEY,
    user_id    TEXT NOT NULL REFERENCES users(user_id),
    session_id TEXT,
    text       TEXT NOT NULL,
    origin     TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE INDEX summaries_user ON summaries(user_id, created_at);
CREATE TABLE persona (
    user_id    TEXT NOT NULL REFERENCES users(user_id),
    dim        INTEGER NOT NULL CHECK (dim >= 0 AND dim < 90),
    value      REAL NOT NULL CHECK (value >= 0 AND value <= 1),
    confidence REAL NOT NULL CHECK (confidence >= 0 AND confidence <= 1),
    evidence   TEXT NOT NULL,
    session_id TEXT,
    origin     TEXT NOT NULL,
    updated_at REAL NOT NULL,
    PRIMARY KEY (user_id, dim)
);
CREATE TABLE relations (                   -- (user) --relation--> (other_user): "other is user's <relation>"
    relation_id   TEXT PRIMARY KEY,
    user_id       TEXT NOT NULL REFERENCES users(user_id),
    other_user_id TEXT NOT NULL REFERENCES users(user_id),
    relation      TEXT NOT NULL,
    valid_from    REAL NOT NULL,
    invalid_at    REAL,
    session_id    TEXT,
    origin        TEXT NOT NULL,
    created_at    REAL NOT NULL
);
CREATE INDEX relations_user ON relations(user_id);
CREATE INDEX relations_other ON relations(other_user_id);
CREATE TABLE sessions (
    session_id        TEXT PRIMARY KEY,       -- hash of (stream, chunk, start, end): the idempotency key
    stream_id         TEXT NOT NULL,
    chunk_index       INTEGER NOT NULL,
    start_step        INTEGER NOT NULL,
    end_step          INTEGER NOT NULL,
    user_id           TEXT REFERENCES users(user_id),
    transcript        TEXT,
    transcript_source TEXT,                   -- 'asr:<model>' or 'client+monologue'
    status            TEXT NOT NULL,          -- 'done'
    created_at        REAL NOT NULL
);
CREATE INDEX sessions_user ON sessions(user_id);
CREATE TABLE llm_calls (                   -- every successful LLM answer, so a re-run replays it exactly
    prompt_hash TEXT PRIMARY KEY,
    session_id  TEXT,
    model       TEXT NOT NULL,
    stage       TEXT NOT NULL,
    response    TEXT NOT NULL,
    created_at  REAL NOT NULL
);
CREATE INDEX llm_calls_session ON llm_calls(session_id);
CREATE TABLE jobs (
    job_id       TEXT PRIMARY KEY,
    job_key      TEXT NOT NULL UNIQUE,     -- idempotency: enqueueing the same key twice is one job
    kind         TEXT NOT NULL,
    payload      TEXT,                     -- JSON; dropped once done (it may reference user audio)
    status       TEXT NOT NULL CHECK (status IN ('queued', 'running', 'done', 'dead')),
    attempts     INTEGER NOT NULL DEFAULT 0,
    max_attempts INTEGER NOT NULL,
    available_at REAL NOT NULL,
    lease_until  REAL,
    worker       TEXT,
    result       TEXT,
    error        TEXT,
    created_at   REAL NOT NULL,
    updated_at   REAL NOT NULL
);
CREATE INDEX jobs_ready ON jobs(status, available_at);
CREATE TABLE dead_letters (
    dl_id       TEXT PRIMARY KEY,
    source      TEXT NOT NULL CHECK (source IN ('llm', 'job')),
    stage       TEXT NOT NULL,             -- 'extract', 'update', 'transcribe', or the job kind
    job_id      TEXT,
    session_id  TEXT,
    user_id     TEXT,
    payload     TEXT NOT NULL,             -- JSON: what is needed to look at or replay it
    error       TEXT NOT NULL,
    attempts    INTEGER NOT NULL,
    created_at  REAL NOT NULL,
    resolved_at REAL,
    resolution  TEXT
);
CREATE TABLE op_log (                      -- append-only (triggers below); forget removes a user's rows
    op_id           INTEGER PRIMARY KEY,
    ts              REAL NOT NULL,
    op              TEXT NOT NULL,
    actor           TEXT NOT NULL,
    user_id         TEXT,
    related_user_id TEXT,
    target          TEXT,                  -- '<table>:<id>'
    session_id      TEXT,
    llm_model       TEXT,
    prompt_hash     TEXT,
    reason          TEXT,
    detail          TEXT                   -- JSON
);
CREATE INDEX op_log_user ON op_log(user_id);
CREATE INDEX op_log_related ON op_log(related_user_id);
CREATE TABLE forget_guard (active INTEGER NOT NULL);
CREATE TRIGGER op_log_no_update BEFORE UPDATE ON op_log
BEGIN SELECT RAISE(ABORT, 'op_log is append-only'); END;
CREATE TRIGGER op_log_no_delete BEFORE DELETE ON op_log
WHEN NOT EXISTS (SELECT 1 FROM forget_guard)
BEGIN SELECT RAISE(ABORT, 'op_log is append-only; only forget(user) may remove rows'); END;
CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO meta (name, value) VALUES ('keys_generation', '0');
"""

# v2: forget redacts the forgotten person's name from other users' op-log rows. UPDATE stays refused,
# except while forget holds `forget_guard`, and then only of the free-text columns `reason` and `detail`.
_V2 = """
DROP TRIGGER op_log_no_update;
CREATE TRIGGER op_log_no_update BEFORE UPDATE ON op_log
WHEN NOT EXISTS (SELECT 1 FROM forget_guard)
  OR NEW.op_id IS NOT OLD.op_id OR NEW.ts IS NOT OLD.ts OR NEW.op IS NOT OLD.op OR NEW.actor IS NOT OLD.actor
  OR NEW.user_id IS NOT OLD.user_id OR NEW.related_user_id IS NOT OLD.related_user_id
  OR NEW.target IS NOT OLD.target OR NEW.session_id IS NOT OLD.session_id OR NEW.llm_model IS NOT OLD.llm_model
  OR NEW.prompt_hash IS NOT OLD.prompt_hash
BEGIN SELECT RAISE(ABORT, 'op_log is append-only; only forget(user) may redact reason/detail'); END;
"""

# v3: forget rewrites the chunk files of jobs still to run (memory/chunk.py `redact_chunk`) and counts
# it here; a session read from the chunk before that rewrite is refused at commit (`ChunkRedacted`).
_V3 = """
ALTER TABLE jobs ADD COLUMN redactions INTEGER NOT NULL DEFAULT 0;
"""

# v4: incremental key sync (egomem/identity/store_backed.py). Each key records the keys_generation
# its insert produced; keys_removed_generation is the generation of the last removal or move of keys
# (forget, merge). A reader at generation g adds the keys with added_generation > g, and rebuilds
# when keys_removed_generation > g. Keys from before v4 read as generation 0 (a fresh reader rebuilds).
_V4 = """
ALTER TABLE biometric_keys ADD COLUMN added_generation INTEGER NOT NULL DEFAULT 0;
CREATE INDEX biometric_keys_added ON biometric_keys(added_generation);
INSERT INTO meta (name, value) SELECT 'keys_removed_generation', value FROM meta WHERE name = 'keys_generation';
"""

# v5: op-log ids are never reused. With a plain INTEGER PRIMARY KEY SQLite hands out max(op_id) + 1,
# so when forget deletes the newest rows their ids come back, and a reader following the log "after
# the last id seen" (egomem/memory/changes.py) would skip the rows that reuse them. AUTOINCREMENT keeps
# the high-water mark in sqlite_sequence (as PostgreSQL's identity column does). SQLite cannot add it
# in place: the table is rebuilt (DROP TABLE fires no DELETE trigger) with its indexes and v2 triggers.
_V5 = """
CREATE TABLE op_log_v5 (
    op_id           INTEGER PRIMARY KEY AUTOINCREMENT,
    ts              REAL NOT NULL,
    op              TEXT NOT NULL,
    actor           TEXT NOT NULL,
    user_id         TEXT,
    related_user_id TEXT,
    target          TEXT,
    session_id      TEXT,
    llm_model       TEXT,
    prompt_hash     TEXT,
    reason          TEXT,
    detail          TEXT
);
INSERT INTO op_log_v5 SELECT op_id, ts, op, actor, user_id, related_user_id, target, session_id, llm_model,
    prompt_hash, reason, detail FROM op_log ORDER BY op_id;
DROP TABLE op_log;
ALTER TABLE op_log_v5 RENAME TO op_log;
CREATE INDEX op_log_user ON op_log(user_id);
CREATE INDEX op_log_related ON op_log(related_user_id);
CREATE TRIGGER op_log_no_update BEFORE UPDATE ON op_log
WHEN NOT EXISTS (SELECT 1 FROM forget_guard)
  OR NEW.op_id IS NOT OLD.op_id OR NEW.ts IS NOT OLD.ts OR NEW.op IS NOT OLD.op OR NEW.actor IS NOT OLD.actor
  OR NEW.user_id IS NOT OLD.user_id OR NEW.related_user_id IS NOT OLD.related_user_id
  OR NEW.target IS NOT OLD.target OR NEW.session_id IS NOT OLD.session_id OR NEW.llm_model IS NOT OLD.llm_model
  OR NEW.prompt_hash IS NOT OLD.prompt_hash
BEGIN SELECT RAISE(ABORT, 'op_log is append-only; only forget(user) may redact reason/detail'); END;
CREATE TRIGGER op_log_no_delete BEFORE DELETE ON op_log
WHEN NOT EXISTS (SELECT 1 FROM forget_guard)
BEGIN SELECT RAISE(ABORT, 'op_log is append-only; only forget(user) may remove rows'); END;
"""

# v6: the two-phase forget (egomem/memory/sql/coordination.py). `orchestrators`: the live orchestrators
# (a heartbeat each); `forget_prepares`: forgets announced and not yet done (the user id, so forget deletes
# the row); `forget_acks`: which orchestrator has redacted its recordings for which announcement (no user id).
_V6 = """
CREATE TABLE orchestrators (
    origin       TEXT PRIMARY KEY,         -- the orchestrator's store object id (changes.py new_origin)
    label        TEXT NOT NULL,            -- host:port, for the operator reading an unacknowledged forget
    started_at   REAL NOT NULL,
    heartbeat_at REAL NOT NULL
);
CREATE TABLE forget_prepares (
    request_id TEXT PRIMARY KEY,
    user_id    TEXT NOT NULL,
    origin     TEXT NOT NULL,              -- the orchestrator that forgets
    created_at REAL NOT NULL
);
CREATE INDEX forget_prepares_user ON forget_prepares(user_id);
CREATE TABLE forget_acks (
    request_id TEXT NOT NULL,
    origin     TEXT NOT NULL,
    acked_at   REAL NOT NULL,
    PRIMARY KEY (request_id, origin)
);
"""

# version -> statements taking the database from version-1 to version.
MIGRATIONS: dict[int, str] = {1: _V1, 2: _V2, 3: _V3, 4: _V4, 5: _V5, 6: _V6}
SCHEMA_VERSION = max(MIGRATIONS)
