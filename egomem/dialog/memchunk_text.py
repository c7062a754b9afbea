"""How a memory text is cut to fit a MemChunk: the one rule serving (orchestrator/memchunk.py) and
training (egomem/training) share, so a model is trained on exactly the texts it is served."""

from __future__ import annotations


def fit(text: str, max_bytes: int) -> str:
    """Cut `text` to at most `max_bytes` UTF-8 bytes at a line boundary (one byte = one MemChunk step
    with the offline byte tokenizer; SentencePiece needs fewer steps, never more)."""
    out, used = [], 0
    for line in text.split("\n"):
        cost = len(line.encode("utf-8")) + (1 if out else 0)
        if used + cost > max_bytes:
            break
        out.append(line)
        used += cost
    return "\n".join(out)
