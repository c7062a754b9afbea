"""Level-2 retrieval with the real all-MiniLM-L6-v2 embedder: supporting facts and the token budget."""

from __future__ import annotations

import numpy as np
import pytest

from egomem.config import RetrievalConfig
from egomem.identity.errors import InputError, ModelFilesMissing
from egomem.retrieval import Level2Retriever, Neighbour, RetrievalQuery, build_documents, parse_query
from egomem.retrieval.encoder import SentenceEncoder, build_text_encoder

NEIGHBOURS = [
    Neighbour("Alice", "sister", ("plays tennis every Sunday", "is allergic to peanuts", "works as a nurse")),
    Neighbour("Bob", "coworker", ("supports Arsenal football club", "is learning to play the violin")),
    Neighbour("Carol", "mother", ("grows tomatoes in her garden", "her birthday is on the fifth of May")),
    Neighbour("Dan", "friend", ("is a vegetarian who loves Indian curry", "plays chess online at night")),
    Neighbour("Eve", "daughter", ("wants to become an astronaut",)),
]


@pytest.fixture(scope="module")
def encoder() -> SentenceEncoder:
    return build_text_encoder(RetrievalConfig())


@pytest.fixture()
def retriever(encoder: SentenceEncoder) -> Level2Retriever:
    return Level2Retriever(encoder, top_k=3)


def items(hits) -> list[str]:
    return [h.document.item for h in hits]


def test_encoder_gives_unit_384d_vectors(encoder: SentenceEncoder) -> None:
    e = encoder.encode(["plays tennis", "tennis player", "grows tomatoes"])
    assert e.shape == (3, 384) and e.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1, atol=1e-4)
    assert e[0] @ e[1] > e[0] @ e[2]


def test_relation_only(retriever: Level2Retriever) -> None:
    hits = retriever.retrieve(RetrievalQuery(("mother",), ()), NEIGHBOURS)
    assert {h.document.name for h in hits} == {"Carol"} and len(hits) == 2


def test_keyword_only(retriever: Level2Retriever) -> None:
    hits = retriever.retrieve(RetrievalQuery((), ("food allergy",)), NEIGHBOURS)
    assert items(hits)[0] == "is allergic to peanuts"
    hits = retriever.retrieve(RetrievalQuery((), ("music instrument",)), NEIGHBOURS)
    assert items(hits)[0] == "is learning to play the violin"


def test_combined_relation_narrows_keywords(retriever: Level2Retriever) -> None:
    # "plays" matches Alice's tennis and Dan's chess; the relation decides which
    hits = retriever.retrieve(RetrievalQuery(("friend",), ("plays a game",)), NEIGHBOURS)
    assert items(hits)[0] == "plays chess online at night"
    assert {h.document.name for h in hits} == {"Dan"}
    hits = retriever.retrieve(RetrievalQuery(("sister",), ("sport",)), NEIGHBOURS)
    assert items(hits)[0] == "plays tennis every Sunday"


def test_unmatched_relation_falls_back_to_meaning(retriever: Level2Retriever) -> None:
    hits = retriever.retrieve(RetrievalQuery(("mom",), ("birthday",)), NEIGHBOURS)
    assert items(hits)[0] == "her birthday is on the fifth of May"


def test_answer_from_model_text_and_nothing_for_garbage(retriever: Level2Retriever) -> None:
    text = retriever.answer("okay <retr>:\ncoworker\nfootball<answer>", NEIGHBOURS)
    assert text.splitlines()[0] == "Bob (coworker): supports Arsenal football club"
    assert retriever.answer("<retr>:\ncowork", NEIGHBOURS) == ""
    assert retriever.retrieve(parse_query("<answer>"), NEIGHBOURS) == []
    assert retriever.retrieve(RetrievalQuery(("sister",), ("x",)), []) == []


@pytest.mark.parametrize("steps", [40, 80, 256])
def test_token_budget_is_respected(encoder: SentenceEncoder, steps: int) -> None:
    calls = []

    def count(text: str) -> int:  # a word-level tokenizer stand-in, to check the callable is used
        calls.append(text)
        return len(text.encode("utf-8"))

    r = Level2Retriever(encoder, top_k=50, memchunk_steps=steps, count_tokens=count)
    hits = r.retrieve(RetrievalQuery((), ("hobby",)), NEIGHBOURS)
    rendered = "\n".join(h.document.text() for h in hits)
    assert len(rendered.encode()) <= steps and calls
    full = r.rank(RetrievalQuery((), ("hobby",)), build_documents(NEIGHBOURS))
    assert len(hits) < len(full)  # the budget, not top_k, cut the list
    nxt = next(h for h in full if h not in hits)  # the best one left out really did not fit
    assert len(rendered.encode()) + 1 + len(nxt.document.text().encode()) > steps


def test_bm25_only_without_encoder() -> None:
    r = Level2Retriever(None)
    hits = r.retrieve(RetrievalQuery(("daughter",), ("astronaut",)), NEIGHBOURS)
    assert items(hits) == ["wants to become an astronaut"]


def test_bad_inputs_and_missing_paper_model(encoder: SentenceEncoder, tmp_path) -> None:
    with pytest.raises(InputError, match="list of strings"):
        encoder.encode("not a list")
    with pytest.raises(InputError, match="UTF-8"):
        encoder.encode([b"\xff\xfe"])
    with pytest.raises(ModelFilesMissing, match="bge_path"):
        build_text_encoder(RetrievalConfig(text_backend="bge"))
    with pytest.raises(ModelFilesMissing, match="modules.json"):
        build_text_encoder(RetrievalConfig(text_backend="bge", bge_path=tmp_path))


def test_clear_drops_every_cached_document_text(retriever: Level2Retriever) -> None:
    """After a forget the orchestrator clears the caches: no copy of a neighbour's texts stays behind."""
    q = RetrievalQuery(("sister",), ("sport",))
    before = items(retriever.retrieve(q, NEIGHBOURS))
    assert any("Alice" in t for t in retriever._cache) and retriever._bm25_last is not None
    retriever.clear()
    assert retriever._cache == {} and retriever._bm25_last is None
    assert items(retriever.retrieve(q, NEIGHBOURS)) == before  # rebuilt from the documents it is given
