"""Relation words: how a relation reads from the other side, and the words people use for it.

A stored relation is directed: (Ada, Bob, "mother") says "Bob is Ada's mother". Read from Bob's
side it is "Ada is Bob's child", so Level-2 retrieval for Bob must see Ada as his *child*, never as
his *mother*. `inverse_relation` gives that word; `also_called` the words a user may say for a
relation ("mom" for "mother", "daughter" for "child"), which Level-2 BM25 matches on.

Gendered inverses are not guessed: the other side of "mother" is "child", not "son" or "daughter",
since the store does not know the user's gender. A relation missing from the table becomes, from the
other side, "related (you are their <word>)": it names the edge honestly, and BM25 matches it only
on "related", never on "<word>" as if the neighbour were the user's <word>.
Plain data, no imports: the memory store and retrieval both read it.
"""

from __future__ import annotations

import re

UNKNOWN_INVERSE = "related "  # prefix of the other side of a relation the table does not know

# Symmetric relations: the same word from both sides.
SYMMETRIC = frozenset("""
friend best_friend close_friend old_friend childhood_friend pen_pal classmate schoolmate teammate colleague coworker
co-worker workmate partner business_partner spouse sibling twin cousin neighbour neighbor roommate flatmate
housemate acquaintance relative fiance fiancee companion ally rival bandmate
""".split())

# Directed pairs, both ways: word -> the word from the other side.
_PAIRS = [
    ("parent", "child"), ("mother", "child"), ("father", "child"), ("mom", "child"), ("mum", "child"),
    ("dad", "child"), ("stepmother", "stepchild"), ("stepfather", "stepchild"), ("stepparent", "stepchild"),
    ("son", "parent"), ("daughter", "parent"), ("stepson", "stepparent"), ("stepdaughter", "stepparent"),
    ("grandparent", "grandchild"), ("grandmother", "grandchild"), ("grandfather", "grandchild"),
    ("grandma", "grandchild"), ("grandpa", "grandchild"), ("grandson", "grandparent"),
    ("granddaughter", "grandparent"), ("aunt", "niece or nephew"), ("uncle", "niece or nephew"),
    ("niece", "aunt or uncle"), ("nephew", "aunt or uncle"), ("sister", "sibling"), ("brother", "sibling"),
    ("half-sister", "half-sibling"), ("half-brother", "half-sibling"), ("wife", "spouse"), ("husband", "spouse"),
    ("girlfriend", "partner"), ("boyfriend", "partner"), ("mother-in-law", "child-in-law"),
    ("father-in-law", "child-in-law"), ("son-in-law", "parent-in-law"), ("daughter-in-law", "parent-in-law"),
    ("sister-in-law", "sibling-in-law"), ("brother-in-law", "sibling-in-law"), ("godmother", "godchild"),
    ("godfather", "godchild"), ("godson", "godparent"), ("goddaughter", "godparent"),
    ("boss", "employee"), ("manager", "report"), ("supervisor", "supervisee"), ("employer", "employee"),
    ("teacher", "student"), ("tutor", "student"), ("professor", "student"), ("coach", "trainee"),
    ("mentor", "mentee"), ("doctor", "patient"), ("therapist", "client"), ("lawyer", "client"),
    ("landlord", "tenant"), ("landlady", "tenant"), ("babysitter", "child in their care"), ("nanny", "child in their care"),
    ("guardian", "ward"), ("owner", "pet"),
]
_INVERSE: dict[str, str] = {w: w for w in SYMMETRIC}
for _a, _b in _PAIRS:
    _INVERSE[_a] = _b
    _INVERSE.setdefault(_b, _a)  # child -> parent (the first pair that names it), student -> teacher, ...
del _a, _b
_INVERSE.update({"child": "parent", "stepchild": "stepparent", "grandchild": "grandparent", "godchild": "godparent",
                 "employee": "employer", "student": "teacher", "half-sibling": "half-sibling",
                 "sibling-in-law": "sibling-in-law"})

# Words a user may say for a relation; a document's relation matches any of them.
_GROUPS = {
    "mother": "mom mum mama mommy", "father": "dad daddy papa", "parent": "mother father mom mum dad",
    "child": "son daughter kid", "sibling": "sister brother", "spouse": "wife husband", "partner": "girlfriend boyfriend",
    "grandparent": "grandmother grandfather grandma grandpa", "grandchild": "grandson granddaughter",
    "grandmother": "grandma granny", "grandfather": "grandpa", "colleague": "coworker workmate",
    "coworker": "colleague workmate", "neighbour": "neighbor", "neighbor": "neighbour",
    "boss": "manager employer", "employer": "boss", "niece or nephew": "niece nephew", "aunt or uncle": "aunt uncle",
    "godparent": "godmother godfather", "godchild": "godson goddaughter", "parent-in-law": "mother-in-law father-in-law",
    "child-in-law": "son-in-law daughter-in-law", "sibling-in-law": "sister-in-law brother-in-law",
    "stepparent": "stepmother stepfather", "stepchild": "stepson stepdaughter", "best_friend": "friend",
}


def _norm(word: str) -> str:
    w = " ".join(word.lower().split())
    w = re.sub(r"^(?:my|his|her|their|the)\s+", "", w)
    return w.replace(" ", "_") if w.replace(" ", "_") in _INVERSE else w


def inverse_relation(word: str) -> str:
    """How `word` reads from the other side: inverse_relation("mother") == "child"."""
    w = _norm(word)
    inv = _INVERSE.get(w)
    if inv is None:
        return f"{UNKNOWN_INVERSE}(you are their {word.strip()})"
    return inv.replace("_", " ")


def also_called(word: str) -> str:
    """The relation and the other words a user may say for it, space-separated (for BM25)."""
    if word.startswith(UNKNOWN_INVERSE):
        return "related"
    w = _norm(word)
    return " ".join(filter(None, [word.replace("_", " "), _GROUPS.get(w, "")]))


def vocabulary() -> list[str]:
    """Every relation word the table knows."""
    return sorted(w.replace("_", " ") for w in _INVERSE)
