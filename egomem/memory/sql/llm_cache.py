"""The LLM answer cache in a SQL store, both backends (the `LLMCache` interface, llmcache.py)."""

from __future__ import annotations

import json
from typing import Any


class LLMAnswers:
    """Answers keyed by prompt hash; the first one stored for a prompt stays."""

    def get_llm_response(self, prompt_hash: str) -> dict[str, Any] | None:
        row = self._conn().execute("SELECT response FROM llm_calls WHERE prompt_hash = ?", (prompt_hash,)).fetchone()
        return json.loads(row[0]) if row else None

    def put_llm_response(self, prompt_hash: str, session_id: str | None, model: str, stage: str,
                         response: dict[str, Any]) -> None:
        with self._write() as c:
            c.execute("INSERT INTO llm_calls (prompt_hash, session_id, model, stage, response, created_at) "
                      "VALUES (?,?,?,?,?,?) ON CONFLICT (prompt_hash) DO NOTHING",
                      (prompt_hash, session_id, model, stage, json.dumps(response, sort_keys=True), self._clock()))
