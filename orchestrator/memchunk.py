"""What one stream's dialog model is told about the person in front of it: who that is (`user_id`,
set by identification, cleared by a forget) and the MemChunk refreshes waiting for the next tick
(level 1: the user's rendered profile; level 2: facts retrieved for a query)."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

from egomem.dialog.memchunk_text import fit


@dataclass
class Refresh:
    level: int  # 1 profile, 2 retrieved facts
    text: str
    user_id: str | None
    asked_at: float
    restart: bool = False  # restart the dialog stream with this L1 (`[dialog] new_person = "restart"`)


class MemChunk:
    def __init__(self, l1_steps: int):
        self.l1_steps = l1_steps  # MemChunk steps a profile may fill
        self.user_id: str | None = None  # who the stream personalises for; None: nobody (yet)
        self._waiting: collections.deque[Refresh] = collections.deque()

    def request(self, level: int, text: str, user_id: str | None, restart: bool = False) -> None:
        if level == 1:  # a new L1 resets L2 to text pad in the engine: drop any L2 still waiting
            self._waiting = collections.deque(r for r in self._waiting if r.level != 2)
        self._waiting.append(Refresh(level, text, user_id, time.monotonic(), restart))

    def profile(self, text: str, user_id: str, restart: bool = False) -> None:
        """An L1 refresh with `user_id`'s rendered profile, cut to what the MemChunk holds; `restart`: the
        dialog stream starts afresh with it (a new conversation for a new person)."""
        self.request(1, fit(text, self.l1_steps), user_id, restart)

    def take(self) -> Refresh | None:
        """The refresh to apply with this tick's dialog step, if one is waiting."""
        return self._waiting.popleft() if self._waiting else None

