"""Diagnostic for issue #13: does the tiny model learn to *copy* from its Level-1 MemChunk?

The Fact Score stays 0 because the tiny preset, trained from scratch on CPU, never copies a held-out
name out of L1 (docs/training.md#what-the-tiny-model-reached). This script trains the tiny preset on
the Level-1 samples of a dataset that `bench/bench_finetune.py` built, with two data changes meant to
make reading the chunk the only way to lower the loss, and measures copying on held-out people:

- `--fresh-names p`: with probability p a row's people (the `name:` and `people:` lines of its L1)
  are renamed with fresh random pseudo-names of the same byte length, in L1 and on the text channel,
  so no name can be memorised (the speak channel keeps the old name's audio);
- `--recite p`: with probability p a row becomes a reading drill: its text channel writes a span of
  its own L1 text from a random tick (text loss only); `--random-l1 q` gives a drill, with
  probability q, an L1 of random pseudo-words instead of the profile (nothing to predict but the copy).

Every `--eval-every` steps, teacher-forced on held-out samples: `held_exact` (greeted names whose
bytes after the first are all predicted), `held_byte` (those bytes' accuracy) and `held_recite`
(byte accuracy of reading drills over held-out L1 texts, from the span's fourth byte), `held_recite_random`
(the same over random pseudo-word L1s: nothing but copying predicts them). Record 0 holds
the n-gram baselines: what a byte n-gram model of the training L1 texts predicts of the held-out ones
(reading without copying). One JSON record per step goes to --out; evaluation records are also printed.

    python bench/bench_finetune.py --train-levels 1,2 --work runs/bench_finetune_l12_tc   # the dataset
    python bench/diag_memchunk_copy.py --out-norm --steps 800 --recite 0.6 --lr 1.5e-3 --span 24 120 \
        --out bench/results/diag_memchunk_copy_recite.jsonl
    python bench/diag_memchunk_copy.py --out-norm --steps 800 --recite 0.6 --random-l1 0.7 --lr 2e-3 --span 60 160 \
        --out bench/results/diag_memchunk_copy_random.jsonl
    (--out-norm: those runs were made when the tiny preset still had moshi's final norm; docs/training.md
    lists the runs without it)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from pathlib import Path

import numpy as np
import torch
from moshi.utils.compile import no_compile

from egomem.dialog.checkpoint import build_lm
from egomem.dialog.tokenizer import ByteTokenizer
from egomem.training.batch import make_batch
from egomem.training.dataset import Dataset
from egomem.training.drills import DRILL_LEAD, random_l1, reading_drill, rename_people
from egomem.training.forward import forward, masked_loss
from egomem.training.types import Sample

WARMUP = 30
TOK = ByteTokenizer()


def random_letters(r: random.Random, n: int) -> str:
    """n bytes of uniformly random lowercase letters in 3-7 letter words (`--random-text letters`)."""
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < n:
        words.append("".join(r.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(r.randint(3, 7))))
    return " ".join(words)[:n]


def ngram_baseline(train: list[Sample], held: list[Sample], n: int) -> float:
    """Next-byte accuracy on held-out L1 texts of the most frequent continuation of the previous n-1
    bytes in the training L1 texts: what reading without copying can reach (a model above it copies)."""
    counts: dict[bytes, dict[int, int]] = {}
    for text in dict.fromkeys(s.l1_text for s in train):
        b = text.encode()
        for i in range(n - 1, len(b)):
            c = counts.setdefault(b[i - n + 1:i], {})
            c[b[i]] = c.get(b[i], 0) + 1
    ok = total = 0
    for text in dict.fromkeys(s.l1_text for s in held):
        b = text.encode()
        for i in range(n - 1, len(b)):
            c = counts.get(b[i - n + 1:i])
            total += 1
            ok += int(c is not None and max(c, key=c.__getitem__) == b[i])
    return ok / max(total, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=Path("runs/bench_finetune_l12_tc/train"))
    p.add_argument("--heldout", type=Path, default=Path("runs/bench_finetune_l12_tc/heldout"))
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--fresh-names", type=float, default=1.0)
    p.add_argument("--recite", type=float, default=0.0)
    p.add_argument("--random-l1", type=float, default=0.0)
    p.add_argument("--random-text", choices=("pseudo", "letters"), default="pseudo",
                   help="random L1s of pseudo-words (drills.random_l1), or of uniformly random letters in 3-7 letter "
                   "words (a 2-letter prefix almost always unique, as the synthetic pieces)")
    p.add_argument("--drill-audio", choices=("keep", "constant"), default="keep",
                   help="a drill row's 16 audio rows: the stream's speech codes, or code 0 everywhere (no speech in the input sum)")
    p.add_argument("--span", type=int, nargs=2, default=(24, 120), help="reading-drill span length range (bytes)")
    p.add_argument("--window", type=int, default=192, help="dialog steps per row (bench_finetune's)")
    p.add_argument("--n1", type=int, default=512, help="L1 MemChunk steps (the paper's 512; shorter: drills on "
                   "random words only, scored by held_recite_random)")
    p.add_argument("--n2", type=int, default=256, help="L2 MemChunk steps (the paper's 256)")
    p.add_argument("--out-norm", action="store_true",
                   help="keep moshi's final norm (the tiny preset drops it since issue #13's induction diagnosis)")
    p.add_argument("--moshi-text-emb", action="store_true",
                   help="moshi's text embedding init (1/sqrt(dim)); the tiny preset draws it at std 1 since the runs "
                   "that found speech codes kept it from copying (runs before that: set this)")
    p.add_argument("--init", type=Path, default=None,
                   help="start from this tiny checkpoint (e.g. `diag_induction.py --byte-ids --save`) instead of random")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu | cuda (fp32 with TF32 matmuls on CUDA)")
    p.add_argument("--save", type=Path, default=None,
                   help="write the trained LM here (Moshi safetensors: `egomem finetune --weights` starts from it)")
    p.add_argument("--out", type=Path, default=Path("runs/diag_memchunk_copy.jsonl"))
    a = p.parse_args()
    full = a.n1 >= 512
    if not full and (a.recite < 1 or a.random_l1 < 1):
        p.error("a short L1 (--n1 < 512) holds no profile: use --recite 1 --random-l1 1")
    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    tr, ho = Dataset(a.data), Dataset(a.heldout)
    train = [s for s in tr.samples if s.kind == "l1_response"]
    held = [s for s in ho.samples if s.kind == "l1_response"]
    rng = random.Random(0)
    span = (a.span[0], a.span[1])
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    lm = build_lm("tiny", weights=a.init, seed=0, device=device, out_norm=a.out_norm,
                  **({"text_emb_std": None} if a.moshi_text_emb else {}))
    lm.train()
    opt = torch.optim.AdamW(lm.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1, (s + 1) / WARMUP) * (
        0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * min(1, s / a.steps)))))

    def random_text(r: random.Random) -> str:
        return random_l1(r, a.n1) if a.random_text == "pseudo" else random_letters(r, min(a.n1, 380))

    def logits(items: list[tuple[Sample, np.ndarray]]):
        b = make_batch(lm, TOK, items, a.n1, a.n2, a.window).to(device)
        with no_compile():
            return b, forward(lm, b.chunks, b.stream)

    @torch.no_grad()
    def name_eval(samples: list[Sample], source: Dataset, rename: random.Random | None = None, n: int = 48):
        lm.eval()
        exact = total = byte_ok = byte_n = 0
        for i in range(0, min(n, len(samples)), 4):
            items = []
            for s in samples[i:i + 4]:
                t = source.tokens(s.stream)
                items.append(rename_people(s, t, rename) if rename is not None else (s, t))
            b, out = logits(items)
            pred = out.text_logits.argmax(-1)
            for j, (s, _) in enumerate(items):
                first = [x for x in s.l1_text.splitlines() if x.startswith("name: ")][0][6:].split()[0]
                row = b.stream[j, 0].tolist()
                k = bytes(x - TOK.OFFSET if x >= TOK.OFFSET else 0 for x in row).find(first.encode())
                if k < 0 or not b.text_mask[j, k]:
                    continue
                ok = [pred[j, k + q].item() == row[k + q] for q in range(1, len(first.encode()))]
                total += 1
                exact += all(ok)
                byte_ok += sum(ok)
                byte_n += len(ok)
        lm.train()
        return exact / max(total, 1), byte_ok / max(byte_n, 1), total

    @torch.no_grad()
    def recite_eval(samples: list[Sample], source: Dataset, n: int = 32, random_words: bool = False) -> float:
        lm.eval()
        ok = total = 0
        r = random.Random(5)
        for i in range(0, n, 4):
            rows = [(dataclasses.replace(s, l1_text=random_text(r)) if random_words else s) for s in samples[i:i + 4]]
            items = [reading_drill(s, source.tokens(s.stream), r, span, a.window) for s in rows]
            b, out = logits(items)
            pred = out.text_logits.argmax(-1)
            for j, (s, _) in enumerate(items):
                st = s.text[0].start + DRILL_LEAD - b.crop_start[j]
                for q in range(3, s.text[0].end - s.text[0].start - DRILL_LEAD):
                    total += 1
                    ok += int(pred[j, st + q] == b.stream[j, 0, st + q])
        lm.train()
        return ok / max(total, 1)

    a.out.parent.mkdir(parents=True, exist_ok=True)
    log = a.out.open("w")
    baseline = {"step": 0, **{f"held_{n}gram": round(ngram_baseline(train, held, n), 4) for n in (2, 3, 4)}}
    print(json.dumps(baseline), flush=True)
    log.write(json.dumps(baseline) + "\n")
    order = np.random.default_rng(0).permutation(len(train)).tolist() * (1 + a.steps * a.batch_size // len(train))
    t0 = time.time()
    for step in range(1, a.steps + 1):
        items = []
        for idx in order[(step - 1) * a.batch_size: step * a.batch_size]:
            s, t = train[idx], tr.tokens(train[idx].stream)
            if rng.random() < a.fresh_names:
                s, t = rename_people(s, t, rng)
            if rng.random() < a.recite:
                if rng.random() < a.random_l1:
                    s = dataclasses.replace(s, l1_text=random_text(rng))
                s, t = reading_drill(s, t, rng, span, a.window)
                if a.drill_audio == "constant":
                    t = t.copy()
                    t[1:] = 0
            items.append((s, t))
        b, out = logits(items)
        loss, parts = masked_loss(out, b.text_mask, b.speak_mask, lm.text_padding_token_id, 0.5, 100.0)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        rec = {"step": step, "loss": loss.item(), **parts, "t": round(time.time() - t0, 1)}
        if step % a.eval_every == 0:
            if full:  # profiles fit only the paper's L1
                rec["held_exact"], rec["held_byte"], rec["held_n"] = name_eval(held, ho)
                rec["train_renamed_exact"], rec["train_renamed_byte"], _ = name_eval(train[:48], tr, random.Random(1))
                rec["held_recite"] = recite_eval(held, ho)
            rec["held_recite_random"] = recite_eval(held, ho, random_words=True)
            print(json.dumps(rec), flush=True)
        log.write(json.dumps(rec) + "\n")
        log.flush()
    if a.save is not None:
        from safetensors.torch import save_file

        a.save.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().float().cpu().contiguous() for k, v in lm.state_dict().items()}, str(a.save),
                  metadata={"format": "moshi-lm", "preset": "tiny", "trained_by": "bench/diag_memchunk_copy.py"})


if __name__ == "__main__":
    main()
