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


def soup(weights: list[Path], out: Path, mix: list[float] | None = None, codec: str | None = None) -> dict:
    """Write sum_i mix_i * weights_i (mix normalised to sum 1; uniform by default) as a run folder `out`;
    its model card. With `codec` (the fingerprint of the codec serving runs), refuse ingredients that learnt
    another codec's codes."""
    import torch
    from safetensors.torch import load_file, save_file

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

    total: dict[str, torch.Tensor] = {}
    for i, (w, m) in enumerate(zip(weights, mix)):
        state = load_file(str(w))
        if i and state.keys() != total.keys():
            extra = sorted(set(state) ^ set(total))[:3]
            raise SoupError(f"{w} has other tensors than {weights[0]} ({', '.join(extra)} ...): another architecture")
        for k, v in state.items():
            if i and v.shape != total[k].shape:
                raise SoupError(f"{w}: {k} is {tuple(v.shape)}, {tuple(total[k].shape)} in {weights[0]}")
            if not v.is_floating_point():  # a count or an index: one value, not a mean
                if i and not torch.equal(v, total[k]):
                    raise SoupError(f"{w}: integer tensor {k} differs from {weights[0]}'s: it cannot be averaged")
                total[k] = v
                continue
            v = v.to(torch.float32)
            total[k] = m * v if i == 0 else total[k].add_(v, alpha=m)

    out.mkdir(parents=True, exist_ok=True)
    path, tmp = out / "lm.safetensors", out / "lm.safetensors.tmp"
    # "trained_by" as finetune writes it: every ingredient was fine-tuned, and serving and doctor read a soup alike
    save_file({k: v.contiguous() for k, v in total.items()}, str(tmp),
              metadata={"format": "moshi-lm", "preset": preset or "tiny", "trained_by": "egomem finetune",
                        "context": context or "stream"})
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
