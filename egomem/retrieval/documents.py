"""Level-2 documents: (related user's name, relation, one memory item), built from plain data.

The memory store (issue 5) owns users, relations and facts; the caller hands us the current user's
relation-graph neighbours as `Neighbour`s, so this package depends on nothing but that shape.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Neighbour:
    """A user related to the current user, with what we remember about them."""

    name: str
    relation: str  # how they relate to the current user, e.g. "sister", "coworker"
    items: tuple[str, ...] = field(default_factory=tuple)  # facts, preferences, summary lines


@dataclass(frozen=True)
class Document:
    name: str
    relation: str
    item: str

    def text(self) -> str:
        """How the document reads in the Level-2 MemChunk (and what the re-ranker embeds)."""
        return f"{self.name} ({self.relation}): {self.item}"


def build_documents(neighbours: Iterable[Neighbour]) -> list[Document]:
    """One document per (neighbour, memory item); blank items are skipped, duplicates kept once."""
    docs: list[Document] = []
    seen: set[tuple[str, str, str]] = set()
    for n in neighbours:
        for item in n.items:
            key = (n.name.strip(), n.relation.strip(), " ".join(str(item).split()))
            if key[2] and key not in seen:
                seen.add(key)
                docs.append(Document(*key))
    return docs


def render(docs: Iterable[Document]) -> str:
    """The Level-2 MemChunk text: one document per line."""
    return "\n".join(d.text() for d in docs)
