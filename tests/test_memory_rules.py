"""The offline rule-based extractor: what it understands (the table in egomem/memory/rules.py),
on varied phrasings, and that it never invents a fact the words do not state."""

from __future__ import annotations

import pytest

from egomem.memory.rules import RuleExtractor


def extract(*lines: str):
    transcript = "\n".join(f"USER (client transcript): {ln}" for ln in lines)
    return RuleExtractor().extract(transcript, None, "session")[0]


@pytest.mark.parametrize("said, name", [
    ("Hi, my name is Ada.", "Ada"), ("My name is Bruno Silva.", "Bruno Silva"), ("my name's Chloe.", "Chloe"),
    ("Call me Dave.", "Dave"), ("I'm Erin and I like tea.", "Erin"), ("I am Farid.", "Farid"),
    ("Jana here, how are you.", "Jana"), ("Hello! My name is Anne-Marie.", "Anne-Marie"),
])
def test_names(said, name):
    assert extract(said).name == name


@pytest.mark.parametrize("said, fact", [
    ("I live in Lisbon.", ("lives_in", "lives in Lisbon")), ("I'm living in New York now.", ("lives_in", "lives in New York")),
    ("I moved to Porto last year.", ("lives_in", "lives in Porto")), ("I'm based in Oslo.", ("lives_in", "lives in Oslo")),
    ("My home is in Cork.", ("lives_in", "lives in Cork")), ("I'm from Spain.", ("from", "is from Spain")),
    ("I come from Kenya.", ("from", "is from Kenya")), ("I work as a chef.", ("occupation", "works as chef")),
    ("I'm a software engineer.", ("occupation", "works as software engineer")),
    ("My job is nursing.", ("occupation", "works as nursing")), ("I work at Siemens.", ("workplace", "works at Siemens")),
    ("I work for the city council.", ("workplace", "works at the city council")),
    ("I'm 34 years old.", ("age", "is 34 years old")), ("I study physics.", ("studies", "studies physics")),
    ("I'm studying medicine.", ("studies", "studies medicine")), ("I have a dog.", (None, "has a dog")),
    ("I've got an old bike.", (None, "has an old bike")),
])
def test_facts(said, fact):
    assert extract(said).facts == [fact]


@pytest.mark.parametrize("said, prefs", [
    ("I love tennis.", [("tennis", "like")]), ("I really like jazz.", [("jazz", "like")]),
    ("I enjoy hiking.", [("hiking", "like")]), ("I adore cats.", [("cats", "like")]),
    ("I'm into anime.", [("anime", "like")]), ("I'm a big fan of Arsenal.", [("Arsenal", "like")]),
    ("My favourite food is sushi.", [("sushi", "like")]), ("I don't like opera.", [("opera", "dislike")]),
    ("I do not like rain.", [("rain", "dislike")]), ("I hate traffic.", [("traffic", "dislike")]),
    ("I can't stand loud music.", [("loud music", "dislike")]), ("I'm not a fan of horror films.", [("horror films", "dislike")]),
    ("I like football but I hate rugby.", [("football", "like"), ("rugby", "dislike")]),
])
def test_preferences(said, prefs):
    assert extract(said).preferences == prefs


@pytest.mark.parametrize("said, rel", [
    ("My sister is called Marta.", ("Marta", "sister")), ("My sister Marta lives in Rome.", ("Marta", "sister")),
    ("My brother's name is Leo.", ("Leo", "brother")), ("My mom's name is Rita.", ("Rita", "mom")),
    ("Tom is my best friend.", ("Tom", "friend")), ("My colleague, Priya, is great.", ("Priya", "colleague")),
    ("My boss Ingrid is strict.", ("Ingrid", "boss")), ("Sam is my cousin.", ("Sam", "cousin")),
])
def test_relations(said, rel):
    assert extract(said).relations == [rel]


@pytest.mark.parametrize("said", [
    "Do you like jazz?", "Where do I live?", "I don't live in Paris.", "I'm not from Spain.",
    "I used to live in Berlin.", "I'd love to live in Rome.", "I would like a dog.", "I want to study law.",
    "My sister loves jazz.", "My brother lives in Rome.", "If I lived in Tokyo I would be happy.",
    "I never liked sushi.", "I'm tired.", "I'm sorry.", "I'm going to move to Madrid.",
])
def test_nothing_the_words_do_not_state(said):
    ex = extract(said)
    assert (ex.name, ex.facts, ex.preferences) == (None, [], []), said


def test_only_user_lines_count_and_the_readme_example():
    ex = RuleExtractor().extract("ASSISTANT (inner monologue): my name is Moshi. I live in the cloud.\n"
                                 "USER (client transcript): Hi, my name is Ada. I love tennis and I live in Lisbon.",
                                 None, "s")[0]
    assert ex.name == "Ada" and ex.facts == [("lives_in", "lives in Lisbon")] and ex.preferences == [("tennis", "like")]


def test_a_recognisers_lower_case_names_after_a_naming_cue():
    """PocketSphinx writes 'my name is ada': the word after an explicit naming cue is a name; nothing
    else of a recogniser's line is capitalised, and a client's own text is read as written."""
    ex = RuleExtractor().extract("USER (asr:pocketsphinx): hi my name is ada i live in lisbon and my sister is "
                                 "called marta", None, "s")[0]
    assert ex.name == "Ada" and ex.relations == [("Marta", "sister")] and ex.facts == [("lives_in", "lives in lisbon")]
    assert RuleExtractor().extract("USER (client transcript): my name is ada", None, "s")[0].name is None
