"""A small JSON-Schema validator for the LLM agents' answers (the subset our schemas use).

Supported keywords: type (one or a list), properties, required, additionalProperties (bool),
items, enum, minimum, maximum, minLength, maxLength, maxItems. That is all our schemas need, and
it saves a dependency; `validate` returns the first problem as a path + message, or None.
"""

from __future__ import annotations

from typing import Any

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def validate(value: Any, schema: dict[str, Any], path: str = "$") -> str | None:
    """None when `value` satisfies `schema`, else '<json path>: <what is wrong>'."""
    t = schema.get("type")
    if t is not None:
        types = t if isinstance(t, list) else [t]
        if not any(_TYPES[x](value) for x in types):
            return f"{path}: expected {' or '.join(types)}, got {type(value).__name__}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{path}: {value!r} is not one of {schema['enum']}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            return f"{path}: {value} < minimum {schema['minimum']}"
        if "maximum" in schema and value > schema["maximum"]:
            return f"{path}: {value} > maximum {schema['maximum']}"
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            return f"{path}: shorter than {schema['minLength']} characters"
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            return f"{path}: longer than {schema['maxLength']} characters"
    if isinstance(value, list):
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            return f"{path}: more than {schema['maxItems']} items"
        if "items" in schema:
            for i, v in enumerate(value):
                err = validate(v, schema["items"], f"{path}[{i}]")
                if err:
                    return err
    if isinstance(value, dict):
        for k in schema.get("required", []):
            if k not in value:
                return f"{path}: missing required key {k!r}"
        props = schema.get("properties", {})
        for k, v in value.items():
            if k in props:
                err = validate(v, props[k], f"{path}.{k}")
                if err:
                    return err
            elif schema.get("additionalProperties", True) is False:
                return f"{path}: unexpected key {k!r}"
    return None
