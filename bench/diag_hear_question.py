"""Diagnostic for issues #13/#14/#15: can a listener tell the Level-1 questions (or the relation a Level-2
question names) apart from the codec's codes, in voices it never heard?

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

`--task relation` (issue #15, the query drills): the label is the relation a Level-2 question names ("What
does my cousin do for work?" -> cousin), one of the 23 core relations, over every question template of
`corpus.relation_questions`; each training voice speaks each relation in one template (a seeded draw), each
held-out voice in every template. Its two voice sets: `grid` (the 192) and `bank` (the 24 of the query-drill
clip bank, `query_drill.bank_voices`). If even `grid` stays near chance on held-out voices, the codes do not
carry which relation was said and no backbone trained on them can write it; if `bank` alone falls, the drills
need more voices.

`--inputs` says what the probe reads: `codes` (embeddings learnt from the code ids: a listener starting from
nothing), `latent` (the codec's own code vectors, `listen.code_vectors`: what the codes carry), or a dialog
model's safetensors (its user-side listen embeddings: what that model's input carries). If `latent` and the
model's input tell the relations apart in new voices and the model still cannot write which relation was asked,
what it lacks is the mapping from that input to the words, not the hearing.

    python bench/diag_hear_question.py --out bench/results/diag_hear_question.json   # about 10 min, one core
    python bench/diag_hear_question.py --task relation --inputs latent,egomem/data/dialog_tiny.safetensors,codes \
        --updates 20000 --out bench/results/diag_hear_relation.json        # about 27 min, one core beside two jobs
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from egomem.config import load_config
from egomem.training import corpus
from egomem.training.query_drill import VOICES, bank_voices
from egomem.training.tts import HELDOUT_VOICES, TRAIN_VOICES, TTSCache, Voice
from egomem.training.vocab import CORE_RELATIONS
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


def relation_items(voice_index: int | None, seed: int) -> list[tuple[str, str]]:
    """(question, relation) over the core relations: one seeded template each for training voice `voice_index`,
    every template for a held-out voice (None)."""
    out = []
    for rel in sorted(CORE_RELATIONS):
        qs = [q for q, _ in corpus.relation_questions(rel)]
        out += [(q, rel) for q in qs] if voice_index is None else \
            [(random.Random(f"hear-relation/{seed}/{voice_index}/{rel}").choice(qs), rel)]
    return out


def voice_sets(task: str = "kind") -> dict[str, list[Voice]]:
    if task == "relation":
        return {"grid": list(TRAIN_VOICES), "bank": list(bank_voices(VOICES))}
    variants = sorted({v.name for v in TRAIN_VOICES}, key=[v.name for v in TRAIN_VOICES].index)
    return {"grid": list(TRAIN_VOICES), "pairs": [Voice(n, p, r) for n in variants for p, r in OLD_SETTINGS]}


def encode_all(codec: torch.nn.Module, tts: TTSCache, items: list[tuple[str, int]] | Callable[[int], list],
               voices: list[Voice], noised: bool, rng: np.random.Generator) -> list[tuple[np.ndarray, int]]:
    """Codes and label of every item in every voice (`items`: a list, or one list per voice index)."""
    out = []
    for i, voice in enumerate(voices):
        for text, label in (items(i) if callable(items) else items):
            wav = tts(text, voice)
            if noised:
                noise = make_noise(rng, len(wav))
                level = np.sqrt(np.mean(wav ** 2)) * 10 ** (-rng.uniform(0, 20) / 20)
                wav = wav + noise / (np.sqrt(np.mean(noise ** 2)) + 1e-9) * level
            out.append((encode(codec, wav).astype(np.int64), label))
    return out


class Probe(torch.nn.Module):
    """Per-frame input -> two convolutions -> max over time -> label. The input: the sum of per-codebook
    embeddings learnt from scratch (`tables` None: what a listener that starts from code ids must learn), or the
    sum of fixed tables (`[card, D]` per codebook: the codec's code vectors, or a dialog model's listen
    embeddings), standardised over `frames` and mapped by a learnt linear layer (what that input carries)."""

    def __init__(self, card: int, n_q: int, kinds: int, dim: int = 64, hidden: int = 128,
                 tables: list[torch.Tensor] | None = None, frames: torch.Tensor | None = None):
        super().__init__()
        self.tables = tables
        if tables is None:
            self.emb = torch.nn.ModuleList(torch.nn.Embedding(card, dim) for _ in range(n_q))
        else:
            z = self.fixed(frames)
            self.register_buffer("mu", z.mean(0))
            self.register_buffer("sd", z.std(0) + 1e-5)
            self.inp = torch.nn.Linear(z.shape[1], dim)
        self.conv = torch.nn.Sequential(torch.nn.Conv1d(dim, hidden, 5, padding=2), torch.nn.GELU(),
                                        torch.nn.Conv1d(hidden, hidden, 5, padding=2), torch.nn.GELU())
        self.out = torch.nn.Linear(hidden, kinds)

    def fixed(self, codes: torch.Tensor) -> torch.Tensor:
        return sum(t[codes[:, k]] for k, t in enumerate(self.tables))

    def forward(self, codes: torch.Tensor) -> torch.Tensor:  # [T, K] -> [kinds]
        if self.tables is None:
            e = sum(emb(codes[:, k]) for k, emb in enumerate(self.emb))
        else:
            e = self.inp((self.fixed(codes) - self.mu) / self.sd)
        return self.out(self.conv(e.T[None])[0].max(1).values)


def input_tables(name: str, codec: torch.nn.Module) -> list[torch.Tensor] | None:
    """`--inputs` entry -> the probe's fixed tables: `codes` (none: learnt), `latent` (the codec's code vectors,
    `listen.code_vectors`), or a dialog model's safetensors (its user-side audio embeddings, the last n_q)."""
    if name == "codes":
        return None
    from egomem.training.listen import code_vectors

    vec = code_vectors(codec)
    if name == "latent":
        return list(vec)
    from safetensors.torch import load_file

    state = load_file(name)
    n_audio = len([k for k in state if k.startswith("emb.") and k.endswith(".weight")])
    return [state[f"emb.{n_audio - len(vec) + k}.weight"].float() for k in range(len(vec))]


def accuracy(probe: Probe, data: list[tuple[np.ndarray, int]]) -> float:
    with torch.no_grad():
        return float(np.mean([int(probe(torch.from_numpy(x)).argmax()) == y for x, y in data]))


def train_probe(train: list[tuple[np.ndarray, int]], card: int, kinds: int, updates: int, seed: int,
                tables: list[torch.Tensor] | None = None) -> Probe:
    torch.manual_seed(seed)
    frames = torch.from_numpy(np.concatenate([x for x, _ in train])) if tables is not None else None
    probe = Probe(card, train[0][0].shape[1], kinds, tables=tables, frames=frames)
    opt = torch.optim.AdamW(probe.parameters(), 2e-3 if tables is None else 1e-3, weight_decay=0.05)
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
    p.add_argument("--task", choices=("kind", "relation"), default="kind",
                   help="label: the Level-1 question's kind, or the core relation a Level-2 question names")
    p.add_argument("--inputs", default="codes", help="comma list of what the probe reads: codes (embeddings learnt "
                   "from scratch), latent (the codec's code vectors), or a dialog model's safetensors path (its listen "
                   "embeddings)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("bench/results/diag_hear_question.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    cfg = load_config(args.config)
    codec, tts = build_codec(cfg.mimi), TTSCache()
    if args.task == "relation":
        kinds = sorted(CORE_RELATIONS)
        qs = relation_items(None, args.seed)
        items = [(q, kinds.index(k)) for q, k in qs]

        def train_items(i: int) -> list[tuple[str, int]]:
            return [(q, kinds.index(k)) for q, k in relation_items(i, args.seed)]
    else:
        qs = questions()
        kinds = sorted({k for _, k in qs})
        items = [(q, kinds.index(k)) for q, k in qs]
        train_items = items  # type: ignore[assignment]
    rng = np.random.default_rng(args.seed)
    heldout = {c: encode_all(codec, tts, items, list(HELDOUT_VOICES), c == "noised", rng) for c in ("clean", "noised")}
    result: dict = {"what": f"question {args.task} from the codec's codes, probe trained on each voice set, held-out voices",
                    "command": "python bench/diag_hear_question.py " + " ".join(
                        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
                    "codec": "random init" if cfg.mimi.random_init else (cfg.mimi.weights or "trained tiny (shipped)"),
                    "questions": len(qs), "kinds": kinds, "chance": 1 / len(kinds), "heldout_voices": [str(v) for v in HELDOUT_VOICES],
                    "updates": args.updates, "sets": {}}
    for name, voices in voice_sets(args.task).items():
        train = (encode_all(codec, tts, train_items, voices, False, rng)
                 + encode_all(codec, tts, train_items, voices, True, rng))
        card = 1 + max(int(x.max()) for x, _ in train + heldout["clean"] + heldout["noised"])
        for inp in args.inputs.split(","):
            probe = train_probe(train, card, len(kinds), args.updates, args.seed, input_tables(inp, codec))
            key = name if inp == "codes" else f"{name} / {inp}"
            result["sets"][key] = {"train_voices": len(voices), "train_utterances": len(train), "input": inp,
                                   "train_accuracy": accuracy(probe, train[:len(train) // 2]),
                                   **{f"heldout_{c}": accuracy(probe, d) for c, d in heldout.items()}}
            print(key, json.dumps(result["sets"][key]), flush=True)
    result["seconds"] = time.perf_counter() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
