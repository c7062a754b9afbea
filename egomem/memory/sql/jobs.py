"""The job queue and dead letters in a SQL store, both backends (the `JobQueue` interface, jobqueue.py)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from egomem.memory.errors import StoreError
from egomem.memory.sql.base import Conn
from egomem.memory.types import DeadLetter, Job

_JOB_COLS = "job_id, job_key, kind, payload, status, attempts, max_attempts, lease_until, worker, result, error"
_DL_COLS = ("dl_id, source, stage, job_id, session_id, user_id, payload, error, attempts, created_at, "
            "resolved_at, resolution")


class Jobs:
    """Leased jobs (claim, heartbeat, complete, fail, dead) and the dead letters of what kept failing."""

    @staticmethod
    def _job(row: Sequence[Any]) -> Job:
        return Job(row[0], row[1], row[2], json.loads(row[3]) if row[3] else None, row[4], row[5], row[6], row[7],
                   row[8], json.loads(row[9]) if row[9] else None, row[10])

    def enqueue_job(self, kind: str, key: str, payload: dict[str, Any], max_attempts: int | None = None) -> Job:
        now = self._clock()
        with self._write() as c:
            c.execute("INSERT INTO jobs (job_id, job_key, kind, payload, status, attempts, max_attempts, available_at, "
                      "created_at, updated_at) VALUES (?,?,?,?,'queued',0,?,?,?,?) ON CONFLICT (job_key) DO NOTHING",
                      (uuid.uuid4().hex, key, kind, json.dumps(payload, sort_keys=True),
                       max_attempts or self._job_max_attempts, now, now, now))
            return self._job(c.execute(f"SELECT {_JOB_COLS} FROM jobs WHERE job_key = ?", (key,)).fetchone())

    def claim_job(self, worker: str, lease_s: float, kinds: Sequence[str] | None = None) -> Job | None:
        while True:
            now = self._clock()
            with self._write() as c:
                q = (f"SELECT {_JOB_COLS} FROM jobs WHERE ((status = 'queued' AND available_at <= ?) "
                     "OR (status = 'running' AND lease_until < ?))")
                params: list[Any] = [now, now]
                if kinds:
                    q += f" AND kind IN ({','.join('?' * len(kinds))})"
                    params += list(kinds)
                row = c.execute(q + " ORDER BY available_at, created_at LIMIT 1" + self.CLAIM_LOCK, params).fetchone()
                if row is None:
                    return None
                job = self._job(row)
                if job.attempts >= job.max_attempts:  # its last worker died holding it
                    self._kill_job(c, job, job.error or "lease expired on the last attempt (worker died?)")
                    continue
                c.execute("UPDATE jobs SET status = 'running', attempts = attempts + 1, lease_until = ?, worker = ?, "
                          "updated_at = ? WHERE job_id = ?", (now + lease_s, worker, now, job.job_id))
                return self._job(c.execute(f"SELECT {_JOB_COLS} FROM jobs WHERE job_id = ?", (job.job_id,)).fetchone())

    def _kill_job(self, c: Conn, job: Job, error: str) -> None:
        now = self._clock()
        c.execute("UPDATE jobs SET status = 'dead', error = ?, lease_until = NULL, updated_at = ? WHERE job_id = ?",
                  (error, now, job.job_id))
        c.execute(f"INSERT INTO dead_letters ({_DL_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,NULL,NULL)",
                  (uuid.uuid4().hex, "job", job.kind, job.job_id, None, None,
                   json.dumps({"job_key": job.key, "payload": job.payload}, sort_keys=True), error, job.attempts, now))

    def heartbeat_job(self, job_id: str, worker: str, lease_s: float) -> bool:
        with self._write() as c:
            n = c.execute("UPDATE jobs SET lease_until = ? WHERE job_id = ? AND worker = ? AND status = 'running'",
                          (self._clock() + lease_s, job_id, worker)).rowcount
        return n == 1

    def complete_job(self, job_id: str, worker: str, result: dict[str, Any]) -> bool:
        with self._write() as c:
            n = c.execute("UPDATE jobs SET status = 'done', payload = NULL, result = ?, error = NULL, lease_until = NULL, "
                          "updated_at = ? WHERE job_id = ? AND worker = ? AND status = 'running'",
                          (json.dumps(result, sort_keys=True), self._clock(), job_id, worker)).rowcount
        return n == 1

    def fail_job(self, job_id: str, worker: str, error: str, retry_in_s: float) -> Job:
        with self._write() as c:
            row = c.execute(f"SELECT {_JOB_COLS} FROM jobs WHERE job_id = ?{self.ROW_LOCK}", (job_id,)).fetchone()
            if row is None:
                raise StoreError(f"unknown job {job_id!r}")
            job = self._job(row)
            if job.status == "running" and job.worker == worker:
                if job.attempts >= job.max_attempts:
                    self._kill_job(c, job, error)
                else:
                    c.execute("UPDATE jobs SET status = 'queued', available_at = ?, error = ?, lease_until = NULL, "
                              "updated_at = ? WHERE job_id = ?",
                              (self._clock() + retry_in_s, error, self._clock(), job_id))
            return self._job(c.execute(f"SELECT {_JOB_COLS} FROM jobs WHERE job_id = ?", (job_id,)).fetchone())

    def get_job(self, job_id: str) -> Job | None:
        row = self._conn().execute(f"SELECT {_JOB_COLS} FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        return self._job(row) if row else None

    def list_jobs(self, status: str | None = None) -> list[Job]:
        q, params = f"SELECT {_JOB_COLS} FROM jobs", []
        if status:
            q += " WHERE status = ?"
            params.append(status)
        return [self._job(r) for r in self._conn().execute(q + " ORDER BY created_at, job_id", params)]

    def job_counts(self) -> dict[str, int]:
        return dict(self._conn().execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall())

    def dead_letter_count(self, unresolved_only: bool = True) -> int:
        q = "SELECT COUNT(*) FROM dead_letters" + (" WHERE resolved_at IS NULL" if unresolved_only else "")
        return int(self._conn().execute(q).fetchone()[0])

    # ------------------------------------------------------------------ dead letters

    def add_dead_letter(self, source: str, stage: str, payload: dict[str, Any], error: str, attempts: int,
                        job_id: str | None = None, session_id: str | None = None, user_id: str | None = None) -> str:
        dl_id = uuid.uuid4().hex
        with self._write() as c:
            c.execute(f"INSERT INTO dead_letters ({_DL_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,NULL,NULL)",
                      (dl_id, source, stage, job_id, session_id, user_id, json.dumps(payload, sort_keys=True), error,
                       attempts, self._clock()))
        return dl_id

    def dead_letters(self, unresolved_only: bool = True) -> list[DeadLetter]:
        q = f"SELECT {_DL_COLS} FROM dead_letters" + (" WHERE resolved_at IS NULL" if unresolved_only else "")
        rows = self._conn().execute(q + " ORDER BY created_at, dl_id")
        return [DeadLetter(*r[:6], json.loads(r[6]), *r[7:]) for r in rows]

    def resolve_dead_letters(self, resolution: str, dl_id: str | None = None, session_id: str | None = None) -> int:
        if not (dl_id or session_id):
            raise StoreError("resolve_dead_letters needs dl_id or session_id")
        col, val = ("dl_id", dl_id) if dl_id else ("session_id", session_id)
        with self._write() as c:
            return c.execute(f"UPDATE dead_letters SET resolved_at = ?, resolution = ? WHERE {col} = ? "
                             "AND resolved_at IS NULL", (self._clock(), resolution, val)).rowcount

    def requeue_dead_letter(self, dl_id: str) -> Job | None:
        with self._write() as c:
            row = c.execute("SELECT job_id FROM dead_letters WHERE dl_id = ?", (dl_id,)).fetchone()
            if row is None:
                raise StoreError(f"unknown dead letter {dl_id!r}")
            job_id = row[0]
            c.execute("UPDATE dead_letters SET resolved_at = ?, resolution = 'requeued' WHERE dl_id = ?",
                      (self._clock(), dl_id))
            if job_id is None:
                return None
            c.execute("UPDATE jobs SET status = 'queued', attempts = 0, available_at = ?, lease_until = NULL, "
                      "worker = NULL, updated_at = ? WHERE job_id = ? AND status = 'dead'",
                      (self._clock(), self._clock(), job_id))
            return self._job(c.execute(f"SELECT {_JOB_COLS} FROM jobs WHERE job_id = ?", (job_id,)).fetchone())
