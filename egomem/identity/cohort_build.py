"""Build the imposter cohort for adaptive s-norm: one embedding per speaker, from public speech.

    python -m egomem.identity.cohort_build --audio-dir DIR --out egomem/data/cohort_resemblyzer_ge2e.npy

DIR is any folder of LibriSpeech-named audio (`<speaker>-<chapter>-<utterance>.flac`); the repository's
tests/data/identity (4 speakers) makes a trial cohort. The shipped file was made this way from a folder
of 251 LibriSpeech train-clean-100 utterances kept outside the repository (one per
speaker; CC BY 4.0, see egomem/data/COHORT_LICENSE.md). Files are taken in sorted order; for every
speaker (the LibriSpeech file-name prefix before the first '-') the embeddings of its utterances are
averaged. Silent/unvoiced files are skipped and reported.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from egomem.config import load_config
from egomem.identity.voice import SpeakerEncoder, build_speaker_encoder

AUDIO_SUFFIXES = (".flac", ".wav", ".ogg")


def speaker_of(path: Path) -> str:
    """LibriSpeech naming: <speaker>-<chapter>-<utterance>.flac."""
    return path.stem.split("-")[0]


def build_cohort(files: Iterable[Path], encoder: SpeakerEncoder, max_size: int = 2000) -> tuple[np.ndarray, list[str]]:
    """Embeddings [N, D] (one unit row per speaker, N <= max_size) and the speakers' ids."""
    import soundfile as sf

    per_speaker: dict[str, list[np.ndarray]] = {}
    for f in sorted(Path(p) for p in files):
        spk = speaker_of(f)
        if spk not in per_speaker and len(per_speaker) >= max_size:
            continue
        pcm, sr = sf.read(f, dtype="float32", always_2d=True)
        res = encoder.encode(pcm.mean(axis=1).astype(np.float32), sr)
        if res.embedding is None:
            print(f"skip {f.name}: only {res.voiced_s:.2f} s of speech", file=sys.stderr)
            continue
        per_speaker.setdefault(spk, []).append(res.embedding)
    speakers = sorted(per_speaker)
    rows = np.stack([np.mean(per_speaker[s], axis=0) for s in speakers]).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True), speakers


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--audio-dir", type=Path, required=True, help="folder searched recursively for LibriSpeech-named audio files "
                                                                   "(e.g. tests/data/identity for a trial cohort)")
    ap.add_argument("--out", type=Path, required=True, help="output .npy [N, D] float32")
    ap.add_argument("--max-size", type=int, default=2000, help="at most this many speakers")
    ap.add_argument("--config", type=Path, default=None, help="egomem TOML (selects the voice backend)")
    args = ap.parse_args(argv)
    files = [p for p in args.audio_dir.rglob("*") if p.suffix.lower() in AUDIO_SUFFIXES]
    if not files:
        ap.error(f"no audio files ({', '.join(AUDIO_SUFFIXES)}) under {args.audio_dir}")
    encoder = build_speaker_encoder(load_config(args.config).identity)
    rows, speakers = build_cohort(files, encoder, args.max_size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.save(args.out, rows)
    print(f"wrote {args.out}: {rows.shape[0]} speakers x {rows.shape[1]} ({encoder.model_id})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
