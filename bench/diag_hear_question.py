"""Diagnostic for issues #13/#14: can a listener tell the Level-1 questions apart from the codec's codes,
in voices it never heard?

A Level-1 answer is right only when the model heard which question was asked ("Where do I live
again?" -> "You live in ..."). This probe asks the codes alone: every Level-1 question template of the
corpus (`egomem.training.corpus`), spoken by eSpeak, encoded by the configured Mimi (the offline default:
the trained tiny codec), classified into its kind (city, job, pet, ..., 12 kinds) by a small
convolutional net over the codes. It trains on the training voices and scores on the held-out voices
(`egomem.training.tts`, other accents and variants), clean and noised (coloured noise 0-20 dB below the
speech, as the corpus's noised copy). Two training-voice sets in one run, the same number of updates each:

  - `grid`: the corpus's `TRAIN_VOICES` (12 accent/variant voices x 4 pitches x 4 rates);
  - `pairs`: the 12 voices at the two pitch/rate settings the corpus used before (40/160, 60/185).

If `pairs` scores far below `grid` on held-out voices, a dialog model trained on the old voices could
not have learnt to hear the question either, whatever its size.

    python bench/diag_hear_question.py --out bench/results/diag_hear_question.json   # about 10 min, one core
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from egomem.config import load_config
from egomem.training import corpus
from egomem.training.tts import HELDOUT_VOICES, TRAIN_VOICES, TTSCache, Voice
from egomem.trigger.codec import build_codec, encode
from egomem.trigger.synth import make_noise

LIKES = ("jazz", "spicy food", "rainy days", "horror films")  # values for the "Do I like {v}?" question
OLD_SETTINGS = ((40, 160), (60, 185))  # the corpus's pitch/rate pairs before the grid


def questions() -> list[tuple[str, str]]:
    """(question, kind) for every Level-1 question the corpus asks about the user's own profile."""
    out = []
    for kind, (qs, _) in corpus._OWN.items():
        if kind == "dislike":  # the same question as "like": the answer depends on the profile, not the words
            continue
        for q in qs:
            out += [(q.format(v=v), kind) for v in LIKES] if "{v}" in q else [(q, kind)]
    return out + [("What is my name?", "name"), ("Do you know who I am?", "name")]


def voice_sets() -> dict[str, list[Voice]]:
    variants = sorted({v.name for v in TRAIN_VOICES}, key=[v.name for v in TRAIN_VOICES].index)
    return {"grid": list(TRAIN_VOICES), "pairs": [Voice(n, p, r) for n in variants for p, r in OLD_SETTINGS]}


def encode_all(codec: torch.nn.Module, tts: TTSCache, items: list[tuple[str, int]], voices: list[Voice],
               noised: bool, rng: np.random.Generator) -> list[tuple[np.ndarray, int]]:
    out = []
    for voice in voices:
        for text, label in items:
            wav = tts(text, voice)
            if noised:
                noise = make_noise(rng, len(wav))
                level = np.sqrt(np.mean(wav ** 2)) * 10 ** (-rng.uniform(0, 20) / 20)
                wav = wav + noise / (np.sqrt(np.mean(noise ** 2)) + 1e-9) * level
            out.append((encode(codec, wav).astype(np.int64), label))
    return out


class Probe(torch.nn.Module):
    """Sum of per-codebook embeddings -> two convolutions -> max over time -> kind."""

    def __init__(self, card: int, n_q: int, kinds: int, dim: int = 64, hidden: int = 128):
        super().__init__()
        self.emb = torch.nn.ModuleList(torch.nn.Embedding(card, dim) for _ in range(n_q))
        self.conv = torch.nn.Sequential(torch.nn.Conv1d(dim, hidden, 5, padding=2), torch.nn.GELU(),
                                        torch.nn.Conv1d(hidden, hidden, 5, padding=2), torch.nn.GELU())
        self.out = torch.nn.Linear(hidden, kinds)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:  # [T, K] -> [kinds]
        e = sum(emb(codes[:, k]) for k, emb in enumerate(self.emb))
        return self.out(self.conv(e.T[None])[0].max(1).values)


def accuracy(probe: Probe, data: list[tuple[np.ndarray, int]]) -> float:
    with torch.no_grad():
        return float(np.mean([int(probe(torch.from_numpy(x)).argmax()) == y for x, y in data]))


def train_probe(train: list[tuple[np.ndarray, int]], card: int, kinds: int, updates: int, seed: int) -> Probe:
    torch.manual_seed(seed)
    probe = Probe(card, train[0][0].shape[1], kinds)
    opt = torch.optim.AdamW(probe.parameters(), 2e-3, weight_decay=0.05)
    order = np.random.default_rng(seed)
    idx: list[int] = []
    for _ in range(updates):
        if not idx:
            idx = list(order.permutation(len(train)))
        x, y = train[idx.pop()]
        loss = F.cross_entropy(probe(torch.from_numpy(x))[None], torch.tensor([y]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return probe


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, help="egomem config (mimi.*: the codec to probe)")
    p.add_argument("--updates", type=int, default=40_000, help="probe training updates (one utterance each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("bench/results/diag_hear_question.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    cfg = load_config(args.config)
    codec, tts = build_codec(cfg.mimi), TTSCache()
    qs = questions()
    kinds = sorted({k for _, k in qs})
    items = [(q, kinds.index(k)) for q, k in qs]
    rng = np.random.default_rng(args.seed)
    heldout = {c: encode_all(codec, tts, items, list(HELDOUT_VOICES), c == "noised", rng) for c in ("clean", "noised")}
    result: dict = {"what": "question kind from the codec's codes, probe trained on each voice set, held-out voices",
                    "command": "python bench/diag_hear_question.py " + " ".join(
                        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
                    "codec": "random init" if cfg.mimi.random_init else (cfg.mimi.weights or "trained tiny (shipped)"),
                    "questions": len(qs), "kinds": kinds, "chance": 1 / len(kinds), "heldout_voices": [str(v) for v in HELDOUT_VOICES],
                    "updates": args.updates, "sets": {}}
    for name, voices in voice_sets().items():
        train = encode_all(codec, tts, items, voices, False, rng) + encode_all(codec, tts, items, voices, True, rng)
        card = 1 + max(int(x.max()) for x, _ in train + heldout["clean"] + heldout["noised"])
        probe = train_probe(train, card, len(kinds), args.updates, args.seed)
        result["sets"][name] = {"train_voices": len(voices), "train_utterances": len(train),
                                "train_accuracy": accuracy(probe, train[:len(train) // 2]),
                                **{f"heldout_{c}": accuracy(probe, d) for c, d in heldout.items()}}
        print(name, json.dumps(result["sets"][name]), flush=True)
    result["seconds"] = time.perf_counter() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
