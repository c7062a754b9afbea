"""`egomem ship-dialog`: an `egomem finetune` run's model as a small checkpoint that serving loads with no config.

    egomem ship-dialog --run RUN --start-temperature 1.0          # -> egomem/data/dialog_tiny.safetensors

The run's `lm.safetensors` in `--dtype` (bfloat16 by default: half the bytes of float32; the CPU engine
computes in float32 and casts the weights up on loading), with metadata that says what it is
(`egomem/dialog/card.py` reads it): how it was trained (`context`: "dialog" makes serving restart the stream
for a new person), the decoding it was evaluated with (`start_temperature`), the codec whose codes it learnt
(`codec`: the dataset's codec fingerprint; shipping refuses a run whose codec is not the configured one, and
`doctor` says so when the configured codec changes later), and the run's
steps and data. A model is shipped only after it was evaluated *as shipped*: `egomem eval-dialog --weights
<the shipped file>` (README, "What the tiny model reached").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from egomem.dialog.card import SHIPPED_TINY_DIALOG

DTYPES = ("bfloat16", "float16", "float32")


class ShipError(ValueError):
    """The run folder is not a finished `egomem finetune` run."""


def ship(run: Path, out: Path, dtype: str = "bfloat16", start_temperature: float | None = None,
         note: str = "", codec: str | None = None) -> dict[str, str]:
    """Write `run`'s model to `out` in `dtype` with its metadata; the metadata written. With `codec` (a codec
    fingerprint: the one serving runs), refuse a model whose training data another codec encoded."""
    import torch
    from safetensors.torch import load_file, save_file

    from egomem.dialog.card import checkpoint_metadata

    weights, card_path = run / "lm.safetensors", run / "model_card.json"
    for f in (weights, card_path):
        if not f.is_file():
            raise ShipError(f"{f} not found: --run takes a finished `egomem finetune` run folder")
    if dtype not in DTYPES:
        raise ShipError(f"--dtype takes one of {', '.join(DTYPES)}, got {dtype!r}")
    if start_temperature is not None and not start_temperature >= 0:
        raise ShipError(f"--start-temperature must be >= 0, got {start_temperature}")
    card = json.loads(card_path.read_text())
    learnt = str(card.get("data", {}).get("codec"))
    if codec is not None and learnt != codec:
        raise ShipError(f"{run} learnt the codes of codec {learnt}, the configured Mimi is {codec}: served with it "
                        f"the model would not hear the user (fine-tune on a corpus made with this codec, or pass "
                        f"--any-codec)")
    trained = checkpoint_metadata(weights)
    cast = getattr(torch, dtype)
    state = {k: (v.to(cast) if v.is_floating_point() else v).contiguous() for k, v in load_file(str(weights)).items()}
    meta = {
        "format": "moshi-lm", "preset": str(card.get("preset", trained.get("preset", "tiny"))),
        "trained_by": "egomem finetune", "shipped_by": "egomem ship-dialog", "dtype": dtype,
        # a run from before finetune recorded its context in the weights: its model card's config has it
        "context": trained.get("context") or str(card.get("config", {}).get("context", "stream")),
        "steps": str(card.get("steps")), "codec": learnt,
        "data_fingerprint": str(card.get("data", {}).get("fingerprint_sha256")),
        "data_samples": str(card.get("data", {}).get("samples")),
    }
    meta = {k: v for k, v in meta.items() if v != "None"}  # what the run did not record (a soup: steps, data)
    if card.get("soup"):  # `egomem soup-dialog`: which models, in which proportions
        meta["soup"] = json.dumps([{k: i.get(k) for k in ("weights", "mix", "steps")} for i in card["soup"]])
    if start_temperature is not None:
        meta["start_temperature"] = str(start_temperature)
    if note:
        meta["note"] = note
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    save_file(state, str(tmp), metadata=meta)
    tmp.replace(out)
    return meta


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="egomem ship-dialog", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=Path, required=True, help="a finished `egomem finetune` run folder")
    p.add_argument("--out", type=Path, default=SHIPPED_TINY_DIALOG, help="the shipped checkpoint")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--start-temperature", type=float, help="the turn-start temperature it was evaluated with "
                   "(serving's dialog.start_temperature = 'auto' takes it)")
    p.add_argument("--note", default="", help="one line kept in the metadata (e.g. the command that trained it)")
    p.add_argument("--config", type=Path, help="EgoMem TOML config: its [mimi] is the codec the model must have learnt")
    p.add_argument("--any-codec", action="store_true", help="ship a model trained on another codec's codes")
    return p.parse_args(argv)


def configured_codec(config: Path | None) -> str:
    """The fingerprint of the codec `config` serves (a model must have learnt its codes to hear the user)."""
    from egomem.codec.mimi import build_mimi
    from egomem.config import load_config
    from egomem.trigger.codec import codec_fingerprint

    return codec_fingerprint(build_mimi(load_config(config).mimi))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    codec = None if args.any_codec else configured_codec(args.config)
    try:
        meta = ship(args.run, args.out, args.dtype, args.start_temperature, args.note, codec)
    except ShipError as e:
        print(f"ship-dialog: {e}", flush=True)
        return 2
    size = args.out.stat().st_size / 1e6
    print(f"wrote {args.out} ({size:.1f} MB, {meta['dtype']}, context {meta['context']}, "
          f"start temperature {meta.get('start_temperature', 'none')})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
