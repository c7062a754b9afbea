"""Which dialog weights a config serves, and the serving settings the checkpoint records about itself.

`dialog.weights` unset (tiny preset, `dialog.random_init` false) serves the shipped fine-tuned tiny EgoMem
model, `egomem/data/dialog_tiny.safetensors` (made by `egomem ship-dialog` from an `egomem finetune` run;
README "What the tiny model reached"). A checkpoint written by `egomem finetune` or `ship-dialog` says in its
safetensors metadata how it was trained (`context`: "dialog" = each person's conversation from its start,
so serving restarts the stream for a new person) and, once shipped, how it was evaluated
(`start_temperature`). `[dialog] new_person = "auto"` and `start_temperature = "auto"` take those; a
checkpoint without them gets the paper's "swap" and one draw per token.

Reads only the file's JSON header (no torch), so the orchestrator, which never loads the model, settles
`new_person` exactly as `dialog_lm` does.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from egomem.config import DialogConfig

SHIPPED_TINY_DIALOG = Path(__file__).resolve().parents[1] / "data" / "dialog_tiny.safetensors"
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on its JSON header


@dataclass(frozen=True)
class ServingSettings:
    """What `dialog_lm` and the orchestrator run with once every "auto" is settled."""

    weights: Path | None  # None: the preset's seeded random init
    new_person: str  # "swap" or "restart"
    start_temperature: float | None


def dialog_weights(cfg: DialogConfig) -> Path | None:
    """The file the engine loads: `dialog.weights`, else the shipped tiny model for the tiny preset, else None
    (random init: `dialog.random_init`, or the 7B preset without weights)."""
    if cfg.weights is not None:
        return Path(cfg.weights)
    if cfg.random_init or cfg.preset != "tiny":
        return None
    return SHIPPED_TINY_DIALOG


def checkpoint_metadata(path: Path) -> dict[str, str]:
    """The `__metadata__` strings of a safetensors file; {} when it has none or cannot be read (loading it
    is where a missing or broken file is reported, with what to do)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER_BYTES:
                return {}
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError):
        return {}
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {}


def serving_settings(cfg: DialogConfig) -> ServingSettings:
    """`cfg`'s weights, new-person rule and start temperature, each "auto" read from the checkpoint."""
    weights = dialog_weights(cfg)
    meta = checkpoint_metadata(weights) if weights is not None else {}
    new_person = cfg.new_person
    if new_person == "auto":
        new_person = "restart" if meta.get("context") == "dialog" else "swap"
    start = cfg.start_temperature
    if start == "auto":
        try:
            start = float(meta["start_temperature"])
        except (KeyError, ValueError):
            start = None
    return ServingSettings(weights, new_person, start)
