"""The 90 persona dimensions of AlignX, the order the stored persona uses (index 0..89).

Source: the AlignX dataset, Li et al. 2025, "From 1,000,000 Users to Every User: Scaling Up
Personalized Preference for User-level Alignment" (arXiv:2503.15463); the dimension list and its
order are the `features_persona` table of `get_profile.py` in github.com/JinaLeejnl/AlignX, whose
"Preference Direction" vectors are 90 values in {0, 0.5, 1}: 1 = the first (positive) pole,
0 = the second pole, 0.5 = no clear preference. We keep that scale: a stored persona value is in
[0, 1] with the same meaning, plus a confidence in [0, 1] and the evidence that moved it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from egomem.memory.types import PersonaValue


@dataclass(frozen=True)
class PersonaDimension:
    index: int
    key: str  # stable snake_case name, used in LLM JSON and logs
    positive: str  # the pole a value of 1.0 means
    negative: str  # the pole a value of 0.0 means


_POLES: tuple[tuple[str, str], ...] = (
    ("Young", "Older"),
    ("Female", "Male"),
    ("High Neuroticism", "Low Neuroticism"),
    ("High Extraversion", "Low Extraversion"),
    ("High Openness", "Low Openness"),
    ("High Agreeableness", "Low Agreeableness"),
    ("High Conscientiousness", "Low Conscientiousness"),
    ("Likes a certain food", "Dislikes a certain food"),
    ("Likes a certain living environment", "Dislikes a certain living environment"),
    ("Likes sleep", "Dislikes sleep"),
    ("Aggressive investment", "Conservative investment"),
    ("Good at saving", "Bad at saving"),
    ("Concerned about physical safety", "Not concerned about physical safety"),
    ("Concerned about environmental safety", "Not concerned about environmental safety"),
    ("Prefers superficial interaction (casual, stress-free chat)",
     "Prefers deep interaction (discussing interests, emotional topics, etc.)"),
    ("Prefers direct communication to handle conflict",
     "Prefers avoidance, mediation, compromise to handle conflict"),
    ("Concise communication style", "Detailed communication style"),
    ("Strong need for a certain work environment", "Indifferent to work environment needs"),
    ("Strong need for recognition from others", "Indifferent to recognition from others"),
    ("Strong need for personal achievement", "Indifferent to personal achievement"),
    ("Likes a certain area of knowledge", "Dislikes a certain area of knowledge"),
    ("Likes a certain learning style", "Dislikes a certain learning style"),
    ("Likes a certain form of creative expression (e.g., art, writing, music)",
     "Dislikes a certain form of creative expression (e.g., art, writing, music)"),
    ("Strong need for Order (neatness, organization, avoiding chaos)", "Indifferent to orderliness"),
    ("Strong need for Retention (holding onto objects, unwilling to lose or change)",
     "Indifferent to retention (unconcerned about keeping objects)"),
    ("Strong need for Inviolacy (maintaining dignity and reputation)",
     "Indifferent to inviolacy (unconcerned with dignity or reputation)"),
    ("Strong need for Infavoidance (avoiding failure and embarrassment)",
     "Indifferent to Infavoidance (unconcerned with failure or embarrassment)"),
    ("Strong need for Counteraction (overcoming failure and obstacles)",
     "Indifferent to Counteraction (unconcerned with failure)"),
    ("Strong need for Seclusion (desire for isolation from others)",
     "Indifferent to Seclusion (does not care about isolation)"),
    ("Strong need for Dominance (controlling others through command or persuasion)",
     "Indifferent to Dominance (does not care about control)"),
    ("Strong need for Deference (following authority or rules)",
     "Indifferent to Deference (does not care about authority)"),
    ("Strong need for Autonomy (pursuing independence and self-reliance)",
     "Indifferent to Autonomy (does not care about independence)"),
    ("Strong need for Contrariance (pursuing uniqueness, opposing the norm)",
     "Indifferent to Contrariance (does not seek uniqueness)"),
    ("Strong need for Abasement (accepting blame, enjoying pain or misfortune)",
     "Indifferent to Abasement (does not accept blame or enjoy misfortune)"),
    ("Strong need for Aggression (controlling others through forceful means)",
     "Indifferent to Aggression (does not engage in aggression)"),
    ("Strong need for Affiliation (desiring close relationships)",
     "Indifferent to Affiliation (does not care about close relationships)"),
    ("Strong need for Rejection (isolating oneself from negatively evaluated people)",
     "Indifferent to Rejection (does not care about social exclusion)"),
    ("Strong need for Nurturance (caring for others, protecting them from danger)",
     "Indifferent to Nurturance (does not care about nurturing others)"),
    ("Strong need for Succorance (desiring help, love, and comfort from others)",
     "Indifferent to Succorance (does not rely on others for comfort)"),
    ("Strong need for Play (enjoying fun, relaxation, and laughter)",
     "Indifferent to Play (does not prioritize fun or relaxation)"),
    ("Concerned about harmlessness", "Indifferent about harmlessness"),
    ("Concerned about instruction-following", "Indifferent about instruction-following"),
    ("Concerned about honesty", "Indifferent about honesty"),
    ("Concerned about truthfulness", "Indifferent about truthfulness"),
    ("Concerned about helpfulness", "Indifferent about helpfulness"),
    ("Concerned about coherence", "Indifferent about coherence"),
    ("Concerned about complexity", "Indifferent about complexity"),
) + tuple(
    (f"Likes {topic}", f"Dislikes {topic}")
    for topic in (
        "science", "knowledge", "psychology", "cinema", "entertainment", "gaming", "parenting",
        "wild imagination", "anime", "sports", "law", "workplace", "pets", "travel", "health",
        "stories", "cars", "gourmet food", "education", "current events", "home decor",
        "international", "finance", "campus life", "digital technology", "emotions", "humor",
        "music", "reading", "painting", "dance", "crafts", "photography", "culture", "fitness",
        "art", "stationery and planners", "celebrities", "outdoors", "camping", "social sciences",
        "weddings", "fashion",
    )
)


def _key(pole: str) -> str:
    """'Strong need for Order (neatness, ...)' -> 'strong_need_for_order'."""
    return re.sub(r"[^a-z0-9]+", "_", pole.split("(")[0].lower()).strip("_")


PERSONA_DIMENSIONS: tuple[PersonaDimension, ...] = tuple(
    PersonaDimension(i, _key(pos), pos, neg) for i, (pos, neg) in enumerate(_POLES)
)
PERSONA_KEYS: dict[str, int] = {d.key: d.index for d in PERSONA_DIMENSIONS}
NUM_PERSONA_DIMENSIONS = 90
assert len(PERSONA_DIMENSIONS) == NUM_PERSONA_DIMENSIONS, len(PERSONA_DIMENSIONS)
assert len(PERSONA_KEYS) == NUM_PERSONA_DIMENSIONS, "persona keys must be unique"


def dimension(ref: int | str) -> PersonaDimension:
    """Look a dimension up by index or key; raises KeyError naming the bad reference."""
    if isinstance(ref, int) and 0 <= ref < NUM_PERSONA_DIMENSIONS:
        return PERSONA_DIMENSIONS[ref]
    if isinstance(ref, str) and ref in PERSONA_KEYS:
        return PERSONA_DIMENSIONS[PERSONA_KEYS[ref]]
    raise KeyError(f"unknown persona dimension {ref!r}; use an index 0..89 or a key from PERSONA_KEYS")


def describe(index: int, value: float) -> str:
    """The pole a value leans to, for the rendered profile ('' when neutral)."""
    d = PERSONA_DIMENSIONS[index]
    if value >= 0.6:
        return d.positive
    if value <= 0.4:
        return d.negative
    return ""


def combine(old: PersonaValue | None, value: float, confidence: float) -> tuple[float, float]:
    """New evidence merged into a stored dimension: the confidence-weighted mean of the values
    (independent evidence raises the confidence), rounded to 6 places as stored."""
    if old is None:
        new_value, conf = value, confidence
    else:
        w = old.confidence + confidence
        new_value = (old.value * old.confidence + value * confidence) / w if w > 0 else value
        conf = 1.0 - (1.0 - old.confidence) * (1.0 - confidence)
    return round(new_value, 6), round(conf, 6)
