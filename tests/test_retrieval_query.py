"""The `<retr>:\n<relations>\n<keywords><answer>` parser: well-formed, partial, empty and malformed input."""

from __future__ import annotations

import pytest

from egomem.retrieval.query import RetrievalQuery, parse_query


@pytest.mark.parametrize(
    "text, relations, keywords",
    [
        ("<retr>:\nsister, coworker\ntennis, birthday<answer>", ("sister", "coworker"), ("tennis", "birthday")),
        ("<retr>:\n\ntennis<answer>", (), ("tennis",)),  # relation-only empty
        ("<retr>:\nmother\n<answer>", ("mother",), ()),  # keyword group empty
        ("uh huh <retr>:\r\n Sister ,, SISTER ,\nTennis Club<answer> ok", ("sister",), ("tennis club",)),
        ("<retr>:\n姐姐，同事\n网球<answer>", ("姐姐", "同事"), ("网球",)),  # CJK commas
        ("<retr>:\nold\nold<answer> then <retr>:\nfriend\nchess<answer>", ("friend",), ("chess",)),  # the last one
        ("<retr>:\nbro<ther\nx<answer>", ("bro ther",), ("x",)),  # stray bracket inside is cleaned
    ],
)
def test_parses_groups(text: str, relations: tuple, keywords: tuple) -> None:
    q = parse_query(text)
    assert q == RetrievalQuery(relations, keywords)


@pytest.mark.parametrize(
    "text",
    ["", "hello there", "<retr>:\nsister\ntenn", "<retr>:\n\n<answer>", "<retr>:\n , ,\n ,<answer>",
     "sister\ntennis<answer>", "<answer><retr>:\nsister\n", None, 42, b"<retr>:\nx\ny<answer>"],
)
def test_partial_empty_and_malformed_give_none(text: object) -> None:
    assert parse_query(text) is None


def test_runaway_groups_are_capped() -> None:
    q = parse_query("<retr>:\n" + ",".join(f"r{i}" for i in range(100)) + "\n" + "k" * 500 + "<answer>")
    assert q is not None and len(q.relations) == 16 and len(q.keywords[0]) == 64
