"""The training corpus's plain data: people, relation graphs, dialogs, and where a sample is supervised.

Everything here is JSON-serialisable through `to_json` / `from_json` (docs/training.md#formats):
the corpus JSONL that `egomem eval-dialog --people` accepts is a list of `Household`s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Level = Literal[0, 1, 2]  # 0: general instruction (no memory); 1: profile (L1); 2: relation graph (L2)
SampleKind = Literal["l1_response", "l2_query", "l2_response"]
Split = Literal["train", "heldout"]


@dataclass(frozen=True)
class Profile:
    """One person as the memory store holds them (rendered into L1 by `MemoryStore.render_profile`)."""

    user_id: str
    name: str
    facts: tuple[str, ...] = ()
    preferences: tuple[tuple[str, str], ...] = ()  # (polarity "like" | "dislike", text)
    summary: str = ""


@dataclass(frozen=True)
class Edge:
    """`other` is `main`'s `relation` ("Bob is Ada's sister": main Ada, other Bob, relation "sister")."""

    other: str  # user_id
    relation: str


@dataclass(frozen=True)
class Household:
    """A main user, the 3-5 people related to them, and how (paper §4.1's relation graph)."""

    main: Profile
    related: tuple[Profile, ...]
    edges: tuple[Edge, ...]
    split: Split = "train"

    def person(self, user_id: str) -> Profile:
        for p in (self.main, *self.related):
            if p.user_id == user_id:
                return p
        raise KeyError(f"no person {user_id!r} in household of {self.main.user_id!r}")


@dataclass(frozen=True)
class Query:
    """Ground-truth Level-2 query words (either group may be empty)."""

    relations: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()

    def text(self) -> str:
        """What the model writes on its text channel (docs/architecture.md#level-2-retrieval-query)."""
        return f"<retr>:\n{', '.join(self.relations)}\n{', '.join(self.keywords)}<answer>"


@dataclass(frozen=True)
class Turn:
    """One exchange: the user speaks (may be "" when the model opens, e.g. a greeting), the model replies.

    `query` is set on Level-2 turns: the model first writes `query.text()`, then, once the Level-2
    MemChunk is refilled, speaks `reply`. `facts` are the profile/graph facts the reply must state
    (what the deterministic judge checks); `names` the people it must name.
    """

    user: str
    reply: str
    level: Level = 1
    query: Query | None = None
    names: tuple[str, ...] = ()
    facts: tuple[str, ...] = ()


@dataclass(frozen=True)
class Dialog:
    """A dialog between the model and one user (`user_id`, the person recognised: its L1 profile)."""

    household: str  # main user_id of the household it belongs to
    user_id: str
    level: Level
    turns: tuple[Turn, ...]
    generator: str  # "template:<version>" or "llm:<model>": who wrote it
    split: Split = "train"


@dataclass(frozen=True)
class Span:
    """Half-open dialog-step range [start, end) of a stream (step 0 = the first dialog step, position 768)."""

    start: int
    end: int


@dataclass(frozen=True)
class Sample:
    """One supervised view of a stream: the MemChunk texts in view and the steps whose loss counts.

    `text` / `speak` spans are where the text channel / the speak codebooks are supervised.
    """

    stream: str  # stream id (its tokens live in the dataset's shard, docs/training.md#formats)
    kind: SampleKind
    l1_text: str
    l2_text: str
    text: tuple[Span, ...]
    speak: tuple[Span, ...]
    dialog: int = 0  # index of the supervised dialog inside the stream
    turn: int = 0
    generator: str = ""
    meta: dict[str, Any] = field(default_factory=dict)


def to_json(obj: Any) -> Any:
    """A dataclass tree as plain JSON values (tuples become lists)."""
    return asdict(obj)


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def profile_from_json(d: dict[str, Any]) -> Profile:
    return Profile(d["user_id"], d["name"], tuple(d.get("facts", ())),
                   tuple(tuple(p) for p in d.get("preferences", ())), d.get("summary", ""))


def household_from_json(d: dict[str, Any]) -> Household:
    """Parse one line of the people JSONL (docs/training.md#people-jsonl); KeyError/TypeError on bad input."""
    return Household(profile_from_json(d["main"]), tuple(profile_from_json(p) for p in d["related"]),
                     tuple(Edge(e["other"], e["relation"]) for e in d["edges"]), d.get("split", "train"))


def dialog_from_json(d: dict[str, Any]) -> Dialog:
    turns = tuple(Turn(t["user"], t["reply"], t.get("level", 1),
                       Query(tuple(t["query"]["relations"]), tuple(t["query"]["keywords"])) if t.get("query") else None,
                       _tuples(t.get("names", [])), _tuples(t.get("facts", []))) for t in d["turns"])
    return Dialog(d["household"], d["user_id"], d["level"], turns, d["generator"], d.get("split", "train"))


def sample_from_json(d: dict[str, Any]) -> Sample:
    return Sample(d["stream"], d["kind"], d["l1_text"], d["l2_text"],
                  tuple(Span(**s) for s in d["text"]), tuple(Span(**s) for s in d["speak"]),
                  d.get("dialog", 0), d.get("turn", 0), d.get("generator", ""), d.get("meta", {}))
