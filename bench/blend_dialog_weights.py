"""A weight-space blend of two dialog checkpoints (WiSE-FT style): base + alpha x (tuned - base).

Sessions 50 and 52 asked whether a fine-tune's new skill (writing a `<retr>` query) survives part of the
step back towards a model with a better Level 1 (docs/training.md, "Session 52"). The blend keeps the
tuned file's metadata (its model card: context, start temperature, codec) and records the blend in it;
`egomem eval-dialog --weights` and `bench/diag_demo_layout.py` read the result like any fine-tune.

    python bench/blend_dialog_weights.py runs/s51/l1q40/run/lm.safetensors runs/s52/vq/run/lm.safetensors \\
        --alpha 0.5 --out runs/s52/blend05.safetensors
"""

from __future__ import annotations

import argparse
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file


def blend(base: Path, tuned: Path, alpha: float, out: Path) -> int:
    a, b = load_file(base), load_file(tuned)
    if a.keys() != b.keys() or any(a[k].shape != b[k].shape for k in b):
        raise SystemExit(f"{base} and {tuned} are not the same model (their tensors differ in names or shapes)")
    with safe_open(tuned, "pt") as f:
        meta = dict(f.metadata() or {})
    meta["blend"] = f"{base} + {alpha} x ({tuned} - {base})"
    mix = {k: (a[k].float() + alpha * (b[k].float() - a[k].float())).to(b[k].dtype) if b[k].is_floating_point()
           else b[k] for k in b}
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(mix, out, metadata=meta)
    print(f"wrote {out}: {len(mix)} tensors, {meta['blend']}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("base", type=Path, help="the model blended from (alpha 0)")
    p.add_argument("tuned", type=Path, help="the model blended towards (alpha 1); its metadata is kept")
    p.add_argument("--alpha", type=float, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    return blend(args.base, args.tuned, args.alpha, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
