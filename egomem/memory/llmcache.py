"""LLM answers, kept so a retried job replays them and reaches the same result (an interface;
`MemoryStore` backends implement it). Keyed by the hash of the prompt; forget deletes a
session's answers with the session."""

from __future__ import annotations

import abc
from typing import Any


class LLMCache(abc.ABC):
    @abc.abstractmethod
    def get_llm_response(self, prompt_hash: str) -> dict[str, Any] | None: ...
    @abc.abstractmethod
    def put_llm_response(self, prompt_hash: str, session_id: str | None, model: str, stage: str,
                         response: dict[str, Any]) -> None: ...
