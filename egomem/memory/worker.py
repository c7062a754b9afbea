"""The memory worker: claims stream-chunk jobs from the durable queue and runs the memory manager.

`egomem serve` starts `run_worker(cfg, stop_event)` in a thread or process (or run it alone:
`python -m egomem.memory.worker --config FILE`). Several workers may share one database (SQLite:
processes on one machine; several machines need the PostgreSQL backend): a job is leased to one
worker, and a worker that dies loses its lease, so another picks the job up and re-runs it.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import threading
import traceback
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from egomem.memory.agents import LLMExtractor, LLMUpdateAgent
from egomem.memory.chunk import JOB_KIND, STEP_S, StreamChunk
from egomem.memory.factory import open_store
from egomem.memory.identify import Identifier
from egomem.memory.llm import LLMClient
from egomem.memory.manager import MemoryManager
from egomem.memory.rules import RuleExtractor, RuleUpdateAgent
from egomem.memory.segment import TriggerLabeler
from egomem.memory.store import MemoryStore
from egomem.memory.transcribe import Transcriber
from egomem.memory.types import Job

if TYPE_CHECKING:
    from egomem.trigger.identity_split import SplitRule

log = logging.getLogger(__name__)


def use_llm(cfg: Any) -> bool:
    """memory.extractor: 'llm' requires the key, 'rules' never calls out, 'auto' uses the key if it is set."""
    mode = cfg.memory.extractor
    has_key = bool(os.environ.get(cfg.llm.api_key_env))
    if mode == "llm" and not has_key:
        raise RuntimeError(f"memory.extractor = 'llm' but ${cfg.llm.api_key_env} is empty; set the key or use 'auto'")
    return mode == "llm" or (mode == "auto" and has_key)


def default_labeler(cfg: Any) -> TriggerLabeler:
    """The trained episodic trigger of `egomem.trigger` (in-process, config [trigger])."""
    try:
        from egomem.trigger.labeler import TriggerLabeler as Trained
    except ImportError as e:
        raise RuntimeError("no episodic trigger to cut sessions: pass labeler= (any object with "
                           "label(tokens [T, 17]) -> labels [T]) or install egomem.trigger") from e
    return Trained(cfg.trigger)


def build_manager(cfg: Any, store: MemoryStore, labeler: TriggerLabeler | None = None,
                  identifier: Identifier | None = None) -> MemoryManager:
    if use_llm(cfg):
        client = LLMClient(cfg.llm, store)
        extractor: Any = LLMExtractor(client)
        updater: Any = LLMUpdateAgent(client)
    else:
        log.warning("memory manager: using the rule-based extractor (offline fallback): memory.extractor = %r, "
                    "$%s %s", cfg.memory.extractor, cfg.llm.api_key_env,
                    "set" if os.environ.get(cfg.llm.api_key_env) else "empty")
        extractor, updater = RuleExtractor(), RuleUpdateAgent()
    return MemoryManager(
        store, labeler or default_labeler(cfg), identifier or default_identifier(cfg, store),
        extractor, updater, Transcriber(cfg.asr, cfg.llm), cfg.trigger.max_chunk_steps,
        split_rule=split_rule(cfg) if cfg.trigger.identity_split else None)


def default_identifier(cfg: Any, store: MemoryStore) -> Identifier:
    """The live streams' identifier (`egomem.identity`, thresholds and model ids of `[identity]`), over
    this store's keys: the worker and the orchestrator decide who someone is by one rule."""
    from egomem.identity.store_backed import StoreBackedIdentifier

    return StoreBackedIdentifier(store, cfg.identity)


def split_rule(cfg: Any) -> SplitRule:
    """The identity split's thresholds: those of the configured identification models ([identity]),
    voice scores s-normed with the same cohort; the voice window of the orchestrator's polls."""
    from egomem.identity.errors import ModelFilesMissing
    from egomem.identity.identify import VOICE_MODEL_IDS
    from egomem.identity.snorm import AdaptiveSNorm, default_cohort_file
    from egomem.trigger.identity_split import SplitRule

    i = cfg.identity
    face = i.face_threshold_dlib if i.face_backend == "dlib" else i.face_threshold_deepface
    voice = i.voice_threshold_resemblyzer if i.voice_backend == "resemblyzer" else i.voice_threshold_wavlm
    try:
        snorm = AdaptiveSNorm.from_file(i.cohort_file or default_cohort_file(VOICE_MODEL_IDS[i.voice_backend]),
                                        i.cohort_top_k, i.cohort_size)
    except ModelFilesMissing as e:
        raise ModelFilesMissing(f"{e} (the memory manager's identity split scores voices with it; "
                                "or set trigger.identity_split = false)") from e
    return SplitRule(face, voice, snorm, min_polls=cfg.trigger.split_min_polls,
                     window_steps=int(round(cfg.orchestrator.identify_window_s / STEP_S)))


class LeaseLost(RuntimeError):
    """This worker's lease on its job lapsed and another worker holds the job now: stop, commit nothing."""


class LeaseKeeper:
    """Keeps this worker's lease on the job it runs: renews it every third of `lease_s` from a thread,
    so a long step (an LLM call, the trigger over a long chunk) never lets it lapse while the worker
    lives, and a dead worker's job is free again within one lease. `check()` renews it on the spot
    and raises LeaseLost when another worker has taken the job (the manager calls it before each commit)."""

    def __init__(self, store: MemoryStore, worker_id: str, lease_s: float):
        if not lease_s > 0:
            raise ValueError(f"memory.job_lease_s = {lease_s!r}: must be > 0 seconds")
        self.store, self.worker_id, self.lease_s = store, worker_id, float(lease_s)
        self._job_id: str | None = None
        self._lost = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"lease-{worker_id}", daemon=True)
        self._thread.start()

    def hold(self, job_id: str) -> None:
        with self._cond:
            self._job_id, self._lost = job_id, False
            self._cond.notify_all()

    def release(self) -> None:
        with self._cond:
            self._job_id = None

    def check(self) -> None:
        """Renew the lease now; raise LeaseLost if the job is no longer ours."""
        with self._cond:
            job_id, lost = self._job_id, self._lost
        if job_id is None:
            return
        if lost or not self.store.heartbeat_job(job_id, self.worker_id, self.lease_s):
            with self._cond:
                self._lost = True
            raise LeaseLost(f"job {job_id}: the lease of worker {self.worker_id} lapsed and another worker "
                            "took the job; stopping without committing")

    def close(self) -> None:
        with self._cond:
            self._closed, self._job_id = True, None
            self._cond.notify_all()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait(self.lease_s / 3)
                if self._closed:
                    return
                job_id = None if self._lost else self._job_id
            if job_id is None:
                continue
            try:
                ok = self.store.heartbeat_job(job_id, self.worker_id, self.lease_s)
            except Exception as e:  # noqa: BLE001 — a busy database: try again at the next beat
                log.warning("job %s: lease renewal failed (%s); retrying", job_id, e)
                continue
            if not ok:
                with self._cond:
                    if self._job_id == job_id:
                        self._lost = True
                log.warning("job %s: worker %s lost its lease (it was silent over %.0f s); it stops before "
                            "its next commit", job_id, self.worker_id, self.lease_s)


def process_next_job(manager: MemoryManager, cfg: Any, worker_id: str,
                     lease: LeaseKeeper | None = None) -> Job | None:
    """Claim one job, run it, complete or fail it. Returns the job as it ends, None if the queue is empty.
    `lease` renews the job's lease while it runs (run_worker keeps one; default: one for this call)."""
    store, m = manager.store, cfg.memory
    job = store.claim_job(worker_id, m.job_lease_s, kinds=[JOB_KIND])
    if job is None:
        return None
    own_lease = lease is None
    lease = lease or LeaseKeeper(store, worker_id, m.job_lease_s)
    lease.hold(job.job_id)
    folder = Path((job.payload or {}).get("chunk_dir", ""))
    try:
        chunk = StreamChunk.load(folder)
        outcomes = manager.process_chunk(chunk, job.job_id, before_commit=lease.check)
        result = {"sessions": [{"session_id": o.session_id, "start": o.start_step, "end": o.end_step,
                                "status": o.status} for o in outcomes]}
        lease.release()
        if store.complete_job(job.job_id, worker_id, result) and not m.keep_chunks:
            shutil.rmtree(folder, ignore_errors=True)
    except LeaseLost as e:
        log.warning("%s", e)  # the job is the new holder's now: nothing to record
    except Exception as e:  # noqa: BLE001 — any failure is recorded on the job and retried, never lost
        delay = m.job_retry_base_s * 2 ** (job.attempts - 1)
        log.error("job %s attempt %d failed: %s", job.job_id, job.attempts, e)
        store.fail_job(job.job_id, worker_id, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=5)}", delay)
    finally:
        lease.release()
        if own_lease:
            lease.close()
    return store.get_job(job.job_id)


def run_worker(cfg: Any, stop_event: threading.Event, labeler: TriggerLabeler | None = None,
               identifier: Identifier | None = None, store: MemoryStore | None = None,
               worker_id: str | None = None) -> None:
    """Process jobs until `stop_event` is set (the current job finishes first)."""
    own = store is None
    store = store or open_store(cfg.memory)
    worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
    manager = build_manager(cfg, store, labeler, identifier)
    lease = LeaseKeeper(store, worker_id, cfg.memory.job_lease_s)
    log.info("memory worker %s started on %s", worker_id, getattr(store, "path", "store"))
    try:
        while not stop_event.is_set():
            if process_next_job(manager, cfg, worker_id, lease) is None:
                stop_event.wait(cfg.memory.worker_poll_s)
    finally:
        lease.close()
        if own:
            store.close()


def main(argv: list[str] | None = None) -> None:
    import argparse
    import signal

    from egomem.config import load_config

    ap = argparse.ArgumentParser(description="Run the memory worker until SIGINT / SIGTERM.")
    ap.add_argument("--config", default=None, help="TOML config (default: $EGOMEM_CONFIG, else built-in defaults)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    run_worker(load_config(args.config), stop)


if __name__ == "__main__":
    main()
