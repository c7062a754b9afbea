"""The on-disk training dataset (`egomem-memchunk-v1`, docs/training.md#formats): write, read, build.

    <dir>/manifest.json     format, n1, n2, tokenizer, codec fingerprint, seed, generators, counts, spec
    <dir>/people.jsonl      one Household per line
    <dir>/dialogs.jsonl     one Dialog per line (a layout's `index` is a line number here)
    <dir>/layouts.jsonl     one StreamLayout per line: every dialog's and turn's frame boundaries
    <dir>/streams/<id>.npy  int16 [17, T]: the aligned token stream [text, 8 speak, 8 listen] per frame
    <dir>/samples.jsonl     one Sample per line: stream id, kind, MemChunk texts, supervised spans

The manifest is written last, so a folder whose build stopped half-way is not taken for a dataset.
`build_dataset` runs the whole chain: corpus -> streams (clean + noised copy) -> samples -> disk.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from egomem.dialog.tokenizer import TextTokenizer
from egomem.training.masks import ChunkTexts, count_kinds, for_stream, stream_samples
from egomem.training.streams import (
    N_ROWS,
    StreamBuilder,
    StreamLayout,
    StreamSpec,
    conversation_starts,
    group_dialogs,
    layout_from_json,
    noise_draw,
)
from egomem.training.tts import HELDOUT_VOICES, MODEL_VOICE, TRAIN_VOICES
from egomem.training.types import (
    Dialog,
    Household,
    Sample,
    dialog_from_json,
    household_from_json,
    sample_from_json,
    to_json,
)

FORMAT = "egomem-memchunk-v1"
_REQUIRED = ("format", "n1", "n2", "tokenizer", "codec", "seed", "generators", "counts")
_STREAM_ID = re.compile(r"^[A-Za-z0-9_.-]+$")


NOISED_SUFFIX = "-noised"  # stream id of a stream's noised copy: <id>-noised


class DatasetError(ValueError):
    """A folder is not a (complete, readable) egomem-memchunk-v1 dataset."""


def _not_a_dataset(path: Path, why: str) -> DatasetError:
    return DatasetError(f"not an {FORMAT} dataset: {path} ({why}); build one with "
                        f"egomem.training.dataset.build_dataset")


def _write_jsonl(path: Path, rows: Iterable[Any]) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def _write_stream(root: Path, stream: str, tokens: np.ndarray) -> None:
    if not _STREAM_ID.match(stream):
        raise ValueError(f"stream id {stream!r} must match {_STREAM_ID.pattern} (it names a file)")
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or tokens.shape[0] != N_ROWS:
        raise ValueError(f"stream {stream}: tokens must be [{N_ROWS}, T], got {list(tokens.shape)}")
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(np.int16).max):
        raise ValueError(f"stream {stream}: token ids must lie in [0, 32767] to store as int16")
    np.save(root / "streams" / f"{stream}.npy", tokens.astype(np.int16))


def _start(out_dir: Path) -> Path:
    out_dir = Path(out_dir)
    if (out_dir / "manifest.json").exists():
        raise FileExistsError(f"{out_dir} already holds a dataset; choose a new folder or delete it first")
    (out_dir / "streams").mkdir(parents=True, exist_ok=True)
    return out_dir


def _finish(out_dir: Path, manifest: dict[str, Any], households: Sequence[Household], dialogs: Sequence[Dialog],
            layouts: Sequence[StreamLayout], samples: Sequence[Sample]) -> None:
    manifest = {"format": FORMAT, **manifest}
    counts = {"households": len(households), "dialogs": len(dialogs), "layouts": len(layouts),
              "streams": len(list((out_dir / "streams").glob("*.npy"))), "samples": len(samples),
              **count_kinds(samples)}
    manifest["counts"] = {**manifest.get("counts", {}), **counts}
    manifest.setdefault("generators", dict(Counter(d.generator for d in dialogs)))
    missing = [k for k in _REQUIRED if k not in manifest]
    if missing:
        raise ValueError(f"dataset manifest lacks {missing}")
    streams = {p.stem for p in (out_dir / "streams").glob("*.npy")}
    unknown = sorted({s.stream for s in samples} - streams)
    if unknown:
        raise ValueError(f"samples name streams that were not written: {unknown[:5]}")
    _write_jsonl(out_dir / "people.jsonl", (to_json(h) for h in households))
    _write_jsonl(out_dir / "dialogs.jsonl", (to_json(d) for d in dialogs))
    _write_jsonl(out_dir / "layouts.jsonl", (to_json(s) for s in layouts))
    _write_jsonl(out_dir / "samples.jsonl", (to_json(s) for s in samples))
    tmp = out_dir / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1, ensure_ascii=False))
    os.replace(tmp, out_dir / "manifest.json")  # last: marks the dataset complete


def write_dataset(out_dir: Path, manifest: dict[str, Any], households: Sequence[Household], dialogs: Sequence[Dialog],
                  streams: dict[str, np.ndarray], samples: Sequence[Sample],
                  layouts: Sequence[StreamLayout] = ()) -> Path:
    """Write a whole dataset held in memory (streams: id -> int [17, T]); the manifest gets format and counts."""
    out_dir = _start(out_dir)
    for sid, tokens in streams.items():
        _write_stream(out_dir, sid, tokens)
    _finish(out_dir, manifest, households, dialogs, layouts, samples)
    return out_dir


class Dataset:
    """A dataset folder, validated on open; people, dialogs, layouts and samples are read on first use."""

    def __init__(self, path: Path):
        self.path = Path(path)
        mpath = self.path / "manifest.json"
        if not mpath.is_file():
            raise _not_a_dataset(self.path, "no manifest.json")
        try:
            manifest = json.loads(mpath.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _not_a_dataset(self.path, f"manifest.json is not JSON: {e}") from e
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
            raise _not_a_dataset(self.path, f"manifest format is {got!r}")
        missing = [k for k in _REQUIRED if k not in manifest]
        if missing:
            raise _not_a_dataset(self.path, f"manifest lacks {missing}")
        for name in ("people.jsonl", "dialogs.jsonl", "samples.jsonl", "streams"):
            if not (self.path / name).exists():
                raise _not_a_dataset(self.path, f"{name} is missing")
        self.manifest: dict[str, Any] = manifest
        self._cache: dict[str, list] = {}
        self._starts: dict[str, list[int]] | None = None

    def _lines(self, name: str, parse) -> list:
        if name not in self._cache:
            path = self.path / name
            rows = []
            if path.exists():
                with path.open(encoding="utf-8") as f:
                    for i, line in enumerate(f, 1):
                        try:
                            rows.append(parse(json.loads(line)))
                        except (json.JSONDecodeError, KeyError, TypeError) as e:
                            raise _not_a_dataset(self.path, f"{name} line {i} is not valid: {e!r}") from e
            self._cache[name] = rows
        return self._cache[name]

    @property
    def households(self) -> list[Household]:
        return self._lines("people.jsonl", household_from_json)

    @property
    def dialogs(self) -> list[Dialog]:
        return self._lines("dialogs.jsonl", dialog_from_json)

    @property
    def layouts(self) -> list[StreamLayout]:
        """The streams' layouts; one with a noised copy says its SNR (`meta["noise_snr_db"]`), recovered from the
        build's seed for a dataset built before layouts recorded it (the file's order is the build's)."""
        if "layouts.jsonl" not in self._cache:
            rows = self._lines("layouts.jsonl", layout_from_json)
            snr_range = self.manifest.get("spec", {}).get("noise_snr_db")
            for i, lay in enumerate(rows):
                noised = (self.path / "streams" / f"{lay.stream}{NOISED_SUFFIX}.npy").is_file()
                if noised and snr_range and "noise_snr_db" not in lay.meta:
                    rows[i] = replace(lay, meta={**lay.meta,
                                                 "noise_snr_db": noise_draw(self.manifest["seed"], i, snr_range)[1]})
        return self._cache["layouts.jsonl"]

    @property
    def samples(self) -> list[Sample]:
        return self._lines("samples.jsonl", sample_from_json)

    def conversation_starts(self, stream: str) -> list[int]:
        """Per dialog of `stream`, where its conversation began (`streams.conversation_starts`); a noised copy
        shares its clean stream's layout."""
        if self._starts is None:
            self._starts = {s.stream: conversation_starts(s) for s in self.layouts}
        base = stream.removesuffix(NOISED_SUFFIX)
        if base not in self._starts:
            raise DatasetError(f"{self.path}: stream {stream!r} has no layout in layouts.jsonl; rebuild the dataset")
        return self._starts[base]

    def tokens(self, stream: str) -> np.ndarray:
        """The aligned stream int64 [17, T]."""
        path = self.path / "streams" / f"{stream}.npy"
        if not _STREAM_ID.match(stream) or not path.is_file():
            raise KeyError(f"dataset {self.path} has no stream {stream!r}")
        a = np.load(path)
        if a.ndim != 2 or a.shape[0] != N_ROWS or a.dtype != np.int16:
            raise _not_a_dataset(self.path, f"streams/{stream}.npy is {a.dtype} {list(a.shape)}, "
                                            f"expected int16 [{N_ROWS}, T]")
        return a.astype(np.int64)


def check_chunk_texts(samples: Iterable[Sample], tokenizer: TextTokenizer, n1: int, n2: int) -> None:
    """Every sample's L1 / L2 text must fit its MemChunk (n1 / n2 tokens): say which does not."""
    seen: set[tuple[str, str]] = set()
    for s in samples:
        for which, text, cap in (("L1", s.l1_text, n1), ("L2", s.l2_text, n2)):
            if (which, text) in seen:
                continue
            seen.add((which, text))
            n = len(tokenizer.encode(text))
            if n > cap:
                raise ValueError(f"{which} MemChunk text of sample (stream {s.stream}, dialog {s.dialog}) has {n} "
                                 f"tokens, over the chunk's {cap}: shorten the profile / retrieval budget "
                                 f"or raise n1/n2 ({text[:60]!r}...)")


def build_dataset(out_dir: Path, households: Sequence[Household], dialogs: Sequence[Dialog], memory_texts: ChunkTexts,
                  codec: torch.nn.Module, seed: int, streams_per_household: int | None = None,
                  dialogs_per_stream: tuple[int, int] = (2, 4), spec: StreamSpec | None = None,
                  tokenizer: TextTokenizer | None = None, tokenizer_name: str = "byte", n1: int = 512, n2: int = 256,
                  noised: bool = True, progress: bool = True, corpus_options: dict[str, Any] | None = None
                  ) -> Dataset:
    """Corpus -> streams (+ noised copies) -> samples -> `out_dir`. Each household's dialogs are cut into
    streams of `dialogs_per_stream` dialogs (at most `streams_per_household` streams each, None: all).
    `corpus_options`: how the dialogs were generated (make-corpus's options), recorded in the manifest."""
    from tqdm import tqdm

    from egomem.trigger.codec import codec_fingerprint

    homes = {h.main.user_id for h in households}
    orphans = sorted({d.household for d in dialogs} - homes)
    if orphans:
        raise ValueError(f"dialogs of households not in `households`: {orphans[:5]}")
    out_dir = _start(out_dir)
    builder = StreamBuilder(codec, tokenizer=tokenizer, spec=spec, seed=seed)
    groups = group_dialogs(dialogs, seed, dialogs_per_stream, streams_per_household)
    layouts: list[StreamLayout] = []
    samples: list[Sample] = []
    frames = dropped = 0
    for i, group in enumerate(tqdm(groups, desc="build streams", unit="stream", disable=not progress)):
        sid = f"s{i:06d}"
        stream = builder.build(sid, [(j, dialogs[j]) for j in group], index=i, noised=noised)
        mine = stream_samples(stream.layout, dialogs, memory_texts, meta={"noised": False})
        check_chunk_texts(mine, builder.tokenizer, n1, n2)
        _write_stream(out_dir, sid, stream.tokens)
        samples += mine
        if stream.noised is not None:
            _write_stream(out_dir, f"{sid}{NOISED_SUFFIX}", stream.noised)
            samples += for_stream(mine, f"{sid}{NOISED_SUFFIX}", noised=True)
        layouts.append(stream.layout)
        frames += stream.layout.n_steps
        dropped += stream.layout.dropped_turns
    s = builder.spec
    manifest = {
        "n1": n1, "n2": n2, "tokenizer": tokenizer_name, "codec": codec_fingerprint(codec), "seed": seed,
        "generators": dict(Counter(d.generator for d in dialogs)), "corpus_options": corpus_options or {},
        "counts": {"frames": frames, "dropped_turns": dropped, "noised_streams": len(groups) if noised else 0},
        "spec": asdict(s), "dialogs_per_stream": list(dialogs_per_stream),
        "streams_per_household": streams_per_household,
        "voices": {"model": str(MODEL_VOICE), "train": [str(v) for v in TRAIN_VOICES],
                   "heldout": [str(v) for v in HELDOUT_VOICES]},
    }
    _finish(out_dir, manifest, households, dialogs, layouts, samples)
    return Dataset(out_dir)
