"""Diagnostic for issue #13: does the fine-tuned model use what the user says?

A Level-1 answer ("You live in Milan.") is only right when the model heard the question ("Where do
I live?"); a greeting needs no words of the user. This scores a model teacher-forced on the held-out
Level-1 samples of a dataset (clean streams), once as recorded and once with the listen rows silenced (every frame
holds the stream's first frame's codes: its lead-in silence), and reports the text cross-entropy and
greedy accuracy over the reply bytes (text pad excluded), split into greetings and answers. If the
answers' figures do not move when the user is silenced, the model does not use the user's words.

    python bench/diag_listen.py --weights runs/bench_ft/run/lm.safetensors --data runs/bench_ft/heldout \
        --out bench/results/diag_listen.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from moshi.utils.compile import no_compile

from egomem.dialog.checkpoint import build_lm
from egomem.dialog.tokenizer import ByteTokenizer
from egomem.training.batch import make_batch
from egomem.training.dataset import Dataset
from egomem.training.forward import forward

LISTEN = slice(9, 17)


def silenced(tokens: np.ndarray) -> np.ndarray:
    out = np.array(tokens, copy=True)
    out[LISTEN] = out[LISTEN, :1]  # frame 0 is lead-in silence in every stream (StreamSpec.lead_in >= 2)
    return out


@torch.no_grad()
def score(lm, tok, ds: Dataset, samples, transform, window: int) -> dict[str, dict[str, float]]:
    """Mean text CE and greedy accuracy over reply bytes, greetings and answers apart, and over the answers'
    heads (their first two words, "You live", "Your favourite": where the kind asked is decided)."""
    layouts = {lay.stream: lay for lay in ds.layouts}
    acc: dict[str, list[tuple[float, bool]]] = {"greetings": [], "answers": [], "answer heads": []}
    space = tok.encode(" ")[0]
    for s in samples:
        tokens = transform(ds.tokens(s.stream))
        b = make_batch(lm, tok, [(s, tokens)], ds.manifest["n1"], ds.manifest["n2"], window)
        with no_compile():
            out = forward(lm, b.chunks, b.stream)
        logits, target = out.text_logits[0].float(), out.targets[0, 0]
        ce = F.cross_entropy(logits, target.clamp_min(0), reduction="none")
        hit = logits.argmax(-1) == target
        for u in layouts[s.stream].dialogs[s.dialog].turns:
            part = "greetings" if u.user_start == u.user_end else "answers"
            reply = tokens[0, u.reply_text_start:u.reply_text_end].tolist()
            spaces = [i for i, x in enumerate(reply) if x == space]
            head = spaces[1] if len(spaces) > 1 else len(reply)  # "You live", "Your favourite": the kind asked
            for f in range(u.reply_text_start, u.reply_text_end):
                t = f - b.crop_start[0]
                if 0 <= t < b.lengths[0] and b.text_mask[0, t] and int(target[t]) != tok.pad_id:
                    acc[part].append((float(ce[t]), bool(hit[t])))
                    if part == "answers" and f - u.reply_text_start < head:
                        acc["answer heads"].append((float(ce[t]), bool(hit[t])))
    return {k: {"ce": float(np.mean([c for c, _ in v])), "acc": float(np.mean([h for _, h in v])), "bytes": len(v)}
            for k, v in acc.items() if v}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", type=Path, required=True)
    p.add_argument("--data", type=Path, required=True, help="a dataset folder (its held-out Level-1 samples)")
    p.add_argument("--dialog-steps", type=int, default=192, help="as the fine-tune's --dialog-steps")
    p.add_argument("--limit", type=int, default=0, help="at most this many samples (0: all)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    ds, tok = Dataset(a.data), ByteTokenizer()
    lm = build_lm(ds.manifest.get("preset", "tiny"), weights=a.weights)
    samples = [s for s in ds.samples if s.kind == "l1_response" and not s.stream.endswith("-noised")][:a.limit or None]
    report = {"weights": str(a.weights), "data": str(a.data), "samples": len(samples),
              "as recorded": score(lm, tok, ds, samples, lambda x: x, a.dialog_steps),
              "user silenced": score(lm, tok, ds, samples, silenced, a.dialog_steps)}
    print(json.dumps(report, indent=1))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
