"""Parse the dialog model's memory query from its text channel.

The model writes `<retr>:\\n<relation words>\\n<keywords><answer>` (docs/architecture.md#level-2-retrieval-query): two lines of
comma-separated groups, the first naming relations ("sister, coworker"), the second keywords
("tennis, birthday"); either may be empty. The text channel is a noisy token stream, so the parser
never raises: a partial query (no `<answer>` yet), an empty one or garbage gives `None`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

OPEN = "<retr>"
CLOSE = "<answer>"
MAX_ITEMS = 16  # per group: more is a runaway generation, not a query
MAX_ITEM_CHARS = 64  # a relation or keyword phrase longer than this is cut
_SPLIT = re.compile(r"[,，;；、|]")  # ASCII and CJK commas/semicolons
_CLEAN = re.compile(r"[\x00-\x1f<>\"`]+")  # control chars and stray tag brackets


@dataclass(frozen=True)
class RetrievalQuery:
    relations: tuple[str, ...]
    keywords: tuple[str, ...]

    def __bool__(self) -> bool:
        return bool(self.relations or self.keywords)


def _group(line: str) -> tuple[str, ...]:
    out: list[str] = []
    for part in _SPLIT.split(line):
        item = " ".join(_CLEAN.sub(" ", part).split())[:MAX_ITEM_CHARS].strip().lower()
        if item and item not in out:
            out.append(item)
        if len(out) == MAX_ITEMS:
            break
    return tuple(out)


def parse_query(text: str, max_chars: int = 2000) -> RetrievalQuery | None:
    """The last complete query in `text`, or None (no query, unfinished, or empty). Never raises."""
    try:
        if not isinstance(text, str):
            return None
        text = text[-max_chars:]
        end = text.rfind(CLOSE)
        if end < 0:
            return None  # still being written
        start = text.rfind(OPEN, 0, end)
        if start < 0:
            return None
        body = text[start + len(OPEN):end]
        body = body[1:] if body.startswith(":") else body
        lines = body.replace("\r\n", "\n").split("\n")
        if lines and not lines[0].strip():
            lines = lines[1:]  # the newline right after "<retr>:"
        relations = _group(lines[0]) if len(lines) >= 1 else ()
        keywords = _group(" , ".join(lines[1:])) if len(lines) >= 2 else ()
        q = RetrievalQuery(relations, keywords)
        return q if q else None
    except Exception:  # noqa: BLE001 - the dialog loop must never see a parser error
        return None
