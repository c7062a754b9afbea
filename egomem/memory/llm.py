"""The LLM client of the memory agents: any OpenAI-compatible chat endpoint, JSON answers only.

One call = `complete_json(stage, messages, schema)`: the answer must parse as JSON and satisfy
`schema`, else it is retried like a transport error (timeouts, connection errors, 429, 5xx), with
exponential backoff (and the server's Retry-After when it sends one). Client errors (400, 401,
403, 404, 422) are not retried. When every attempt fails the call is parked in the store's
dead-letter table (messages, error, attempts: everything needed to look at it or replay it) and
`LLMFailed` is raised — a failure is never dropped. Successful answers are kept in the store by
prompt hash, so a job re-run after a crash replays the same answer and reaches the same result.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import openai

from egomem.memory.jsonschema import validate
from egomem.memory.store import MemoryStore

log = logging.getLogger(__name__)

_RETRY_STATUS = {408, 409, 425, 429}  # plus every 5xx


class LLMFailed(RuntimeError):
    """Every attempt of an LLM call failed; the call is in the dead-letter table (`dl_id`)."""

    def __init__(self, stage: str, attempts: int, error: str, dl_id: str | None):
        super().__init__(f"LLM {stage} failed after {attempts} attempt(s): {error}"
                         + (f" (dead letter {dl_id})" if dl_id else ""))
        self.stage, self.attempts, self.error, self.dl_id = stage, attempts, error, dl_id


class LLMNotConfigured(RuntimeError):
    """No API key: use the rule-based extractor, or set the key variable named in [llm] api_key_env."""


@dataclass(frozen=True)
class LLMAnswer:
    data: dict[str, Any]
    model: str
    prompt_hash: str
    attempts: int  # 0 when replayed from the store
    cached: bool


def prompt_hash(model: str, messages: list[dict[str, str]], schema: dict[str, Any]) -> str:
    """What the answer depends on: model, messages and the schema it must satisfy."""
    blob = json.dumps({"model": model, "messages": messages, "schema": schema}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _parse_json(content: str | None) -> Any:
    if not content:
        raise ValueError("empty answer")
    text = content.strip()
    m = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", text, flags=re.S)  # some models fence their JSON
    return json.loads(m.group(1) if m else text)


class LLMClient:
    """`complete_json` against `cfg.base_url` / `cfg.model` with the key from $`cfg.api_key_env`."""

    def __init__(self, cfg: Any, store: MemoryStore | None = None, api_key: str | None = None,
                 sleep: Callable[[float], None] = time.sleep):
        key = api_key if api_key is not None else os.environ.get(cfg.api_key_env, "")
        if not key:
            raise LLMNotConfigured(f"no API key in ${cfg.api_key_env}; set it, or use memory.extractor = 'rules'")
        self.cfg, self.store, self._sleep = cfg, store, sleep
        self.model = cfg.model
        self._client = openai.OpenAI(base_url=cfg.base_url, api_key=key, timeout=cfg.timeout_s, max_retries=0)

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        d = min(self.cfg.backoff_max_s, self.cfg.backoff_base_s * 2 ** (attempt - 1))
        d *= 1.0 + 0.25 * random.random()  # jitter: many workers must not retry in lockstep
        if retry_after is not None:
            d = max(d, min(retry_after, self.cfg.backoff_max_s))
        return d

    def complete_json(self, stage: str, messages: list[dict[str, str]], schema: dict[str, Any],
                      session_id: str | None = None, job_id: str | None = None,
                      user_id: str | None = None) -> LLMAnswer:
        h = prompt_hash(self.model, messages, schema)
        if self.store is not None:
            cached = self.store.get_llm_response(h)
            if cached is not None:
                return LLMAnswer(cached, self.model, h, 0, True)
        error, attempt = "", 0
        for attempt in range(1, self.cfg.max_attempts + 1):
            retry_after: float | None = None
            try:
                resp = self._client.chat.completions.create(
                    model=self.model, messages=messages, temperature=self.cfg.temperature,
                    response_format={"type": "json_object"})
                data = _parse_json(resp.choices[0].message.content)
                problem = validate(data, schema)
                if problem:
                    raise ValueError(f"answer does not match the {stage} schema: {problem}")
                if self.store is not None:
                    self.store.put_llm_response(h, session_id, self.model, stage, data)
                if self.store is not None and session_id:  # an earlier try of this session was parked
                    self.store.resolve_dead_letters("succeeded on a later try", session_id=session_id)
                return LLMAnswer(data, self.model, h, attempt, False)
            except (ValueError, json.JSONDecodeError) as e:
                error = f"malformed answer: {e}"
            except openai.APITimeoutError as e:
                error = f"timeout after {self.cfg.timeout_s}s: {e}"
            except openai.APIConnectionError as e:
                error = f"connection error: {e}"
            except openai.APIStatusError as e:
                error = f"HTTP {e.status_code}: {e.message}"
                if e.status_code not in _RETRY_STATUS and e.status_code < 500:
                    break  # the request itself is wrong: retrying cannot help
                with_header = e.response.headers.get("retry-after") if e.response is not None else None
                try:
                    retry_after = float(with_header) if with_header else None
                except ValueError:
                    retry_after = None
            log.warning("LLM %s attempt %d/%d failed: %s", stage, attempt, self.cfg.max_attempts, error)
            if attempt < self.cfg.max_attempts:
                self._sleep(self._backoff(attempt, retry_after))
        dl_id = None
        if self.store is not None:
            dl_id = self.store.add_dead_letter(
                "llm", stage, {"model": self.model, "base_url": self.cfg.base_url, "messages": messages,
                               "prompt_hash": h}, error, attempt, job_id=job_id, session_id=session_id,
                user_id=user_id)  # the user, when known, so forget_user removes it too
        raise LLMFailed(stage, attempt, error, dl_id)
