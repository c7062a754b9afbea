"""The two memory agents: the extractor (transcript -> candidate memories) and the update agent
(candidates + stored profile -> add / supersede / retract decisions with reasons).

Each has an LLM implementation (prompts + JSON schemas here, transport in `llm.py`) and a
deterministic rule-based one (`rules.py`, the offline fallback). Both return an `AgentInfo` so
every record written says which model (or the fallback) made it and from which prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from egomem.memory.llm import LLMClient
from egomem.memory.persona import PERSONA_DIMENSIONS, PERSONA_KEYS
from egomem.memory.types import FALLBACK_ORIGIN, ItemDecision, PersonaUpdate, Profile

FALLBACK_MODEL = "rule-based-fallback"  # the `llm_model` the op log records for the offline rules


@dataclass(frozen=True)
class AgentInfo:
    origin: str  # 'llm:<model>' or 'rule_fallback'
    actor: str
    model: str
    prompt_hash: str | None = None


RULES_INFO = AgentInfo(FALLBACK_ORIGIN, "rule_extractor (offline fallback)", FALLBACK_MODEL)


@dataclass
class Extraction:
    """What one session says about its user."""

    summary: str = ""
    name: str | None = None
    facts: list[tuple[str | None, str]] = field(default_factory=list)  # (key or None, text)
    preferences: list[tuple[str, str]] = field(default_factory=list)  # (item, 'like' | 'dislike')
    persona: list[PersonaUpdate] = field(default_factory=list)
    relations: list[tuple[str, str]] = field(default_factory=list)  # (person's name, relation words)


@dataclass
class UpdatePlan:
    decisions: list[ItemDecision]
    name: str | None  # the user's name to set, or None to keep
    name_reason: str = ""


class Extractor(Protocol):
    def extract(self, transcript: str, known_name: str | None, session_id: str,
                job_id: str | None = None, user_id: str | None = None) -> tuple[Extraction, AgentInfo]: ...


class UpdateAgent(Protocol):
    def decide(self, profile: Profile, ex: Extraction, session_id: str,
               job_id: str | None = None) -> tuple[UpdatePlan, AgentInfo]: ...


# ---------------------------------------------------------------------------- schemas

_STR = {"type": "string", "maxLength": 2000}
EXTRACT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["summary", "name", "facts", "preferences", "persona", "relations"],
    "properties": {
        "summary": _STR,
        "name": {"type": ["string", "null"], "maxLength": 100},
        "facts": {"type": "array", "maxItems": 50, "items": {
            "type": "object", "required": ["text"],
            "properties": {"key": {"type": ["string", "null"], "maxLength": 64}, "text": _STR}}},
        "preferences": {"type": "array", "maxItems": 50, "items": {
            "type": "object", "required": ["item", "polarity"],
            "properties": {"item": _STR, "polarity": {"enum": ["like", "dislike"]}}}},
        "persona": {"type": "array", "maxItems": 90, "items": {
            "type": "object", "required": ["dimension", "value", "confidence", "evidence"],
            "properties": {"dimension": {"enum": sorted(PERSONA_KEYS)},
                           "value": {"type": "number", "minimum": 0, "maximum": 1},
                           "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                           "evidence": _STR}}},
        "relations": {"type": "array", "maxItems": 50, "items": {
            "type": "object", "required": ["person", "relation"],
            "properties": {"person": {"type": "string", "minLength": 1, "maxLength": 100},
                           "relation": {"type": "string", "minLength": 1, "maxLength": 64}}}},
    },
}

UPDATE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["decisions", "name"],
    "properties": {
        "decisions": {"type": "array", "maxItems": 100, "items": {
            "type": "object", "required": ["action", "kind", "reason"],
            "properties": {"action": {"enum": ["add", "supersede", "retract", "keep"]},
                           "kind": {"enum": ["fact", "preference"]},
                           "target_id": {"type": ["string", "null"]},
                           "text": {"type": ["string", "null"], "maxLength": 2000},
                           "key": {"type": ["string", "null"], "maxLength": 64},
                           "polarity": {"enum": ["like", "dislike", None]},
                           "reason": _STR}}},
        "name": {"type": "object", "required": ["action", "reason"],
                 "properties": {"action": {"enum": ["set", "keep"]},
                                "value": {"type": ["string", "null"], "maxLength": 100}, "reason": _STR}},
    },
}

_PERSONA_LIST = "\n".join(f"- {d.key}: 1 = {d.positive}; 0 = {d.negative}" for d in PERSONA_DIMENSIONS)

EXTRACT_SYSTEM = f"""You maintain the long-term memory of a voice assistant about the people it talks to.
You get the transcript of one conversation with one user. Lines marked USER are the user; lines
marked ASSISTANT are the assistant's inner monologue. Extract only what the USER states or clearly
implies about themselves. Answer with one JSON object and nothing else:
{{"summary": one or two sentences about what was discussed,
 "name": the user's own name if they said it, else null,
 "facts": [{{"key": a short snake_case attribute such as lives_in / occupation / age, or null, "text": the fact in third person, e.g. "lives in Paris"}}],
 "preferences": [{{"item": what they like or dislike, "polarity": "like" or "dislike"}}],
 "persona": [{{"dimension": a key from the list below, "value": 0..1, "confidence": 0..1, "evidence": the words that show it}}],
 "relations": [{{"person": the other person's name, "relation": what that person is to the user, e.g. "sister", "colleague"}}]}}
Use empty lists when nothing applies. Persona dimensions (AlignX), value 1 = first pole, 0 = second, 0.5 = neutral:
{_PERSONA_LIST}"""

UPDATE_SYSTEM = """You keep a user's long-term memory consistent. You get the stored profile (current facts and
preferences, each with an id) and the candidates extracted from a new conversation. For every
candidate decide:
- "add": new information (no stored item says the same or the opposite);
- "supersede": it replaces a stored item that is now outdated or contradicted (give target_id);
- "keep": the stored profile already says it (nothing is written);
and "retract" a stored item (target_id) only when the user clearly says it is no longer true and there is no replacement.
Never drop stored information silently; every decision needs a short reason.
Answer with one JSON object and nothing else:
{"decisions": [{"action": ..., "kind": "fact" or "preference", "target_id": id or null, "text": the new text or null,
  "key": attribute or null, "polarity": "like"/"dislike" for preferences or null, "reason": why}],
 "name": {"action": "set" or "keep", "value": the name or null, "reason": why}}"""


def _persona_updates(rows: list[dict[str, Any]]) -> list[PersonaUpdate]:
    return [PersonaUpdate(PERSONA_KEYS[r["dimension"]], float(r["value"]), float(r["confidence"]),
                          str(r["evidence"])) for r in rows]


class LLMExtractor:
    def __init__(self, client: LLMClient):
        self.client = client

    def extract(self, transcript: str, known_name: str | None, session_id: str,
                job_id: str | None = None, user_id: str | None = None) -> tuple[Extraction, AgentInfo]:
        user = f"Known name of this user: {known_name or 'unknown'}\n\nTranscript:\n{transcript}"
        messages = [{"role": "system", "content": EXTRACT_SYSTEM}, {"role": "user", "content": user}]
        a = self.client.complete_json("extract", messages, EXTRACT_SCHEMA, session_id=session_id, job_id=job_id,
                                      user_id=user_id)
        d = a.data
        ex = Extraction(
            summary=d["summary"].strip(),
            name=(d["name"] or "").strip() or None,
            facts=[(f.get("key"), f["text"].strip()) for f in d["facts"] if f["text"].strip()],
            preferences=[(p["item"].strip(), p["polarity"]) for p in d["preferences"] if p["item"].strip()],
            persona=_persona_updates(d["persona"]),
            relations=[(r["person"].strip(), r["relation"].strip()) for r in d["relations"]],
        )
        return ex, AgentInfo(f"llm:{a.model}", "extractor", a.model, a.prompt_hash)


def profile_for_prompt(profile: Profile) -> dict[str, Any]:
    return {
        "name": profile.user.name,
        "facts": [{"id": f.item_id, "key": f.key, "text": f.text} for f in profile.facts],
        "preferences": [{"id": p.item_id, "item": p.text, "polarity": p.polarity} for p in profile.preferences],
    }


def checked_decisions(profile: Profile, raw: list[ItemDecision]) -> list[ItemDecision]:
    """Make decisions safe to apply: a supersede/retract must name a current item of the same kind,
    at most once; anything else becomes an 'add' (so nothing extracted is lost) or is dropped if empty."""
    current = {i.item_id: i for i in profile.facts + profile.preferences}
    used: set[str] = set()
    out = []
    for d in raw:
        if d.action in ("supersede", "retract"):
            t = current.get(d.target_id or "")
            if t is None or t.kind != d.kind or d.target_id in used:
                if d.action == "retract" or not d.text.strip():
                    continue
                d = ItemDecision("add", d.kind, d.text, d.key, d.polarity, None,
                                 d.reason + " [target not current in profile: added instead]")
            else:
                used.add(t.item_id)
        if d.action in ("add", "supersede"):
            if not d.text.strip():
                continue
            if d.kind == "preference" and d.polarity not in ("like", "dislike"):
                continue
        out.append(d)
    return out


class LLMUpdateAgent:
    def __init__(self, client: LLMClient):
        self.client = client

    def decide(self, profile: Profile, ex: Extraction, session_id: str,
               job_id: str | None = None) -> tuple[UpdatePlan, AgentInfo]:
        candidates = {
            "name": ex.name,
            "facts": [{"key": k, "text": t} for k, t in ex.facts],
            "preferences": [{"item": i, "polarity": p} for i, p in ex.preferences],
        }
        user = (f"Stored profile:\n{json.dumps(profile_for_prompt(profile), indent=1)}\n\n"
                f"Candidates from the new conversation:\n{json.dumps(candidates, indent=1)}")
        messages = [{"role": "system", "content": UPDATE_SYSTEM}, {"role": "user", "content": user}]
        a = self.client.complete_json("update", messages, UPDATE_SCHEMA, session_id=session_id, job_id=job_id,
                                      user_id=profile.user.user_id)
        raw = [ItemDecision(d["action"], d["kind"], (d.get("text") or "").strip(), d.get("key"), d.get("polarity"),
                            d.get("target_id"), d["reason"]) for d in a.data["decisions"] if d["action"] != "keep"]
        n = a.data["name"]
        name = (n.get("value") or "").strip() or None if n["action"] == "set" else None
        plan = UpdatePlan(checked_decisions(profile, raw), name, n["reason"])
        return plan, AgentInfo(f"llm:{a.model}", "update_agent", a.model, a.prompt_hash)
