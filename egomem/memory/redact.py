"""Redacting a forgotten person's name from the memories that stay (other users' rows).

`forget_user` deletes the person's own rows; their *mentions* ("my colleague Bob Smith ...") sit in
other users' transcripts, summaries, facts, persona evidence, op-log reasons and LLM payloads.
Those cells get every occurrence of the name replaced by `MARKER`, so the memory stays readable
("my colleague [forgotten person] ...") and nothing names the person any more. The names are all
the person ever had (the store's `name_history`: earlier names set by PATCH or learnt from a
session, names of users merged into them), not only the current one. The same rule redacts the
text of memory chunks still waiting for the worker (memory/chunk.py `redact_pieces`).

What counts as an occurrence (`name_pattern`):
- the full stored name, case-insensitive, whole words only ("Bob Smith" matches "bob smith's" but
  not "Bob Smithson"), with any run of whitespace between its words ("Bob\\nSmith");
- inside JSON text (op-log detail, LLM answers, dead-letter payloads) the strings are matched after
  decoding, so a name stored escaped ("Zo\\u00eb") is found too, and the JSON stays valid;
- a *part* of a multi-word name is not redacted: "Bob" alone is too ambiguous (another Bob, a
  word) to remove blindly. A one-word stored name is the full name and is redacted everywhere,
  which may also hit another person of that name: forget errs on the side of forgetting.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from egomem.memory.types import UNKNOWN_USER

MARKER = "[forgotten person]"


def name_pattern(names: Iterable[str]) -> re.Pattern[str] | None:
    """One pattern matching any of `names` (see the module docstring); None when none is a real name."""
    alts = []
    for name in sorted({" ".join(n.split()) for n in names}, key=len, reverse=True):  # longest first
        if name and name.lower() != UNKNOWN_USER:
            alts.append(r"\s+".join(re.escape(w) for w in name.split()))
    if not alts:
        return None
    return re.compile(r"(?<!\w)(?:" + "|".join(alts) + r")(?!\w)", re.IGNORECASE)


def _walk(obj: Any, pat: re.Pattern[str]) -> Any:
    if isinstance(obj, str):
        return pat.sub(MARKER, obj)
    if isinstance(obj, list):
        return [_walk(v, pat) for v in obj]
    if isinstance(obj, dict):
        return {_walk(k, pat): _walk(v, pat) for k, v in obj.items()}
    return obj


def redact(value: Any, pat: re.Pattern[str]) -> Any:
    """`value` with every occurrence replaced by MARKER; non-text values come back unchanged.
    JSON objects/arrays are redacted string by string and re-encoded as the store writes them
    (`sort_keys=True`, ASCII escapes)."""
    if not isinstance(value, str):
        return value
    if value[:1] in "{[":
        try:
            obj = json.loads(value)
        except ValueError:
            pass
        else:
            new = _walk(obj, pat)
            return value if new == obj else json.dumps(new, sort_keys=True)
    return pat.sub(MARKER, value)


def mentions(value: Any, pat: re.Pattern[str]) -> bool:
    """Whether `value` still names the person (plain or inside JSON strings)."""
    return isinstance(value, str) and redact(value, pat) != value
