"""REST input validation: each handler states its inputs once, as a schema per place (path, query,
JSON body), and gets them checked and typed. A bad input is a 400 whose JSON body names the field
(`{"error": "key: must be a string", "field": "key"}`), never a 500 from deep in the store.

Checked for every string: its type, its length, that it is valid Unicode (no lone surrogates such
as "\\ud800", which SQLite and UTF-8 cannot hold) and has no NUL. Bodies: UTF-8, a JSON object, no
NaN/Infinity, nesting bounded (a deep `[[[[...` is refused, not a RecursionError), no unknown
fields. Query integers: within their bounds (`limit` within 1..cap, `after` within SQLite's int64).
The schemas also write the OpenAPI document (`openapi.py`), so the two cannot drift apart.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

INT64_MAX = 2**63 - 1  # SQLite's INTEGER range; a larger `after` is an OverflowError in sqlite3
MAX_DEPTH = 8  # JSON nesting a body may have; ours are flat objects, so this only stops abuse
PARSE_IN_THREAD_BYTES = 64 * 1024  # bigger bodies are parsed off the event loop
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")  # uuid hex, derived ids, stream ids


def bad(field_name: str, message: str) -> web.HTTPBadRequest:
    """A 400 whose JSON body names the offending field (an unknown field's name is cut to 64 characters)."""
    field_name = field_name[:64]
    return web.HTTPBadRequest(text=json.dumps({"error": f"{field_name}: {message}", "field": field_name}),
                              content_type="application/json")


@dataclass(frozen=True)
class Str:
    """A string. `required`: must be present and non-blank. Values are returned stripped."""

    required: bool = False
    max_len: int = 1000  # characters
    pattern: re.Pattern[str] | None = None  # fullmatch, e.g. ID_PATTERN
    choices: tuple[str, ...] | None = None
    default: str | None = None
    doc: str = ""

    def check(self, name: str, v: Any) -> str | None:
        if v is None:
            if self.required:
                raise bad(name, "is required")
            return self.default
        if not isinstance(v, str):
            raise bad(name, f"must be a string, not {_json_type(v)}")
        _unicode(name, v)
        if len(v) > self.max_len:
            raise bad(name, f"is longer than {self.max_len} characters")
        v = v.strip()
        if self.required and not v:
            raise bad(name, "must not be empty")
        if self.pattern is not None and v and not self.pattern.fullmatch(v):
            raise bad(name, "is not a well-formed id (1-128 of A-Z a-z 0-9 _ . : -)")
        if self.choices is not None and v and v not in self.choices:
            raise bad(name, f"must be one of {', '.join(self.choices)}")
        return v if v or self.default is None else self.default

    def openapi(self) -> dict[str, Any]:
        s: dict[str, Any] = {"type": "string", "maxLength": self.max_len}
        if self.required:
            s["minLength"] = 1
        if self.pattern is not None:
            s["pattern"] = f"^{self.pattern.pattern}$"
        if self.choices:
            s["enum"] = list(self.choices)
        return _described(s, self.doc)


@dataclass(frozen=True)
class Int:
    """An integer query parameter within [lo, hi] (decimal digits only: no 1e3, no 0x10)."""

    lo: int
    hi: int
    default: int
    doc: str = ""

    def check(self, name: str, v: Any) -> int:
        if v is None or v == "":
            return self.default
        if not isinstance(v, str) or not re.fullmatch(r"[+-]?[0-9]+", v):
            raise bad(name, "must be a decimal integer")
        n = int(v) if len(v) <= 40 else (-1 if v[0] == "-" else 1) * 10**40  # no int() of a huge string
        if not self.lo <= n <= self.hi:
            raise bad(name, f"must be within {self.lo}..{self.hi}")
        return n

    def openapi(self) -> dict[str, Any]:
        return _described({"type": "integer", "minimum": self.lo, "maximum": self.hi, "default": self.default},
                          self.doc)


@dataclass(frozen=True)
class Bool:
    """A flag query parameter: 1/true/0/false (absent: false)."""

    doc: str = ""

    def check(self, name: str, v: Any) -> bool:
        if v is None or v == "":
            return False
        if v in ("1", "true"):
            return True
        if v in ("0", "false"):
            return False
        raise bad(name, "must be 1, true, 0 or false")

    def openapi(self) -> dict[str, Any]:
        return _described({"type": "boolean", "default": False}, self.doc)


Field = Str | Int | Bool
Schema = Mapping[str, Field]


@dataclass(frozen=True)
class Inputs:
    """What a validated handler receives besides the request."""

    path: dict[str, Any] = field(default_factory=dict)
    query: dict[str, Any] = field(default_factory=dict)
    body: dict[str, Any] = field(default_factory=dict)


Handler = Callable[[web.Request, Inputs], Awaitable[web.StreamResponse]]
Route = Callable[[web.Request], Awaitable[web.StreamResponse]]


def validated(path: Schema | None = None, query: Schema | None = None,
              body: Schema | None = None) -> Callable[[Handler], Route]:
    """Decorator: check the request against the schemas, then call `handler(request, inputs)`.
    The schemas stay on the wrapper (`.schemas`) for the OpenAPI document."""

    def wrap(handler: Handler) -> Route:
        @functools.wraps(handler)
        async def run(request: web.Request) -> web.StreamResponse:
            p = {k: f.check(k, request.match_info.get(k)) for k, f in (path or {}).items()}
            unknown = sorted(set(request.query) - set(query or {}))
            if unknown:
                raise bad(unknown[0], "is not a query parameter of this route")
            for k in request.query:
                if len(request.query.getall(k)) > 1:
                    raise bad(k, "is given more than once")
            q = {k: f.check(k, request.query.get(k)) for k, f in (query or {}).items()}
            b = await json_body(request, body) if body is not None else {}
            return await handler(request, Inputs(p, q, b))

        run.schemas = {"path": dict(path or {}), "query": dict(query or {}),
                       "body": dict(body) if body is not None else None}
        return run

    return wrap


async def json_body(request: web.Request, schema: Schema) -> dict[str, Any]:
    """The body as a JSON object checked against `schema` (unknown fields refused)."""
    raw = await request.read()  # bounded by client_max_size / the limits middleware (413)
    if not raw.strip():
        raise bad("body", "must be a JSON object")
    parse = functools.partial(_parse, raw)
    data = await asyncio.to_thread(parse) if len(raw) > PARSE_IN_THREAD_BYTES else parse()
    if not isinstance(data, dict):
        raise bad("body", f"must be a JSON object, not {_json_type(data)}")
    unknown = sorted(set(data) - set(schema))
    if unknown:
        raise bad(unknown[0], f"is not a field of this body (fields: {', '.join(schema) or 'none'})")
    for k in data:
        _unicode(k, k)
    return {k: f.check(k, data.get(k)) for k, f in schema.items()}


def _parse(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad("body", f"is not UTF-8 (byte {e.start})") from None
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise bad("body", f"is not JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise bad("body", f"is nested deeper than {MAX_DEPTH} levels") from None
    if _depth(data) > MAX_DEPTH:
        raise bad("body", f"is nested deeper than {MAX_DEPTH} levels")
    return data


def _no_constant(name: str) -> Any:
    raise bad("body", f"{name} is not JSON (numbers must be finite)")


def _depth(v: Any, limit: int = MAX_DEPTH + 1) -> int:
    """Nesting depth of a parsed JSON value, counted up to `limit` (enough to refuse it)."""
    if limit <= 0 or not isinstance(v, (dict, list)):
        return 0
    children = v.values() if isinstance(v, dict) else v
    return 1 + max((_depth(c, limit - 1) for c in children), default=0)


def _unicode(name: str, v: str) -> None:
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(name, f"is not valid Unicode (lone surrogate at character {e.start})") from None
    if "\x00" in v:
        raise bad(name, "must not contain NUL characters")


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    return "an array" if isinstance(v, list) else "an object"


def _described(schema: dict[str, Any], doc: str) -> dict[str, Any]:
    if doc:
        schema["description"] = doc
    return schema
