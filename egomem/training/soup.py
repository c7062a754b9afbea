"""`egomem soup-dialog`: the weighted average of dialog models fine-tuned from one start (a model soup).

    egomem soup-dialog --weights egomem/data/dialog_tiny.safetensors runs/vq/run/lm.safetensors --out runs/soup

Fine-tunes of one model stay in one basin of the loss, and the average of their weights often scores above
each of them (Wortsman et al. 2022, "Model soups"; Ilharco et al. 2023 call the difference to the start a task
vector). Here it trades what two stages of the lineage learnt (docs/training.md "A soup of two stages"). The
ingredients must share the architecture (same keys and shapes), the codec whose codes they learnt and how they
meet a new person (`context`); each is read from the file's own metadata (a shipped checkpoint) or from the
`model_card.json` beside it (an `egomem finetune` run). The output is a run folder as `egomem finetune` leaves
one (float32 `lm.safetensors` and `model_card.json`, whose `soup` lists the ingredients and their weights), so
`egomem eval-dialog --weights <out>/lm.safetensors` and `egomem ship-dialog --run <out>` take it unchanged.
The mean is computed and written one tensor at a time, so a 7B soup needs the memory of one tensor per
ingredient, not of the models (the float32 file itself is 4 bytes a parameter: `ship-dialog` writes bf16).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


class SoupError(ValueError):
    """The ingredients cannot be averaged (missing, another architecture, another codec or context)."""


def _ingredient_card(weights: Path) -> dict:
    """What an ingredient says about itself: its safetensors metadata, completed by the run's model card."""
    from egomem.dialog.card import checkpoint_metadata

    meta = checkpoint_metadata(weights)
    card_path = weights.parent / "model_card.json"
    card = {}
    if weights.name == "lm.safetensors" and card_path.is_file():
        try:
            card = json.loads(card_path.read_text())
        except ValueError as e:
            raise SoupError(f"{card_path} is not JSON ({e}): restore the run's model card or remove it") from e
    data = card.get("data", {})
    return {
        "weights": str(weights),
        "preset": meta.get("preset") or card.get("preset"),
        "context": meta.get("context") or card.get("config", {}).get("context"),
        "codec": meta.get("codec") or data.get("codec"),
        "tokenizer": data.get("tokenizer"),
        "steps": meta.get("steps") or card.get("steps"),
    }


def _same(ingredients: list[dict], key: str) -> str | None:
    """The one value of `key` the ingredients that know it agree on (None when none knows it)."""
    known = {i[key] for i in ingredients if i[key] not in (None, "None")}
    if len(known) > 1:
        which = ", ".join(f"{i['weights']}: {i[key]}" for i in ingredients)
        raise SoupError(f"the ingredients disagree on {key} ({which}): only fine-tunes of one model, trained on one "
                        f"codec's codes and meeting people the same way, can be averaged")
    return known.pop() if known else None


_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_FLOATS = ("F64", "F32", "F16", "BF16")


def _mean_layout(weights: list[Path], files: list) -> dict[str, tuple[str, list[int]]]:
    """Per tensor name, the soup's safetensors dtype (float32 for a float) and shape; refuses ingredients with other
    tensors or shapes, or integer tensors (counts, indices: one value, not a mean) that differ."""
    import torch

    keys = sorted(files[0].keys())
    layout: dict[str, tuple[str, list[int]]] = {}
    for w, f in zip(weights, files):
        if sorted(f.keys()) != keys:
            extra = sorted(set(f.keys()) ^ set(keys))[:3]
            raise SoupError(f"{w} has other tensors than {weights[0]} ({', '.join(extra)} ...): another architecture")
        for k in keys:
            info = f.get_slice(k)
            dtype, shape = info.get_dtype(), list(info.get_shape())
            if k not in layout:
                layout[k] = ("F32" if dtype in _FLOATS else dtype, shape)
            elif shape != layout[k][1]:
                raise SoupError(f"{w}: {k} is {tuple(shape)}, {tuple(layout[k][1])} in {weights[0]}")
            elif layout[k][0] not in _FLOATS and not torch.equal(f.get_tensor(k), files[0].get_tensor(k)):
                raise SoupError(f"{w}: integer tensor {k} differs from {weights[0]}'s: it cannot be averaged")
    return layout


def _write_mean(files: list, mix: list[float], layout: dict[str, tuple[str, list[int]]], path: Path,
                metadata: dict[str, str]) -> None:
    """Write sum_i mix_i * files_i to `path` in safetensors' format, one tensor at a time: memory holds one tensor
    of each ingredient, never a whole model (a 7B soup streams from disk to disk)."""
    import math

    import torch

    header: dict[str, object] = {"__metadata__": metadata}
    at = 0
    for k, (dtype, shape) in layout.items():
        n = _BYTES[dtype] * math.prod(shape)
        header[k] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + n]}
        at += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format pads its JSON header to 8 bytes
    with path.open("wb") as fh:
        fh.write(len(blob).to_bytes(8, "little") + blob)
        for k, (dtype, _) in layout.items():
            mean = files[0].get_tensor(k)
            if dtype == "F32":
                mean = mean.to(torch.float32) * mix[0]
                for m, f in zip(mix[1:], files[1:]):
                    mean.add_(f.get_tensor(k).to(torch.float32), alpha=m)
            fh.write(mean.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def soup(weights: list[Path], out: Path, mix: list[float] | None = None, codec: str | None = None) -> dict:
    """Write sum_i mix_i * weights_i (mix normalised to sum 1; uniform by default) as a run folder `out`;
    its model card. With `codec` (the fingerprint of the codec serving runs), refuse ingredients that learnt
    another codec's codes."""
    import contextlib

    from safetensors import safe_open

    if len(weights) < 2:
        raise SoupError("--weights takes at least two checkpoints")
    mix = [1.0] * len(weights) if mix is None else list(mix)
    if len(mix) != len(weights):
        raise SoupError(f"--mix gives {len(mix)} weights for {len(weights)} checkpoints")
    if any(not m >= 0 for m in mix) or sum(mix) <= 0:
        raise SoupError(f"--mix takes non-negative weights with a positive sum, got {mix}")
    mix = [m / sum(mix) for m in mix]
    for w in weights:
        if not w.is_file():
            raise SoupError(f"{w} not found: --weights takes Moshi-format LM safetensors files (a shipped checkpoint "
                            f"or a finetune run's lm.safetensors)")
    ingredients = [_ingredient_card(w) for w in weights]
    preset, context, codec_learnt, tokenizer = (_same(ingredients, k) for k in ("preset", "context", "codec", "tokenizer"))
    if codec is not None and codec_learnt not in (None, codec):
        raise SoupError(f"the ingredients learnt the codes of codec {codec_learnt}, the configured Mimi is {codec}: "
                        f"served with it the soup would not hear the user (pass --any-codec to average them anyway)")

    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(safe_open(str(w), framework="pt")) for w in weights]
        layout = _mean_layout(weights, files)
        out.mkdir(parents=True, exist_ok=True)
        path, tmp = out / "lm.safetensors", out / "lm.safetensors.tmp"
        # "trained_by" as finetune writes it: every ingredient was fine-tuned; serving and doctor read a soup alike
        _write_mean(files, mix, layout, tmp, {"format": "moshi-lm", "preset": preset or "tiny",
                                              "trained_by": "egomem finetune", "context": context or "stream"})
    tmp.replace(path)
    card = {
        "format": "egomem-finetune-v1", "weights": path.name, "preset": preset or "tiny", "dtype": "float32",
        "steps": None,  # a soup has no steps of its own: its ingredients' are under "soup"
        "soup": [{**i, "mix": m} for i, m in zip(ingredients, mix)],
        "data": {"codec": codec_learnt, "tokenizer": tokenizer},
        "config": {"context": context or "stream"},
    }
    (out / "model_card.json").write_text(json.dumps(card, indent=1) + "\n")
    return card


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="egomem soup-dialog", description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", type=Path, nargs="+", required=True,
                   help="two or more Moshi-format LM safetensors files fine-tuned from one start")
    p.add_argument("--mix", type=float, nargs="+", help="one weight per checkpoint (normalised; default: uniform)")
    p.add_argument("--out", type=Path, required=True, help="run folder: lm.safetensors and model_card.json")
    p.add_argument("--config", type=Path, help="EgoMem TOML config: its [mimi] is the codec the models must have learnt")
    p.add_argument("--any-codec", action="store_true", help="average models trained on another codec's codes")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from egomem.training.ship import configured_codec

    codec = None if args.any_codec else configured_codec(args.config)
    try:
        card = soup(args.weights, args.out, args.mix, codec)
    except SoupError as e:
        print(f"soup-dialog: {e}", flush=True)
        return 2
    parts = " + ".join(f"{i['mix']:.3g} x {i['weights']}" for i in card["soup"])
    print(f"wrote {args.out / 'lm.safetensors'} = {parts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
