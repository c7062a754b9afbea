"""Training batches: samples of the MemChunk corpus as the tensors `forward` and `masked_loss` take.

A sample (types.Sample) is a stream id, the L1 / L2 MemChunk texts in view and the dialog frames whose
text / speak tokens are supervised. `make_batch` turns a list of (sample, aligned stream `[17, T]`) into

- chunks `[B, K, n1 + n2]`: `memchunk_inputs` (the engine's own) of the tokenised L1 and L2 texts (paper §4.1: positions 0..n1-1
  hold L1, n1..n1+n2-1 hold L2; an empty chunk is all text pad and still attended);
- stream `[B, K, T]`: each sample's dialog, cropped to end at its last supervised tick (the frames after
  it only feed ticks whose loss does not count), right-padded to the batch's longest;
- text_mask / speak_mask `[B, T]` over frames (masked_loss shifts the speak mask by each codebook's delay).

`SampleOrder` is the seeded order in which samples are drawn (a fresh permutation per epoch), with a
position that a checkpoint saves so a resumed run draws exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from moshi.models.lm import LMModel

from egomem.dialog.engine import memchunk_inputs
from egomem.dialog.tokenizer import TextTokenizer

from .forward import N_GEN
from .types import Sample, Span


class SampleError(ValueError):
    """A sample cannot be trained on (names the sample and what to fix)."""


def sample_name(sample: Sample) -> str:
    """How errors and logs name a sample: stream, kind, dialog and turn."""
    return f"{sample.stream}/{sample.kind}/dialog{sample.dialog}/turn{sample.turn}"


@dataclass
class Batch:
    chunks: torch.Tensor  # [B, K, n1 + n2] MemChunk rows
    stream: torch.Tensor  # [B, K, T] aligned dialog frames (right-padded)
    text_mask: torch.Tensor  # [B, T] bool: text frame supervised
    speak_mask: torch.Tensor  # [B, T] bool: speak frame supervised (all 8 codebooks)
    lengths: list[int]  # real (unpadded) frames per row
    crop_start: list[int]  # dialog frame of each row's frame 0 (left crop, see make_batch)
    names: list[str]

    def to(self, device: str | torch.device) -> Batch:
        return Batch(self.chunks.to(device), self.stream.to(device), self.text_mask.to(device),
                     self.speak_mask.to(device), self.lengths, self.crop_start, self.names)


def _check_spans(sample: Sample) -> None:
    name = sample_name(sample)
    for what, spans in (("text", sample.text), ("speak", sample.speak)):
        for s in spans:
            if not (isinstance(s, Span) and 0 <= s.start <= s.end):
                raise SampleError(f"sample {name}: {what} span {s!r} is not a half-open range 0 <= start <= end")
    if not any(s.end > s.start for s in (*sample.text, *sample.speak)):
        raise SampleError(f"sample {name} supervises nothing: its text and speak spans are all empty; "
                          f"drop it from samples.jsonl (it would contribute no loss)")


def chunk_tokens(tokenizer: TextTokenizer, sample: Sample, n1: int, n2: int) -> tuple[list[int], list[int]]:
    """The sample's L1 / L2 MemChunk texts as token ids; an error naming the sample when one does not fit."""
    out = []
    for level, text, cap in ((1, sample.l1_text, n1), (2, sample.l2_text, n2)):
        ids = tokenizer.encode(text) if text else []
        if len(ids) > cap:
            raise SampleError(f"sample {sample_name(sample)}: its Level-{level} MemChunk text is {len(ids)} tokens, "
                              f"the chunk holds {cap} steps; cut it when writing the dataset as serving does "
                              f"(egomem.dialog.memchunk_text.fit: whole lines up to the chunk size)")
        out.append(ids)
    return out[0], out[1]


def validate_samples(samples: list[Sample], tokenizer: TextTokenizer, n1: int, n2: int) -> None:
    """Check every sample's spans and chunk lengths up front, so a bad one fails the run at step 0."""
    if not samples:
        raise SampleError("the dataset has no samples: write some with egomem.training.dataset.write_dataset")
    for s in samples:
        _check_spans(s)
        chunk_tokens(tokenizer, s, n1, n2)


def _frame_mask(spans: tuple[Span, ...], start: int, length: int) -> torch.Tensor:
    """Frames of `spans` (dialog frames) inside the crop [start, start + length), as a bool [length]."""
    m = torch.zeros(length, dtype=torch.bool)
    for s in spans:
        a, b = max(s.start - start, 0), min(s.end - start, length)
        if b > a:
            m[a:b] = True
    return m


def from_dialog_start(sample: Sample, tokens: np.ndarray, start: int) -> tuple[Sample, np.ndarray]:
    """The row as a stream that begins at frame `start` (where its person's conversation began): frames before
    it dropped, spans shifted. What the model sees when serving restarts the stream for a new person
    (`[dialog] new_person = "restart"`; finetune's `context = "dialog"`)."""
    if not 0 <= start <= tokens.shape[1]:
        raise SampleError(f"sample {sample_name(sample)}: its dialog starts at frame {start}, outside stream "
                          f"{sample.stream}'s {tokens.shape[1]} frames; the layouts and streams disagree")
    if any(s.start < start for s in (*sample.text, *sample.speak) if s.end > s.start):
        raise SampleError(f"sample {sample_name(sample)}: a supervised span starts before its dialog (frame {start})")

    def shift(spans: tuple[Span, ...]) -> tuple[Span, ...]:
        return tuple(Span(s.start - start, s.end - start) for s in spans)

    return replace(sample, text=shift(sample.text), speak=shift(sample.speak)), tokens[:, start:]


def make_batch(lm: LMModel, tokenizer: TextTokenizer, items: list[tuple[Sample, np.ndarray]], n1: int, n2: int,
               max_steps: int | None = None) -> Batch:
    """One batch of (sample, aligned stream `[17, T]`) pairs (module docstring).

    `max_steps` is the longest dialog a row may hold: by default `lm.context - n1 - n2`, the serving
    engine's dialog ring (its KV cache holds the chunks and the last `max_steps` dialog steps).
    """
    if not items:
        raise ValueError("make_batch needs at least one sample")
    K = lm.num_codebooks
    max_delay = max(lm.delays[1:N_GEN])  # speak frame f is generated at tick f + d_k
    if max_steps is None:
        if lm.context is None:
            raise ValueError("this LMModel has no context length; pass max_steps")
        max_steps = lm.context - n1 - n2
    if max_steps <= max_delay:
        raise ValueError(f"max_steps {max_steps} leaves no dialog after the {n1} + {n2} MemChunk steps; "
                         f"the model's context ({lm.context}) must exceed n1 + n2 + {max_delay}")
    chunks, streams, tmasks, smasks, lengths, starts, names = [], [], [], [], [], [], []
    for sample, tokens in items:
        name = sample_name(sample)
        _check_spans(sample)
        tokens = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
        if tokens.dim() != 2 or tokens.shape[0] != K:
            raise SampleError(f"sample {name}: stream {sample.stream} has shape {tuple(tokens.shape)}, "
                              f"expected [{K}, T] (text, 8 speak, 8 listen rows per frame)")
        T_stream = tokens.shape[1]
        text_end = max((s.end for s in sample.text if s.end > s.start), default=0)
        speak_end = max((s.end for s in sample.speak if s.end > s.start), default=0)
        if max(text_end, speak_end) > T_stream:
            raise SampleError(f"sample {name}: its spans reach frame {max(text_end, speak_end)} but stream "
                              f"{sample.stream} has {T_stream} frames; the samples and streams disagree")
        # Last tick whose loss counts: text frame f at tick f, speak frame f up to tick f + max_delay.
        end = min(T_stream, max(text_end, speak_end + max_delay))
        # A dialog longer than the engine's ring is cropped from the LEFT: when serving, the ring holds only
        # the last `max_steps` steps, with the chunks rotated on to just before the oldest of them
        # (docs/kv-cache.md#positions-rotate-on-read), so the supervised end must keep its last `max_steps`
        # steps of context; supervised frames before the crop are dropped (their spans clipped).
        start = max(0, end - max_steps)
        crop = tokens[:, start:end]  # [K, L]
        L = crop.shape[1]
        text_rows, audio_rows = crop[0], crop[1:]
        if int(text_rows.min()) < 0 or int(text_rows.max()) >= lm.text_card:
            raise SampleError(f"sample {name}: text tokens of stream {sample.stream} span {int(text_rows.min())}.."
                              f"{int(text_rows.max())}, outside the model's text vocabulary [0, {lm.text_card}); "
                              f"was the dataset written with another tokenizer?")
        if int(audio_rows.min()) < 0 or int(audio_rows.max()) >= lm.card:
            raise SampleError(f"sample {name}: audio codes of stream {sample.stream} span {int(audio_rows.min())}.."
                              f"{int(audio_rows.max())}, outside the model's codebooks [0, {lm.card}); "
                              f"was the dataset written with another Mimi?")
        l1, l2 = chunk_tokens(tokenizer, sample, n1, n2)
        chunks.append(torch.cat([memchunk_inputs(lm, l1, n1), memchunk_inputs(lm, l2, n2)], dim=1))  # [K, n1 + n2]
        tm = _frame_mask(sample.text, start, L)
        # speak frame f needs tick f + max_delay inside this row (a padded tick is not the real next step)
        sm = _frame_mask(sample.speak, start, L)
        sm[max(L - max_delay, 0):] = False
        if not (tm.any() or sm.any()):
            raise SampleError(f"sample {name}: nothing of its supervised spans is left inside the trained window "
                              f"(frames {start}..{end}); check its spans")
        streams.append(crop)
        tmasks.append(tm)
        smasks.append(sm)
        lengths.append(L)
        starts.append(start)
        names.append(name)
    B, T = len(items), max(lengths)
    # Right padding: the model is causal, so pad frames never reach a real frame's logits; masks drop them.
    stream = torch.full((B, K, T), lm.zero_token_id, dtype=torch.long)  # pad code: moshi's zero (no) token
    stream[:, 0] = lm.text_padding_token_id
    text_mask = torch.zeros(B, T, dtype=torch.bool)
    speak_mask = torch.zeros(B, T, dtype=torch.bool)
    for i, L in enumerate(lengths):
        stream[i, :, :L] = streams[i]
        text_mask[i, :L] = tmasks[i]
        speak_mask[i, :L] = smasks[i]
    return Batch(torch.stack(chunks), stream, text_mask, speak_mask, lengths, starts, names)


class SampleOrder:
    """Seeded sample order: epoch e is the permutation `default_rng([seed, e])` of all samples, batches
    run across epoch ends; `state_dict()` (epoch, position) is what a checkpoint saves."""

    def __init__(self, n: int, seed: int):
        if n <= 0:
            raise ValueError("SampleOrder needs at least one sample")
        self.n, self.seed = n, seed
        self.epoch, self.pos = 0, 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    def take(self, k: int) -> list[int]:
        """The next `k` sample indices."""
        out = []
        while len(out) < k:
            if self.pos == self.n:
                self.epoch, self.pos = self.epoch + 1, 0
                self._perm = self._permutation(self.epoch)
            m = min(k - len(out), self.n - self.pos)
            out.extend(int(i) for i in self._perm[self.pos:self.pos + m])
            self.pos += m
        return out

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n, "seed": self.seed, "epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if (state["n"], state["seed"]) != (self.n, self.seed):
            raise ValueError(f"the checkpoint's sample order is over {state['n']} samples with seed {state['seed']}; "
                             f"this run has {self.n} with seed {self.seed}: the data or seed changed")
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._perm = self._permutation(self.epoch)
