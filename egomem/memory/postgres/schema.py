"""The memory store's schema on PostgreSQL: tables, the schema version, and forward migrations.

The same tables and columns as SQLite's (egomem/memory/sqlite/schema.py at its version 3; v2 adds its
v4, v3 its v6), typed for PostgreSQL: epoch seconds and scores DOUBLE PRECISION (PostgreSQL's REAL is
4 bytes), BYTEA vectors, an identity op_id. The op log is append-only by a trigger (PL/pgSQL) that refuses UPDATE
and DELETE, except that forget, holding `forget_guard` inside its transaction, may delete a
person's rows and redact the free text (reason, detail) of others'; TRUNCATE is refused outright.
Columns that can hold a person's words or vectors are stored uncompressed (STORAGE EXTERNAL), so the
forget verification's scan of the table files can see them. `MIGRATIONS[v]` takes a database at
version v-1 to version v, each run as one script in the opening transaction. Never edit a released
migration: append a new one.
"""

from __future__ import annotations

_V1 = """
CREATE TABLE users (
    user_id     TEXT PRIMARY KEY,
    name        TEXT NOT NULL,
    created_at  DOUBLE PRECISION NOT NULL,
    updated_at  DOUBLE PRECISION NOT NULL,
    version     BIGINT NOT NULL DEFAULT 0,
    merged_into TEXT
);
CREATE INDEX users_merged_into ON users(merged_into);
CREATE TABLE biometric_keys (
    key_id     TEXT PRIMARY KEY,
    user_id    TEXT NOT NULL REFERENCES users(user_id),
    modality   TEXT NOT NULL CHECK (modality IN ('face', 'voice')),
    model_id   TEXT NOT NULL,
    dim        INTEGER NOT NULL,
    vector     BYTEA NOT NULL,
    session_id TEXT,
    created_at DOUBLE PRECISION NOT NULL
);
CREATE INDEX biometric_keys_user ON biometric_keys(user_id);
CREATE INDEX biometric_keys_model ON biometric_keys(modality, model_id);
CREATE TABLE memory_items (
    item_id       TEXT PRIMARY KEY,
    user_id       TEXT NOT NULL REFERENCES users(user_id),
    kind          TEXT NOT NULL CHECK (kind IN ('fact', 'preference')),
    item_key      TEXT,
    text          TEXT NOT NULL,
    polarity      TEXT CHECK (polarity IN ('like', 'dislike')),
    valid_from    DOUBLE PRECISION NOT NULL,
    invalid_at    DOUBLE PRECISION,
    superseded_by TEXT,
    session_id    TEXT,
    origin        TEXT NOT NULL,
    created_at    DOUBLE PRECISION NOT NULL
);
CREATE INDEX memory_items_user ON memory_items(user_id, kind, invalid_at);
CREATE TABLE summaries (
    summary_id TEXT PRIMARY KEY,
    user_id    TEXT NOT NULL REFERENCES users(user_id),
    session_id TEXT,
    text       TEXT NOT NULL,
    origin     TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL
);
CREATE INDEX summaries_user ON summaries(user_id, created_at);
CREATE TABLE persona (
    user_id    TEXT NOT NULL REFERENCES users(user_id),
    dim        INTEGER NOT NULL CHECK (dim >= 0 AND dim < 90),
    value      DOUBLE PRECISION NOT NULL CHECK (value >= 0 AND value <= 1),
    confidence DOUBLE PRECISION NOT NULL CHECK (confidence >= 0 AND confidence <= 1),
    evidence   TEXT NOT NULL,
    session_id TEXT,
    origin     TEXT NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (user_id, dim)
);
CREATE TABLE relations (
    relation_id   TEXT PRIMARY KEY,
    user_id       TEXT NOT NULL REFERENCES users(user_id),
    other_user_id TEXT NOT NULL REFERENCES users(user_id),
    relation      TEXT NOT NULL,
    valid_from    DOUBLE PRECISION NOT NULL,
    invalid_at    DOUBLE PRECISION,
    session_id    TEXT,
    origin        TEXT NOT NULL,
    created_at    DOUBLE PRECISION NOT NULL
);
CREATE INDEX relations_user ON relations(user_id);
CREATE INDEX relations_other ON relations(other_user_id);
CREATE TABLE sessions (
    session_id        TEXT PRIMARY KEY,
    stream_id         TEXT NOT NULL,
    chunk_index       INTEGER NOT NULL,
    start_step        INTEGER NOT NULL,
    end_step          INTEGER NOT NULL,
    user_id           TEXT REFERENCES users(user_id),
    transcript        TEXT,
    transcript_source TEXT,
    status            TEXT NOT NULL,
    created_at        DOUBLE PRECISION NOT NULL
);
CREATE INDEX sessions_user ON sessions(user_id);
CREATE TABLE llm_calls (
    prompt_hash TEXT PRIMARY KEY,
    session_id  TEXT,
    model       TEXT NOT NULL,
    stage       TEXT NOT NULL,
    response    TEXT NOT NULL,
    created_at  DOUBLE PRECISION NOT NULL
);
CREATE INDEX llm_calls_session ON llm_calls(session_id);
CREATE TABLE jobs (
    job_id       TEXT PRIMARY KEY,
    job_key      TEXT NOT NULL UNIQUE,
    kind         TEXT NOT NULL,
    payload      TEXT,
    status       TEXT NOT NULL CHECK (status IN ('queued', 'running', 'done', 'dead')),
    attempts     INTEGER NOT NULL DEFAULT 0,
    max_attempts INTEGER NOT NULL,
    available_at DOUBLE PRECISION NOT NULL,
    lease_until  DOUBLE PRECISION,
    worker       TEXT,
    result       TEXT,
    error        TEXT,
    created_at   DOUBLE PRECISION NOT NULL,
    updated_at   DOUBLE PRECISION NOT NULL,
    redactions   INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX jobs_ready ON jobs(status, available_at);
CREATE TABLE dead_letters (
    dl_id       TEXT PRIMARY KEY,
    source      TEXT NOT NULL CHECK (source IN ('llm', 'job')),
    stage       TEXT NOT NULL,
    job_id      TEXT,
    session_id  TEXT,
    user_id     TEXT,
    payload     TEXT NOT NULL,
    error       TEXT NOT NULL,
    attempts    INTEGER NOT NULL,
    created_at  DOUBLE PRECISION NOT NULL,
    resolved_at DOUBLE PRECISION,
    resolution  TEXT
);
CREATE TABLE op_log (
    op_id           BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    ts              DOUBLE PRECISION NOT NULL,
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
CREATE INDEX op_log_user ON op_log(user_id);
CREATE INDEX op_log_related ON op_log(related_user_id);
CREATE TABLE forget_guard (active INTEGER NOT NULL);
CREATE FUNCTION op_log_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        RAISE EXCEPTION 'op_log is append-only; it cannot be truncated';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM forget_guard) THEN
        IF TG_OP = 'DELETE' THEN
            RAISE EXCEPTION 'op_log is append-only; only forget(user) may remove rows';
        END IF;
        RAISE EXCEPTION 'op_log is append-only; only forget(user) may redact reason/detail';
    END IF;
    IF TG_OP = 'DELETE' THEN
        RETURN OLD;
    END IF;
    IF (NEW.op_id, NEW.ts, NEW.op, NEW.actor, NEW.user_id, NEW.related_user_id, NEW.target, NEW.session_id,
        NEW.llm_model, NEW.prompt_hash) IS DISTINCT FROM
       (OLD.op_id, OLD.ts, OLD.op, OLD.actor, OLD.user_id, OLD.related_user_id, OLD.target, OLD.session_id,
        OLD.llm_model, OLD.prompt_hash) THEN
        RAISE EXCEPTION 'op_log is append-only; only forget(user) may redact reason/detail';
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER op_log_no_change BEFORE UPDATE OR DELETE ON op_log
    FOR EACH ROW EXECUTE FUNCTION op_log_append_only();
CREATE TRIGGER op_log_no_truncate BEFORE TRUNCATE ON op_log
    FOR EACH STATEMENT EXECUTE FUNCTION op_log_append_only();
CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO meta (name, value) VALUES ('keys_generation', '0');
ALTER TABLE biometric_keys ALTER COLUMN vector SET STORAGE EXTERNAL;
ALTER TABLE memory_items ALTER COLUMN text SET STORAGE EXTERNAL;
ALTER TABLE summaries ALTER COLUMN text SET STORAGE EXTERNAL;
ALTER TABLE persona ALTER COLUMN evidence SET STORAGE EXTERNAL;
ALTER TABLE sessions ALTER COLUMN transcript SET STORAGE EXTERNAL;
ALTER TABLE llm_calls ALTER COLUMN response SET STORAGE EXTERNAL;
ALTER TABLE jobs ALTER COLUMN payload SET STORAGE EXTERNAL;
ALTER TABLE jobs ALTER COLUMN result SET STORAGE EXTERNAL;
ALTER TABLE dead_letters ALTER COLUMN payload SET STORAGE EXTERNAL;
ALTER TABLE op_log ALTER COLUMN reason SET STORAGE EXTERNAL;
ALTER TABLE op_log ALTER COLUMN detail SET STORAGE EXTERNAL;
"""

# v2: incremental key sync, as SQLite's v4 (egomem/memory/sqlite/schema.py says how readers use it).
_V2 = """
ALTER TABLE biometric_keys ADD COLUMN added_generation BIGINT NOT NULL DEFAULT 0;
CREATE INDEX biometric_keys_added ON biometric_keys(added_generation);
INSERT INTO meta (name, value) SELECT 'keys_removed_generation', value FROM meta WHERE name = 'keys_generation';
"""

# v3: the two-phase forget, as SQLite's v6 (egomem/memory/sqlite/schema.py says what each table holds).
_V3 = """
CREATE TABLE orchestrators (
    origin       TEXT PRIMARY KEY,
    label        TEXT NOT NULL,
    started_at   DOUBLE PRECISION NOT NULL,
    heartbeat_at DOUBLE PRECISION NOT NULL
);
CREATE TABLE forget_prepares (
    request_id TEXT PRIMARY KEY,
    user_id    TEXT NOT NULL,
    origin     TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL
);
CREATE INDEX forget_prepares_user ON forget_prepares(user_id);
CREATE TABLE forget_acks (
    request_id TEXT NOT NULL,
    origin     TEXT NOT NULL,
    acked_at   DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (request_id, origin)
);
"""

# version -> the script taking the database from version-1 to version.
MIGRATIONS: dict[int, str] = {1: _V1, 2: _V2, 3: _V3}
SCHEMA_VERSION = max(MIGRATIONS)
