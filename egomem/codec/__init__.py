"""Audio codecs (Mimi)."""
