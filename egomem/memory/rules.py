"""The offline fallback agents: deterministic rules instead of an LLM.

They run when no LLM key is configured, so the stack works end to end without a network. They
read only the USER lines of a transcript (never the model's monologue) and recognise plain
first-person English statements. What they understand, per sentence (case-insensitive cue words;
names must be capitalised):

| what            | phrasings                                                                          | stored as                  |
|-----------------|------------------------------------------------------------------------------------|----------------------------|
| name            | my name is X; call me X; I'm X / I am X (X capitalised, not an -ing word); X here   | the user's name            |
| home            | I live in X; I'm living in X; I moved to X; I'm based in X; my home is in X          | fact lives_in "lives in X" |
| origin          | I'm from X; I am from X; I come from X                                              | fact from "is from X"      |
| work            | I work as (a) X; I'm a(n) <occupation>; my job is X                                | fact occupation            |
| workplace       | I work at X; I work for X                                                          | fact workplace             |
| age             | I'm N years old; I am N years old                                                  | fact age                   |
| studies         | I study X; I'm studying X                                                          | fact studies               |
| possessions     | I have a(n) X; I've got a(n) X                                                     | fact "has a X"             |
| likes           | I (really/also/absolutely) like / love / enjoy / adore X; I'm into X; I'm a (big) fan of X; my favourite ... is X | preference like |
| dislikes        | I don't / do not like X; I hate X; I dislike X; I can't stand X; I'm not a fan of X | preference dislike         |
| relations       | my <relation> X; my <relation> is called / is named / 's name is X; X is my <relation> (relation words: `egomem.relations`) | relation (X, relation) |

A speech recogniser's line ('USER (asr:...)') comes in lower case: there the word after an explicit
naming cue ("my name is", "call me", "is called", "is named", "'s name is") is taken as a name.
They never invent what the words do not state: a question ("Do you like jazz?"), a negation
("I don't live in Paris", "I'm not from Spain"), the past or a wish ("I used to live in Berlin",
"I'd love to live in Rome", "I would like a dog") and what someone else likes ("my sister loves
jazz") give nothing; only the sentence's own words are stored, trimmed of time words ("now").
Every record they write carries origin 'rule_fallback' and the op log names the
'rule_extractor (offline fallback)' actor and the 'rule-based-fallback' model, so nobody mistakes
them for LLM output. `tests/test_memory_rules.py` holds the phrasings above and the ones refused.
"""

from __future__ import annotations

import re

from egomem.memory.agents import RULES_INFO, AgentInfo, Extraction, UpdatePlan, checked_decisions
from egomem.memory.persona import PERSONA_KEYS
from egomem.memory.types import UNKNOWN_USER, ItemDecision, PersonaUpdate, Profile
from egomem.relations import vocabulary

_NAME = r"([A-Z][a-z]+(?:[ -][A-Z][a-z]+)?)"
_I_AM = r"(?:I'm|I am|Im)"
_NOT_A_NAME = {"Sorry", "Fine", "Good", "Glad", "Happy", "Here", "Back", "Ready", "Sure", "Not", "So", "Just", "Very",
               "Really", "Also", "Okay", "Ok", "Well", "Tired", "Busy", "Home", "Done", "Afraid", "Hungry"}
_NAME_PATTERNS = [re.compile(p) for p in (rf"\b(?i:my name is|my name's) {_NAME}", rf"\b(?i:call me) {_NAME}",
                                          rf"\b{_I_AM} {_NAME}\b(?!\s+\w+ing)(?![ -]?\w*(?:years|from))",
                                          rf"^{_NAME} here\b")]
_VALUE = r"([^.,;!?]+)"
_FACT_PATTERNS = [  # (key, regex, template)
    ("lives_in", re.compile(rf"\bI(?: live|'m living| am living| moved|'m based| am based) (?:in|to) {_VALUE}", re.I), "lives in {}"),
    ("lives_in", re.compile(rf"\bmy home is in {_VALUE}", re.I), "lives in {}"),
    ("from", re.compile(rf"\b(?:{_I_AM} from|I come from) {_VALUE}", re.I), "is from {}"),
    ("occupation", re.compile(rf"\bI work as (?:an? )?{_VALUE}", re.I), "works as {}"),
    ("occupation", re.compile(rf"\bmy job is (?:an? )?{_VALUE}", re.I), "works as {}"),
    ("occupation", re.compile(rf"\b{_I_AM} an? ((?:[a-z]+ )?(?:teacher|nurse|doctor|engineer|student|programmer|"
                              r"developer|designer|artist|lawyer|chef|cook|driver|writer|scientist|musician|farmer|"
                              r"pilot|accountant|architect|journalist|photographer|plumber|electrician|carpenter|"
                              r"pharmacist|dentist|librarian|researcher|manager|consultant|mechanic|waiter|waitress|"
                              r"baker|firefighter|police officer|translator|vet|veterinarian))\b", re.I),
     "works as {}"),
    ("workplace", re.compile(rf"\bI work (?:at|for) {_VALUE}", re.I), "works at {}"),
    ("age", re.compile(rf"\b{_I_AM} (\d{{1,3}}) years old", re.I), "is {} years old"),
    ("studies", re.compile(rf"\bI(?: study|'m studying| am studying) {_VALUE}", re.I), "studies {}"),
    (None, re.compile(rf"\bI(?: have|'ve got| have got) (an? {_VALUE[1:-1]})", re.I), "has {}"),
]
_TIME_WORDS = re.compile(r"(?:\s+(?:now|anymore|these days|at the moment|currently|right now|too|as well|recently|"
                         r"last (?:year|month|week|summer|winter|spring|autumn)|(?:a|\w+) (?:years?|months?|weeks?) ago|"
                         r"in (?:19|20)\d\d|since (?:19|20)\d\d))+$", re.I)
_LIKE = re.compile(rf"\bI (?:really |also |absolutely |truly )?(like|love|enjoy|adore|don't like|do not like|hate|"
                   rf"dislike|can't stand|cannot stand) {_VALUE}", re.I)
_FAN = re.compile(rf"\b{_I_AM} (not )?(?:a (?:big |huge )?fan of|into) {_VALUE}", re.I)
_FAVOURITE = re.compile(rf"\bmy fav(?:ou?rite) [a-z ]+? (?:is|are) {_VALUE}", re.I)
_REFUSED = re.compile(r"\b(?:used to|would|'d|if|wish|want to|going to|never)\b", re.I)  # past, wishes, conditions
_RELATION_WORDS = "|".join(sorted((re.escape(w) for w in vocabulary() if " " not in w or w == "best friend"),
                                  key=len, reverse=True))
_RELATION = re.compile(rf"\b(?i:my) (?:(?i:best|older|younger|little|big|elder) )?((?i:{_RELATION_WORDS}))"
                       rf"(?:'s name is| is called| is named| named| called|,)? {_NAME}")
_RELATION_AFTER = re.compile(rf"\b{_NAME} (?:is|was) (?i:my) (?:(?i:best|older|younger|little|big|elder) )?"
                             rf"((?i:{_RELATION_WORDS}))\b")
_TOPICS = {  # words in a liked / disliked item -> AlignX "Likes <topic>" dimension
    "music": "likes_music", "jazz": "likes_music", "song": "likes_music", "sport": "likes_sports",
    "football": "likes_sports", "soccer": "likes_sports", "tennis": "likes_sports", "travel": "likes_travel",
    "trip": "likes_travel", "dog": "likes_pets", "cat": "likes_pets", "pet": "likes_pets", "book": "likes_reading",
    "reading": "likes_reading", "novel": "likes_reading", "movie": "likes_cinema", "film": "likes_cinema",
    "cinema": "likes_cinema", "game": "likes_gaming", "gaming": "likes_gaming", "anime": "likes_anime",
    "car": "likes_cars", "cook": "likes_gourmet_food", "food": "likes_gourmet_food", "paint": "likes_painting",
    "dance": "likes_dance", "photo": "likes_photography", "hiking": "likes_outdoors", "camping": "likes_camping",
    "fashion": "likes_fashion", "science": "likes_science", "art": "likes_art", "fitness": "likes_fitness",
    "gym": "likes_fitness", "humor": "likes_humor", "joke": "likes_humor",
}


_USER_LINE = re.compile(r"USER(?: \(([^)]*)\))?:\s*")  # 'USER (client transcript): ...', 'USER (asr:x): ...'
# A recogniser writes in lower case ("my name is ada"): after an explicit naming cue the next word is a name.
_NAMING_CUE = re.compile(r"\b(my name is|my name's|call me|is called|is named|'s name is) ([a-z]+)(?: ([a-z]+))?", re.I)


def user_lines(transcript: str) -> list[str]:
    """The user's sentences: text of lines starting with 'USER'. Lines of a speech recogniser
    ('USER (asr:...)') get the word after a naming cue capitalised, as a client's own text would."""
    out = []
    for line in transcript.splitlines():
        if line.startswith("USER"):
            m = _USER_LINE.match(line)
            head, text = (m.group(1), line[m.end():]) if m else ("", line.split(":", 1)[-1])
            if head.startswith("asr:") and text == text.lower():
                text = _NAMING_CUE.sub(lambda m: f"{m.group(1)} {m.group(2).capitalize()}"
                                       + (f" {m.group(3)}" if m.group(3) else ""), text)
            out += [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if s.strip()]
    return out


def _clean(value: str) -> str:
    return _TIME_WORDS.sub("", " ".join(value.split()))


class RuleExtractor:
    """Deterministic pattern extraction; the same transcript always gives the same Extraction."""

    def extract(self, transcript: str, known_name: str | None, session_id: str,
                job_id: str | None = None, user_id: str | None = None) -> tuple[Extraction, AgentInfo]:
        ex = Extraction()
        sentences = user_lines(transcript)
        for s in sentences:
            if s.endswith("?"):  # a question states nothing about the user
                continue
            for p in _NAME_PATTERNS:
                m = p.search(s)
                if m and ex.name is None and m.group(1).split()[0] not in _NOT_A_NAME:
                    ex.name = m.group(1)
            for clause in re.split(r"\b(?:but|and|so|because)\b|;", s):
                self._statements(clause.strip(), s, ex)
            for relation, person in _RELATION.findall(s):
                self._relation(ex, person, relation)
            for person, relation in _RELATION_AFTER.findall(s):
                self._relation(ex, person, relation)
        who = ex.name or known_name or "the user"
        if sentences:
            first = sentences[0][:160]
            ex.summary = f"[offline fallback summary] {who} talked ({len(sentences)} sentences); began: \"{first}\""
        return ex, RULES_INFO

    @staticmethod
    def _relation(ex: Extraction, person: str, relation: str) -> None:
        if person.split()[0] not in _NOT_A_NAME and (person, relation.lower()) not in ex.relations:
            ex.relations.append((person, relation.lower()))

    @staticmethod
    def _statements(clause: str, sentence: str, ex: Extraction) -> None:
        """Facts and preferences of one clause (a sentence cut at 'and' / 'but' / ';')."""
        if not clause or _REFUSED.search(clause):
            return
        for key, p, template in _FACT_PATTERNS:
            m = p.search(clause)
            if m:
                fact = (key, template.format(_clean(m.group(1))))
                if fact not in ex.facts:
                    ex.facts.append(fact)
        prefs = [(("like" if v.lower() in ("like", "love", "enjoy", "adore") else "dislike"), item)
                 for v, item in _LIKE.findall(clause)]
        prefs += [("dislike" if neg else "like", item) for neg, item in _FAN.findall(clause)]
        prefs += [("like", item) for item in _FAVOURITE.findall(clause)]
        for polarity, item in prefs:
            item = _clean(item)
            if not item or (item, polarity) in ex.preferences:
                continue
            ex.preferences.append((item, polarity))
            for word, dim_key in _TOPICS.items():
                if word in item.lower():
                    ex.persona.append(PersonaUpdate(PERSONA_KEYS[dim_key], 1.0 if polarity == "like" else 0.0,
                                                    0.6, sentence[:200]))
                    break


class RuleUpdateAgent:
    """Conflicts by rule: same fact key or same preference item with a new value supersedes the
    stored one; an identical statement is kept (nothing written); everything else is added."""

    def decide(self, profile: Profile, ex: Extraction, session_id: str,
               job_id: str | None = None) -> tuple[UpdatePlan, AgentInfo]:
        decisions: list[ItemDecision] = []
        facts_by_key = {f.key: f for f in profile.facts if f.key}
        fact_texts = {f.text.lower() for f in profile.facts}
        for key, text in ex.facts:
            if text.lower() in fact_texts:
                continue
            old = facts_by_key.get(key) if key else None
            if old is not None:
                decisions.append(ItemDecision("supersede", "fact", text, key, None, old.item_id,
                                              f"new value for '{key}' (was: {old.text})"))
                facts_by_key.pop(key)  # a second new value in one session becomes an add
            else:
                decisions.append(ItemDecision("add", "fact", text, key, None, None, "new fact"))
            fact_texts.add(text.lower())
        prefs = {p.text.lower(): p for p in profile.preferences}
        for item, polarity in ex.preferences:
            old = prefs.get(item.lower())
            if old is not None and old.polarity == polarity:
                continue
            if old is not None:
                decisions.append(ItemDecision("supersede", "preference", item, None, polarity, old.item_id,
                                              f"now {polarity}s {item} (was: {old.polarity})"))
                prefs.pop(item.lower())
            else:
                decisions.append(ItemDecision("add", "preference", item, None, polarity, None, "new preference"))
        name = None
        if ex.name and profile.user.name in (UNKNOWN_USER, ""):
            name = ex.name
        return UpdatePlan(checked_decisions(profile, decisions), name, "user said their name" if name else ""), RULES_INFO
