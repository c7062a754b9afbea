"""The durable job queue and its dead letters (an interface; `MemoryStore` backends implement it).

A job is leased to one worker at a time (`claim_job`, kept alive by `heartbeat_job`); a worker that
dies loses its lease and another takes the job over. A job that keeps failing becomes 'dead' with a
dead letter that an operator resolves or requeues.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

from egomem.memory.types import DeadLetter, Job


class JobQueue(abc.ABC):
    # ---- jobs ----
    @abc.abstractmethod
    def enqueue_job(self, kind: str, key: str, payload: dict[str, Any], max_attempts: int | None = None) -> Job:
        """Idempotent by `key`: enqueueing an existing key returns the existing job unchanged."""
    @abc.abstractmethod
    def claim_job(self, worker: str, lease_s: float, kinds: Sequence[str] | None = None) -> Job | None:
        """Take the oldest ready job (or one whose lease expired: its worker died)."""
    @abc.abstractmethod
    def heartbeat_job(self, job_id: str, worker: str, lease_s: float) -> bool: ...
    @abc.abstractmethod
    def complete_job(self, job_id: str, worker: str, result: dict[str, Any]) -> bool:
        """False when the lease was lost (another worker owns the job now)."""
    @abc.abstractmethod
    def fail_job(self, job_id: str, worker: str, error: str, retry_in_s: float) -> Job:
        """Re-queue after `retry_in_s`, or once attempts are used up: status 'dead' + a dead letter."""
    @abc.abstractmethod
    def get_job(self, job_id: str) -> Job | None: ...
    @abc.abstractmethod
    def list_jobs(self, status: str | None = None) -> list[Job]: ...
    @abc.abstractmethod
    def job_counts(self) -> dict[str, int]:
        """{status: number of jobs}, counted by the database (for /metrics: no rows are loaded)."""
    @abc.abstractmethod
    def dead_letter_count(self, unresolved_only: bool = True) -> int: ...

    # ---- dead letters ----
    @abc.abstractmethod
    def add_dead_letter(self, source: str, stage: str, payload: dict[str, Any], error: str, attempts: int,
                        job_id: str | None = None, session_id: str | None = None,
                        user_id: str | None = None) -> str: ...
    @abc.abstractmethod
    def dead_letters(self, unresolved_only: bool = True) -> list[DeadLetter]: ...
    @abc.abstractmethod
    def resolve_dead_letters(self, resolution: str, dl_id: str | None = None, session_id: str | None = None) -> int: ...
    @abc.abstractmethod
    def requeue_dead_letter(self, dl_id: str) -> Job | None:
        """Put a dead job back in the queue (attempts reset) and mark the letter resolved."""
