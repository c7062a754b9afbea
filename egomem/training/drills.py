"""Fresh names and reading drills: training rows where reading the MemChunk is the only way to lower the loss.

A from-scratch model can fit the corpus's greetings by memorising its people; on held-out people it
then invents names (docs/training.md#what-the-tiny-model-reached). Two row transforms, applied on the
fly by `egomem finetune` (`--fresh-names`, `--drills`), take that shortcut away:

- **fresh names**: the row's people (the `name:` and `people:` lines of its L1 text) get new random
  pseudo-names of the same byte length, in L1 and on the text channel, so no name can be memorised
  (the speak channel keeps the old name's audio: it is not re-synthesised);
- **reading drills**: the row's text channel writes a span of its own L1 text from a random tick, and
  only that span (plus a few pad ticks before it) is supervised, text only. With `random_l1` a drill
  reads an L1 of random pseudo-words instead, where nothing but copying predicts the next byte.

Both work on byte-tokenised rows (a same-length rename keeps every frame where it was); `check_tokenizer`
says so for any other tokenizer. Every draw comes from the `random.Random` the caller passes, so a
run that seeds it per (seed, step, row) is reproducible and resumes bit-exactly.
"""

from __future__ import annotations

import dataclasses
import random
import re

import numpy as np

from egomem.dialog.tokenizer import ByteTokenizer, TextTokenizer

from .types import Sample, Span

VOWELS, CONSONANTS = "aeiou", "bcdfghjklmnprstvwz"
DRILL_LEAD = 8  # pad ticks before a drill's first byte that are supervised too (the drill starts on cue)
DRILL_CLEAR = 40  # text-channel ticks before a drill that are blanked to pad (no half-words run into it)
RANDOM_L1_BYTES = (330, 380)  # a random L1 is about as long as a profile


def check_tokenizer(tokenizer: TextTokenizer) -> None:
    """Fresh names and drills rewrite the text channel byte for byte: only the byte tokenizer allows it."""
    if not isinstance(tokenizer, ByteTokenizer):
        raise ValueError("fresh names and reading drills need the byte-level tokenizer (a rename must keep every "
                         "frame where it was); this dataset uses a SentencePiece model: set --fresh-names 0 --drills 0")


def pseudo_word(n: int, rng: random.Random, capital: bool = True) -> str:
    """A pronounceable pseudo-word of n letters (consonants and vowels alternating, either first)."""
    s = "".join(rng.choice(CONSONANTS if i % 2 == 0 else VOWELS) for i in range(n))
    if rng.random() < 0.5:  # redrawn vowel-first (this draw order keeps bench/diag_memchunk_copy's runs reproducible)
        s = "".join(rng.choice(VOWELS if i % 2 == 0 else CONSONANTS) for i in range(n))
    return s[:1].upper() + s[1:] if capital else s


def name_words(l1: str) -> list[str]:
    """The words of people's names in an L1 text (its `name:` and `people:` lines)."""
    words: list[str] = []
    for line in l1.splitlines():
        if line.startswith("name: "):
            words += line[6:].split()
        elif line.startswith("people: "):
            for part in line[8:].split(";"):
                words += re.sub(r"\(.*?\)", "", part).split()
    return [w for w in words if w[:1].isupper() and w.isalpha()]


def rename_people(sample: Sample, tokens: np.ndarray, rng: random.Random) -> tuple[Sample, np.ndarray]:
    """The row with its people renamed to same-length pseudo-names in L1, in L2 (a Level-2 answer reads the
    name from either MemChunk, so both must agree with the text channel) and on the text channel."""
    words = sorted(set(name_words(sample.l1_text)), key=len, reverse=True)
    if not words:
        return sample, tokens
    new = {w: pseudo_word(len(w), rng) for w in words}
    names = re.compile(r"\b(" + "|".join(map(re.escape, words)) + r")\b")
    l1 = names.sub(lambda m: new[m.group(0)], sample.l1_text)
    l2 = names.sub(lambda m: new[m.group(0)], sample.l2_text)
    off = ByteTokenizer.OFFSET
    row = tokens[0].astype(np.int64)
    raw = bytes(int(x - off) if x >= off else 0 for x in row)  # specials -> NUL, never part of a name
    pat = re.compile(rb"\b(" + b"|".join(re.escape(w.encode()) for w in words) + rb")\b")
    renamed = np.frombuffer(pat.sub(lambda m: new[m.group(0).decode()].encode(), raw), dtype=np.uint8)
    tokens = tokens.copy()
    tokens[0] = np.where(row >= off, renamed.astype(np.int64) + off, row)
    return dataclasses.replace(sample, l1_text=l1, l2_text=l2), tokens


def random_l1(rng: random.Random, max_bytes: int = RANDOM_L1_BYTES[1]) -> str:
    """An L1 text of random pseudo-words in short lines, about a profile's length (cut to `max_bytes`)."""
    lines: list[str] = []
    while sum(len(x) + 1 for x in lines) < RANDOM_L1_BYTES[0]:
        lines.append(" ".join(pseudo_word(rng.randint(3, 9), rng) if rng.random() < 0.3
                              else pseudo_word(rng.randint(2, 8), rng, capital=False) for _ in range(rng.randint(2, 6))))
    return "\n".join(lines)[:min(RANDOM_L1_BYTES[1], max_bytes)]


def reading_drill(sample: Sample, tokens: np.ndarray, rng: random.Random, span: tuple[int, int],
                  window: int) -> tuple[Sample, np.ndarray]:
    """The row as a reading drill: its text channel writes a random 'span'-long piece of its L1 text from a
    random tick that lies inside the trained `window` of dialog steps; text loss only."""
    ids = ByteTokenizer().encode(sample.l1_text)
    T = tokens.shape[1]
    if not ids or T < DRILL_LEAD + 4:
        return sample, tokens
    n = rng.randint(min(span[0], len(ids)), min(span[1], len(ids)))
    a0 = rng.randrange(0, len(ids) - n + 1)
    n = min(n, T - DRILL_LEAD - 2)
    end = max((x.end for x in sample.text), default=T)  # the row's last supervised text tick
    hi = T - n - 1
    start = rng.randint(min(max(0, end - window + 2), hi), hi)
    tokens = tokens.copy()
    tokens[0, max(0, start - DRILL_CLEAR):start + n + DRILL_LEAD] = ByteTokenizer.pad_id
    tokens[0, start:start + n] = ids[a0:a0 + n]
    return dataclasses.replace(sample, text=(Span(max(0, start - DRILL_LEAD), start + n),), speak=()), tokens


@dataclasses.dataclass(frozen=True)
class DrillMix:
    """How often a training row is transformed (each a probability per row)."""

    fresh_names: float = 0.0  # rename the row's people
    drills: float = 0.0  # turn the row into a reading drill
    random_l1: float = 0.0  # of the drills: read random pseudo-words instead of the profile
    span: tuple[int, int] = (24, 120)  # drill length in bytes (min, max)

    @property
    def active(self) -> bool:
        return self.fresh_names > 0 or self.drills > 0

    def check(self) -> list[str]:
        """What is wrong with it, one line per problem (empty when fine)."""
        bad = [f"{k} must be in [0, 1] (got {getattr(self, k)})" for k in ("fresh_names", "drills", "random_l1")
               if not 0 <= getattr(self, k) <= 1]
        if not 1 <= self.span[0] <= self.span[1]:
            bad.append(f"drill span must be 1 <= min <= max (got {self.span})")
        return bad

    def apply(self, sample: Sample, tokens: np.ndarray, rng: random.Random, window: int, n1: int
              ) -> tuple[Sample, np.ndarray]:
        """The row after this mix's transforms (drawn from `rng`); `window`: dialog steps a row trains on,
        `n1`: the Level-1 MemChunk's steps (a random L1 must fit it)."""
        if rng.random() < self.fresh_names:
            sample, tokens = rename_people(sample, tokens, rng)
        if rng.random() < self.drills:
            if rng.random() < self.random_l1:
                sample = dataclasses.replace(sample, l1_text=random_l1(rng, n1))
            sample, tokens = reading_drill(sample, tokens, rng, self.span, window)
        return sample, tokens
