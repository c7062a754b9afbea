"""Text tokenizers for the dialog model's inner-monologue / MemChunk text channel.

Real checkpoints come with a SentencePiece model (Moshi: `tokenizer_spm_32k_3.model`), loaded from a
local path; the offline default is a byte-level tokenizer matching the `tiny` preset's 260-id vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class TextTokenizer(Protocol):
    vocab_size: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes shifted past 4 specials: 0 end-of-padding, 1 bos, 2 eos, 3 pad (Moshi's ids)."""

    OFFSET = 4
    vocab_size = 256 + OFFSET
    pad_id = 3

    def encode(self, text: str) -> list[int]:
        return [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - self.OFFSET for i in ids if i >= self.OFFSET).decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    """A SentencePiece `.model` file (Moshi's text tokenizer)."""

    def __init__(self, path: Path):
        import sentencepiece

        self.sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        self.vocab_size = self.sp.get_piece_size()
        self.pad_id = 3  # Moshi's existing_text_padding_id

    def encode(self, text: str) -> list[int]:
        return list(self.sp.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode([i for i in ids if 0 <= i < self.vocab_size])


def load_tokenizer(path: Path | None) -> TextTokenizer:
    """SentencePiece from `path`, or the byte-level tokenizer when `path` is None."""
    if path is None:
        return ByteTokenizer()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dialog tokenizer {path} does not exist: set dialog.tokenizer to a local "
                                f"SentencePiece .model file, or leave it unset for the byte-level tokenizer")
    try:
        return SentencePieceTokenizer(path)
    except Exception as e:  # sentencepiece raises bare RuntimeError/OSError with C++ text
        raise ValueError(f"dialog tokenizer {path} is not a SentencePiece model: {e}") from e
