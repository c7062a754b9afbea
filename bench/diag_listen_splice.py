"""Diagnostic for docs/departures.md D26: how far do spliced listen rows differ from rows encoded whole?

Two datasets made by `egomem make-corpus` with the same households, split and seed, one with `--listen
spliced` (each utterance encoded alone, its codes cut in) and one with `--listen whole` (the users' audio
laid out as one waveform and encoded in one pass, as serving's codec writes a microphone), hold the same
layouts. Per frame kind (the users' speech, the 8 frames after it, other silence) this reports how often
the first codebook and all 8 codebooks of the listen rows agree, on the clean streams (noised copies draw
their noise differently, so they are not compared).

    python bench/diag_listen_splice.py runs/s37b/heldout runs/s42/whole/heldout \
        --out bench/results/diag_listen_splice.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from egomem.training.dataset import Dataset

AFTER = 8  # frames after the end of an utterance counted as "after speech"


def frame_kinds(layout, n_steps: int) -> np.ndarray:
    """Per frame: 0 other silence, 1 the users' speech, 2 within AFTER frames past an utterance."""
    kind = np.zeros(n_steps, np.int8)
    for d in layout.dialogs:
        for u in d.turns:
            if u.user_end > u.user_start:
                kind[u.user_end:u.user_end + AFTER] = 2
    for d in layout.dialogs:
        for u in d.turns:
            kind[u.user_start:u.user_end] = 1
    return kind


def compare(spliced: Dataset, whole: Dataset) -> dict:
    names = ("other silence", "speech", f"{AFTER} frames after speech")
    counts = np.zeros((3, 3), np.int64)  # kind x (frames, first codebook equal, all 8 equal)
    layouts = {lay.stream: lay for lay in whole.layouts}
    for stream, lay in layouts.items():
        a, b = spliced.tokens(stream)[9:], whole.tokens(stream)[9:]
        if a.shape != b.shape:
            raise SystemExit(f"{stream}: shapes {a.shape} and {b.shape} differ; make both sets with the same "
                             f"--households, --split and --seed")
        kind = frame_kinds(lay, a.shape[1])
        for k in range(3):
            m = kind == k
            counts[k] += (m.sum(), (a[0, m] == b[0, m]).sum(), (a[:, m] == b[:, m]).all(0).sum())
    return {names[k]: {"frames": int(n), "first_codebook": round(float(c0 / max(n, 1)), 3),
                       "all_codebooks": round(float(c8 / max(n, 1)), 3)} for k, (n, c0, c8) in enumerate(counts)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("spliced", type=Path, help="a dataset made with make-corpus --listen spliced")
    p.add_argument("whole", type=Path, help="the same households, split and seed made with --listen whole")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    spliced, whole = Dataset(args.spliced), Dataset(args.whole)
    for ds, want in ((spliced, "spliced"), (whole, "whole")):
        got = ds.manifest.get("spec", {}).get("listen", "spliced")  # manifests before session 42: spliced
        if got != want:
            raise SystemExit(f"{ds.path} was made with --listen {got}, expected {want}")
    report = {"spliced": str(args.spliced), "whole": str(args.whole), "clean streams": compare(spliced, whole)}
    for kind, r in report["clean streams"].items():
        print(f"{kind:24s} {r['frames']:7d} frames  first codebook equal {r['first_codebook']:.3f}  "
              f"all 8 equal {r['all_codebooks']:.3f}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
