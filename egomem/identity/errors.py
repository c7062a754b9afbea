"""Errors the perception and retrieval code raises; each message says what to do about it."""

from __future__ import annotations


class InputError(ValueError):
    """A request carries data we refuse (wrong dtype/shape, empty, non-finite, too large).

    Raised per request; servers turn it into an error response for that request only.
    """


class ModelFilesMissing(RuntimeError):
    """A configured model's files or its optional package are not on this machine (we never download)."""
