"""Relations read correctly from both sides: an edge stored by one user ("Bob is Ada's mother")
reaches Level-2 retrieval and the Level-1 profile of the other (Bob) inverted ("Ada: child"),
through the real SQLite store and the real Level-2 retriever (BM25 + all-MiniLM-L6-v2)."""

from __future__ import annotations

import pytest

from egomem.config import RetrievalConfig
from egomem.memory.sqlite import SQLiteMemoryStore
from egomem.relations import also_called, inverse_relation, vocabulary
from egomem.retrieval import Level2Retriever, Neighbour, RetrievalQuery
from egomem.retrieval.encoder import build_text_encoder


@pytest.fixture(scope="module")
def retriever() -> Level2Retriever:
    return Level2Retriever(build_text_encoder(RetrievalConfig()), top_k=4)


@pytest.fixture()
def family(tmp_path):
    """Ada says Bob is her mother and Cleo her friend; each has facts of their own."""
    s = SQLiteMemoryStore(tmp_path / "m.sqlite3")
    ada, bob, cleo = s.create_user("Ada"), s.create_user("Bob"), s.create_user("Cleo")
    s.add_fact(ada.user_id, "plays tennis on Sundays")
    s.add_fact(bob.user_id, "bakes sourdough bread")
    s.add_fact(cleo.user_id, "collects vinyl records")
    s.add_relation(ada.user_id, bob.user_id, "mother")
    s.add_relation(ada.user_id, cleo.user_id, "friend")
    yield s, ada.user_id, bob.user_id, cleo.user_id
    s.close()


def neighbours(store: SQLiteMemoryStore, user_id: str) -> list[Neighbour]:
    """What the orchestrator hands the retriever (orchestrator/perception.py `retrieve`)."""
    return [Neighbour(n.name, n.relation, tuple(n.items)) for n in store.neighbour_memories(user_id)]


def test_the_vocabulary_reads_both_ways():
    assert len(vocabulary()) >= 100
    assert inverse_relation("mother") == "child" and inverse_relation("child") == "parent"
    assert inverse_relation("My Sister") == "sibling" and inverse_relation("friend") == "friend"
    assert inverse_relation("boss") == "employee" and inverse_relation("employee") == "employer"
    assert inverse_relation("wife") == "spouse" and inverse_relation("grandson") == "grandparent"
    unknown = inverse_relation("bandleader")
    assert "bandleader" in unknown and also_called(unknown) == "related"  # never matches "bandleader" as if it were one
    assert "mom" in also_called("mother").split() and "daughter" in also_called("child").split()


def test_each_side_sees_the_edge_in_its_own_words(family):
    s, ada, bob, cleo = family
    assert sorted((n.name, n.relation, n.inverse) for n in s.neighbour_memories(ada)) == [
        ("Bob", "mother", False), ("Cleo", "friend", False)]
    assert [(n.name, n.relation, n.inverse) for n in s.neighbour_memories(bob)] == [("Ada", "child", True)]
    assert [(n.name, n.relation, n.inverse) for n in s.neighbour_memories(cleo)] == [("Ada", "friend", True)]
    # the Level-1 profile lists the edge from each side too
    people = next(ln for ln in s.render_profile(ada).splitlines() if ln.startswith("people: "))
    assert sorted(people.removeprefix("people: ").split("; ")) == ["Bob (mother)", "Cleo (friend)"]
    assert "people: Ada (child)" in s.render_profile(bob)


def test_retrieval_from_the_childs_side(family, retriever):
    s, ada, bob, cleo = family
    hits = retriever.retrieve(RetrievalQuery(("mom",), ("hobby",)), neighbours(s, ada))  # "mom" finds "mother"
    assert hits and hits[0].document.name == "Bob" and hits[0].document.item == "bakes sourdough bread"
    assert hits[0].document.text() == "Bob (mother): bakes sourdough bread"


def test_retrieval_from_the_mothers_side(family, retriever):
    s, ada, bob, cleo = family
    hits = retriever.retrieve(RetrievalQuery(("daughter",), ("sport",)), neighbours(s, bob))
    assert [h.document.text() for h in hits] == ["Ada (child): plays tennis on Sundays"]
    # asked about *his* mother, Bob's memory holds no one: Ada is never presented as his mother
    texts = [h.document.text() for h in retriever.retrieve(RetrievalQuery(("mother",), ()), neighbours(s, bob))]
    assert not any("(mother)" in t for t in texts)
