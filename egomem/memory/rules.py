"""The offline fallback agents: deterministic rules instead of an LLM.

They run when no LLM key is configured, so the stack works end to end without a network. They
read only the USER lines of a transcript and recognise a few plain English patterns ("my name is
X", "I live in X", "I like X", "my sister X"). Every record they write carries origin
'rule_fallback' and the op log names the 'rule_extractor (offline fallback)' actor and the
'rule-based-fallback' model, so nobody mistakes them for LLM output.
"""

from __future__ import annotations

import re

from egomem.memory.agents import RULES_INFO, AgentInfo, Extraction, UpdatePlan, checked_decisions
from egomem.memory.persona import PERSONA_KEYS
from egomem.memory.types import UNKNOWN_USER, ItemDecision, PersonaUpdate, Profile

_NAME = r"([A-Z][a-z]+(?: [A-Z][a-z]+)?)"
_NAME_PATTERNS = [re.compile(p) for p in (rf"\bmy name is {_NAME}", rf"\bcall me {_NAME}", rf"\bI'm {_NAME}\b(?!\s+\w+ing)")]
_FACT_PATTERNS = [  # (key, regex, template)
    ("lives_in", re.compile(r"\bI live in ([^.,;!?]+)", re.I), "lives in {}"),
    ("from", re.compile(r"\bI(?:'m| am) from ([^.,;!?]+)", re.I), "is from {}"),
    ("occupation", re.compile(r"\bI work as (?:an? )?([^.,;!?]+)", re.I), "works as {}"),
    ("occupation", re.compile(r"\bI(?:'m| am) an? ((?:[a-z]+ )?(?:teacher|nurse|doctor|engineer|student|"
                              r"programmer|developer|designer|artist|lawyer|chef|driver|writer|scientist))\b", re.I),
     "works as {}"),
    ("age", re.compile(r"\bI(?:'m| am) (\d{1,3}) years old", re.I), "is {} years old"),
    ("studies", re.compile(r"\bI study ([^.,;!?]+)", re.I), "studies {}"),
    (None, re.compile(r"\bI have (an? [^.,;!?]+)", re.I), "has {}"),
]
_TIME_WORDS = re.compile(r"\s+(?:now|anymore|these days|at the moment|currently)$", re.I)
_LIKE = re.compile(r"\bI (?:really |also )?(like|love|enjoy|don't like|do not like|hate|dislike) ([^.,;!?]+)", re.I)
_RELATION_WORDS = ("sister", "brother", "mother", "father", "mom", "dad", "wife", "husband", "son", "daughter",
                   "friend", "colleague", "boss", "partner", "cousin", "grandmother", "grandfather", "neighbour",
                   "neighbor", "roommate", "teacher", "girlfriend", "boyfriend")
_RELATION = re.compile(rf"\b(?i:my) (?:best )?({'|'.join(_RELATION_WORDS)})(?:'s name is| is called| is named|,)? {_NAME}")
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


def user_lines(transcript: str) -> list[str]:
    """The user's sentences: text of lines starting with 'USER'."""
    out = []
    for line in transcript.splitlines():
        if line.startswith("USER"):
            out += [s.strip() for s in re.split(r"(?<=[.!?])\s+", line.split(":", 1)[-1]) if s.strip()]
    return out


class RuleExtractor:
    """Deterministic pattern extraction; the same transcript always gives the same Extraction."""

    def extract(self, transcript: str, known_name: str | None, session_id: str,
                job_id: str | None = None, user_id: str | None = None) -> tuple[Extraction, AgentInfo]:
        ex = Extraction()
        sentences = user_lines(transcript)
        for s in sentences:
            for p in _NAME_PATTERNS:
                m = p.search(s)
                if m and ex.name is None:
                    ex.name = m.group(1)
            for key, p, template in _FACT_PATTERNS:
                m = p.search(s)
                if m:
                    fact = (key, template.format(_TIME_WORDS.sub("", m.group(1).strip())))
                    if fact not in ex.facts:
                        ex.facts.append(fact)
            for verb, item in _LIKE.findall(s):
                item = _TIME_WORDS.sub("", item.strip())
                polarity = "like" if verb.lower() in ("like", "love", "enjoy") else "dislike"
                if (item, polarity) not in ex.preferences:
                    ex.preferences.append((item, polarity))
                for word, dim_key in _TOPICS.items():
                    if word in item.lower():
                        ex.persona.append(PersonaUpdate(PERSONA_KEYS[dim_key], 1.0 if polarity == "like" else 0.0,
                                                        0.6, s[:200]))
                        break
            for relation, person in _RELATION.findall(s):
                if (person, relation) not in ex.relations:
                    ex.relations.append((person, relation))
        who = ex.name or known_name or "the user"
        if sentences:
            first = sentences[0][:160]
            ex.summary = f"[offline fallback summary] {who} talked ({len(sentences)} sentences); began: \"{first}\""
        return ex, RULES_INFO


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
