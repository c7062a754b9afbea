"""Does the dialog model hear noised speech better if its listen embeddings are a linear image of the codec?

The trigger gained noised F1@5 when its audio code embeddings started from the codebook centroids
(session 59, README "episodic_trigger"): the trained codec writes other codes for noised speech nearly
everywhere, and an embedding that follows the centroids reads a moved code almost as the clean one. The
dialog model's listen embeddings already start from the codec (`egomem.training.listen.init_listen_embeddings`:
the seeded random table plus an image of each code's latent vector), so the question here is the other half:
does the part of each table that is *not* a linear function of the code's latent vector (the random rows it
started with, and what training put there) cost it under noise?

For each of the 8 listen codebooks this fits the trained table, codes 0-2047, by least squares as
`[v, 1] @ W` (v the code's latent vector, `listen.code_vectors`), prints the fit's R^2, and writes the model
with each table replaced by `fit + keep * (table - fit)` for each `--keep` (0: the linear image only). The
files load as the shipped one does; compare them with `egomem eval-dialog --peer NAME=FILE` in one run:

    python bench/diag_listen_projection.py --out runs/s59/proj --keep 0 0.5
    egomem eval-dialog --data runs/s46/l2/heldout --weights runs/s59/proj/keep0.safetensors --name keep0 \\
        --peer keep0.5=runs/s59/proj/keep0.5.safetensors --peer shipped=egomem/data/dialog_tiny.safetensors \\
        --judge rules --temperature 0 --start-temperature 1.0 --new-person restart --draws 3 --seed 0 \\
        --fps-ticks 0 --out bench/results/dialog_listen_projection_eval.json

Session 59 (`bench/results/dialog_listen_projection_eval.json`, the two files named proj-all / proj-half there;
the card's held-out set, 3 draws): R^2 0.99
for codebooks 0-1, 0.87 / 0.72 / 0.48 / 0.30 / 0.19 / 0.13 for 2-7. Level-1 Fact Score clean / noised:
shipped 0.865 / 0.758, keep 0.5 0.865 / 0.760, keep 0 0.851 / 0.774 — within the draws' spread (one draw
moves by up to 0.05); the noised gap is not in the tables' non-linear part. No file shipped. (A rerun writes
files equal to those up to one bfloat16 step in a few entries: the least-squares solve is not bit-stable.)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from egomem.codec.mimi import build_mimi
from egomem.config import REPO_ROOT, MimiConfig
from egomem.dialog.card import SHIPPED_TINY_DIALOG
from egomem.training.listen import code_vectors


def linear_image(table: torch.Tensor, vectors: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The least-squares fit of `table`'s first `card` rows by `[vectors, 1] @ W`, and its R^2."""
    card = vectors.shape[0]
    rows = table[:card].float()
    x = torch.cat([vectors, torch.ones(card, 1)], 1)
    fit = x @ torch.linalg.lstsq(x, rows).solution
    return fit, 1.0 - float(((fit - rows) ** 2).sum() / ((rows - rows.mean(0)) ** 2).sum())


def blend(table: torch.Tensor, fit: torch.Tensor, keep: float) -> torch.Tensor:
    """`table` [card + 1, dim] with its first `card` rows moved to `fit + keep * (rows - fit)`; the last row
    (the initial token) stays."""
    out, card = table.clone(), fit.shape[0]
    out[:card] = (fit + keep * (table[:card].float() - fit)).to(table.dtype)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", type=Path, default=SHIPPED_TINY_DIALOG, help="dialog model (a Moshi LMModel state dict)")
    p.add_argument("--keep", type=float, nargs="+", default=[0.0, 0.5],
                   help="share of each table's non-linear part kept, one file per value")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "listen_projection")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    state, meta = load_file(args.weights), safe_open(args.weights, "pt").metadata()
    vectors = code_vectors(build_mimi(MimiConfig(), device="cpu")).float()  # [n_q, card, D]
    n_q = vectors.shape[0]
    audio = sorted(int(k.split(".")[1]) for k in state if k.startswith("emb.") and k.endswith(".weight"))
    listen = audio[-n_q:]  # the last n_q audio embeddings are the user's (moshi's LMModel layout)
    keys = [f"emb.{i}.weight" for i in listen]
    fits = [linear_image(state[key], vectors[k]) for k, key in enumerate(keys)]  # once, for every --keep
    for k, (_, r2) in enumerate(fits):
        print(f"listen codebook {k}: R^2 of the linear image {r2:.3f}")
    args.out.mkdir(parents=True, exist_ok=True)
    for keep in args.keep:
        new = dict(state)
        for key, (fit, _) in zip(keys, fits, strict=True):
            new[key] = blend(state[key], fit, keep)
        path = args.out / f"keep{keep:g}.safetensors"
        save_file(new, str(path), metadata=meta)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
