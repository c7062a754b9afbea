"""What the memory store raises: every backend raises these, and callers catch only these."""

from __future__ import annotations


class StoreError(RuntimeError):
    """A request the store cannot honour (unknown user, item not current, ...). The message says which."""


class VersionConflict(StoreError):
    """The user changed after the profile was read; re-read the profile and decide again."""


class ChunkRedacted(StoreError):
    """A forget rewrote the session's chunk after it was read: retry the job (it re-reads the redacted chunk)."""
