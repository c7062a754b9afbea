"""Diagnostic for issue #13: how fast does a model learn to copy from its MemChunk, by content?

The fine-tuned tiny model never reads a held-out name out of its Level-1 MemChunk
(docs/training.md#what-the-tiny-model-reached): greeting a person recognised at any tick needs an
induction-style lookup, and that did not form within the CPU budget. This script isolates that skill
on cheap synthetic rows and trains, on identical data with the identical optimiser, either

- `moshi`: the `tiny` preset's `LMModel` (the moshi classes the stack serves), fed as the engine feeds
  it: `[chunk | dialog]`, the dialog's text row shifted by one tick; `--audio-rows` says what its 16
  audio rows hold: `initial` (the audio initial token everywhere, as the engine's chunks: a constant
  vector in the input sum), `noise` (the chunk's initial token, random codes in the dialog: speech), or
  `zero` (moshi's zero token -1: embeds to exactly 0, so the input is the text embedding alone);
  `--text-emb-std`, `--positions`, `--override`, `--torch-init`, `--smear`, `--lookahead` and
  `--no-out-norm` each change one more thing, to find what sets it apart;
- `vanilla`: a plain pre-norm `torch.nn.TransformerEncoder` of the same width, depth and heads with
  learned absolute positions, on the text row alone (the textbook setting where induction heads form);
  `--core moshi` swaps in moshi's own transformer stack, `--no-bias` drops every bias, `--out-norm`
  puts a norm before the head as moshi does.

A row: a chunk of `--chunk` tokens holding `name: <first> <last>` (after up to `--lead` random words)
and random words, then a dialog of `--dialog` ticks whose text writes, at a random tick, either a span
of `--span` chunk tokens from a random place (a reading drill, probability `--drill`) or the greeting
`Hi <first> , good see`. Words are 1-3 tokens from a vocabulary of `--vocab` pieces, so the task is the
textbook one (a name's pieces are almost always unique in the chunk). The text loss covers the written
tokens. Every `--eval-every` steps, held-out rows (drawn from other seeds) are scored teacher-forced:
48 greetings, `held_exact` = every piece of the first name right, `held_first` = its first piece (after
`name:`), `held_rest` = the others; and 48 drills, `held_copy` = the written tokens after the first
(each an induction step: find the current token in the chunk, write the one after it).

With `--lead 0` the name always starts at chunk position 1, so a model with absolute positions can
greet by position without reading by content; drills (`--drill 1`) start anywhere and cannot be
copied by position. docs/training.md ("The skill itself, isolated") has the runs and what they show.

`--byte-ids --save PATH` trains the tiny preset itself (letters as byte ids, its 260-id vocabulary) and
writes it: with `--drill 1 --span 40 46 --vocab 26 --audio-rows noise --text-emb-std 1 --no-out-norm`
that is the copying backbone, which the product command `egomem train-backbone` (egomem/training/
backbone.py) now trains, bit for bit the same at seed 0 (docs/training.md, "A backbone that copies").

    python bench/diag_induction.py --model moshi --out bench/results/diag_induction_moshi.jsonl
    python bench/diag_induction.py --model vanilla --out bench/results/diag_induction_vanilla.jsonl
    python bench/diag_induction.py --plot bench/results/diag_induction_*.jsonl   # -> diag_induction.png
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

PAD, SPECIALS = 3, 16  # Moshi's text pad; ids 4..15 are structure words
NAME, PEOPLE, FACT, HI, COMMA, NL, GOOD, SEE, SPACE = range(4, 13)
HELD_SEED = 12345


def make_row(r: random.Random, a: argparse.Namespace, kind: str = "mixed"):
    """(chunk ids [chunk], dialog text [dialog], supervised [dialog], scored positions).

    kind: `mixed` (training: a drill with probability `--drill`, else a greeting), `greet` or `drill`.
    Scored positions: a greeting's first-name pieces, or a drill's written tokens after its first.
    """
    def word(n: int | None = None) -> list[int]:
        pieces = [SPECIALS + r.randrange(a.vocab) for _ in range(n or r.randint(1, 3))]
        return pieces + [SPACE] if a.space else pieces  # --space: a separator after every word, as bytes have

    first, last = word(r.randint(2, 3)), word()
    ids = [NAME] + first + last + [NL, PEOPLE]
    for _ in range(r.randint(0, a.lead) if a.lead else 0):  # words before the name: it is no longer at a fixed position
        ids = word() + [r.choice([NL, FACT, COMMA])] + ids
    while len(ids) < a.chunk - 8:
        ids += word() + word() + [r.choice([NL, FACT, COMMA])]
    ids = ids[:a.chunk]
    chunk = ids + [PAD] * (a.chunk - len(ids))
    text, sup = [PAD] * a.dialog, [False] * a.dialog
    drill = kind == "drill" or (kind == "mixed" and r.random() < a.drill)
    if drill:
        n = r.randint(a.span[0], min(a.span[1], a.dialog - 2))
        s0 = r.randrange(len(ids) - n + 1)
        written = ids[s0:s0 + n]
    else:
        written = [HI] + first + [COMMA, GOOD, SEE]
    start = r.randint(1, a.dialog - len(written) - 1)
    text[start:start + len(written)] = written
    sup[start:start + len(written)] = [True] * len(written)
    scored = range(start + 1, start + len(written)) if drill else range(start + 1, start + 1 + len(first))
    return chunk, text, sup, list(scored)


class Vanilla(nn.Module):
    """The textbook peer: pre-norm transformer, learned absolute positions, text tokens only."""

    def __init__(self, vocab: int, length: int, dim: int, layers: int, heads: int,
                 core: str = "torch", bias: bool = True, out_norm: bool = False):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, dim), nn.Embedding(length, dim)
        self.core = core
        if core == "moshi":  # moshi's own transformer stack (attention + MLP), LayerNorm and a plain MLP as here
            from moshi.modules.transformer import StreamingTransformer

            self.tr = StreamingTransformer(dim, heads, layers, 4 * dim, causal=True, positional_embedding="none",
                                           norm="layer_norm", gating="none")
        else:
            layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, 0.0, batch_first=True, norm_first=True,
                                               bias=bias)
            self.tr = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.out_norm = nn.LayerNorm(dim, bias=bias) if out_norm else nn.Identity()  # moshi ends with a norm
        self.out = nn.Linear(dim, vocab, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        h = self.emb(x) + self.pos.weight[:n]
        if self.core == "moshi":
            h = self.tr(h)
        else:
            h = self.tr(h, mask=torch.triu(torch.full((n, n), float("-inf")), 1), is_causal=True)
        return self.out(self.out_norm(h))


def build(a: argparse.Namespace):
    """(model, rows -> dialog text logits [B, dialog, V])."""
    torch.manual_seed(a.seed)
    V = SPECIALS + a.vocab
    if a.byte_ids:
        from egomem.dialog.tokenizer import ByteTokenizer

        V = ByteTokenizer.vocab_size
    if a.model == "vanilla":
        from egomem.dialog.presets import lm_kwargs

        kw = lm_kwargs("tiny")
        model = Vanilla(V, a.chunk + a.dialog, kw["dim"], kw["num_layers"], kw["num_heads"], a.core, not a.no_bias,
                        a.out_norm)

        def logits(chunk: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
            x = torch.cat([chunk, torch.full_like(text[:, :1], 1), text[:, :-1]], 1)  # bos, then shifted text
            return model(x)[:, a.chunk:]
        return model, logits

    from moshi.utils.compile import no_compile

    from egomem.dialog.checkpoint import build_lm

    overrides = dict(kv.split("=", 1) for kv in a.override)
    # the tiny preset now drops moshi's final norm and draws its text embedding at std 1; these runs keep the
    # norm unless --no-out-norm and moshi's embedding init unless --text-emb-std (as when they were made)
    lm = build_lm("tiny", seed=a.seed, text_card=V, positional_embedding=a.positions, out_norm=not a.no_out_norm,
                  text_emb_std=None, **overrides).train()  # moshi's init; --text-emb-std re-draws it below
    if a.torch_init:
        # moshi inits every linear at truncated-normal std 1/sqrt(dim_in); torch's default is uniform, std 1/sqrt(3 dim_in)
        for m in lm.transformer.modules():
            if isinstance(m, nn.Linear):
                m.reset_parameters()
    if a.text_emb_std is not None:  # moshi inits embeddings at 1/sqrt(dim); torch.nn.Embedding at 1
        with torch.no_grad():
            lm.text_emb.weight.normal_(0.0, a.text_emb_std)
    K = lm.num_codebooks
    if a.smear + a.lookahead > K - 1:
        raise SystemExit(f"--smear + --lookahead must fit the {K - 1} audio rows, got {a.smear + a.lookahead}")
    text_initial = int(lm._get_initial_token()[0, 0, 0])

    def logits(chunk: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        B = chunk.shape[0]
        rows = torch.full((B, K, a.chunk + a.dialog), lm.initial_token_id, dtype=torch.long)
        rows[:, 0, :a.chunk] = chunk
        rows[:, 0, a.chunk] = text_initial
        rows[:, 0, a.chunk + 1:] = text[:, :-1]
        if a.audio_rows == "zero":
            rows[:, 1:] = lm.zero_token_id
        elif a.audio_rows == "noise":
            g = torch.Generator().manual_seed(int(chunk.sum()))
            rows[:, 1:, a.chunk:] = torch.randint(0, lm.card, (B, K - 1, a.dialog), generator=g)
        for i in range(1, a.smear + 1):  # chunk audio row i holds the text token i steps back (a smeared key)
            rows[:, i, :i] = PAD
            rows[:, i, i:a.chunk] = chunk[:, :-i]
        for i in range(1, a.lookahead + 1):  # the next audio rows hold the text token i steps ahead
            row = a.smear + i
            rows[:, row, a.chunk - i:a.chunk] = PAD
            rows[:, row, :a.chunk - i] = chunk[:, i:]
        with no_compile():
            _, tl = lm.forward_text(rows)
        return tl[:, 0, a.chunk:]
    return lm, logits


def byte_id_table(a: argparse.Namespace) -> torch.Tensor | None:
    """`--byte-ids`: row ids -> the byte tokenizer's (pieces = letters a.., structure words = punctuation), so
    the trained model is the `tiny` preset's shape and `diag_memchunk_copy.py --init` can start from it."""
    if not a.byte_ids:
        return None
    from egomem.dialog.tokenizer import ByteTokenizer

    table = torch.arange(SPECIALS + a.vocab)
    table[PAD] = ByteTokenizer.pad_id
    table[4:SPECIALS] = torch.tensor([ByteTokenizer.OFFSET + ord(c) for c in ":;=,.\n!? -'\""[:SPECIALS - 4]])
    table[SPECIALS:] = ByteTokenizer.OFFSET + ord("a") + torch.arange(a.vocab)
    return table


def tensors(rows: list[tuple], table: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    """make_row outputs stacked: chunks [B, chunk], texts [B, dialog], supervised [B, dialog], name positions
    (ids through `table` when given)."""
    chunk, text = torch.tensor([x[0] for x in rows]), torch.tensor([x[1] for x in rows])
    if table is not None:
        chunk, text = table[chunk], table[text]
    return chunk, text, torch.tensor([x[2] for x in rows]), [x[3] for x in rows]


def train(a: argparse.Namespace) -> None:
    torch.set_num_threads(a.threads)
    model, logits = build(a)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = 50  # steps; then cosine to 10 % of the lr (the shape of egomem finetune's schedule)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1, (s + 1) / warmup) * (
        0.1 + 0.45 * (1 + math.cos(math.pi * min(1, s / a.steps)))))
    r, held_r = random.Random(a.seed), random.Random(HELD_SEED)
    table = byte_id_table(a)
    held = [tensors([make_row(held_r, a, "greet") for _ in range(16)], table) for _ in range(3)]
    drill_r = random.Random(HELD_SEED + 1)
    held_drills = [tensors([make_row(drill_r, a, "drill") for _ in range(16)], table) for _ in range(3)]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with a.out.open("w") as out:
        out.write(json.dumps({"config": {k: str(v) for k, v in vars(a).items()}}) + "\n")
        for step in range(1, a.steps + 1):
            chunk, text, sup, _ = tensors([make_row(r, a) for _ in range(a.batch_size)], table)
            loss = F.cross_entropy(logits(chunk, text)[sup], text[sup])
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            rec = {"step": step, "loss": round(loss.item(), 4), "t": round(time.time() - t0, 1)}
            if step % a.eval_every == 0 or step == a.steps:
                rec |= evaluate(model, logits, held) | {"held_copy": copy_accuracy(model, logits, held_drills)}
                print(json.dumps(rec), flush=True)
            out.write(json.dumps(rec) + "\n")
            out.flush()
    if a.save is not None:  # Moshi safetensors of the tiny preset's shape (--byte-ids): a starting point
        from safetensors.torch import save_file

        a.save.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().float().contiguous() for k, v in model.state_dict().items()}, str(a.save),
                  metadata={"format": "moshi-lm", "preset": "tiny", "trained_by": "bench/diag_induction.py"})


@torch.no_grad()
def evaluate(model: nn.Module, logits, held) -> dict[str, float]:
    model.eval()
    first = rest = rest_n = exact = n = 0
    for chunk, text, _, positions in held:
        pred = logits(chunk, text).argmax(-1)
        for j, pos in enumerate(positions):
            hit = [bool(pred[j, q] == text[j, q]) for q in pos]
            first += hit[0]
            rest += sum(hit[1:])
            rest_n += len(hit) - 1
            exact += all(hit)
            n += 1
    model.train()
    return {"held_exact": exact / n, "held_first": first / n, "held_rest": rest / max(rest_n, 1)}


@torch.no_grad()
def copy_accuracy(model: nn.Module, logits, held) -> float:
    """Held-out drills: the share of written tokens after the first that are copied right (induction)."""
    model.eval()
    hits = n = 0
    for chunk, text, _, positions in held:
        pred = logits(chunk, text).argmax(-1)
        for j, pos in enumerate(positions):
            hits += sum(bool(pred[j, q] == text[j, q]) for q in pos)
            n += len(pos)
    model.train()
    return round(hits / max(n, 1), 4)


# (config key, its default, the label part when it differs): what a run changed, in the plot's legend
LABEL_PARTS = [
    ("core", "torch", "{} core"), ("no_bias", "False", "no bias"), ("out_norm", "False", "final norm"),
    ("positions", "rope", "{} positions"), ("override", "[]", "{}"), ("smear", "0", "smear {}"),
    ("lookahead", "0", "lookahead {}"), ("no_out_norm", "False", "no final norm"),
    ("torch_init", "False", "torch init"), ("text_emb_std", "None", "text emb std {}"),
    ("lead", "0", "name after up to {} words"), ("space", "False", "spaces"), ("byte_ids", "False", "byte ids"),
    ("vocab", "1000", "{} pieces"), ("seed", "0", "seed {}"),
]


def run_label(cfg: dict[str, str]) -> str:
    """The model, then every option a run set away from its default (older runs lack newer keys)."""
    parts = [cfg["model"]]
    if cfg["model"] == "moshi":
        parts.append(f"audio rows: {cfg.get('audio_rows', 'initial')}")
    parts += [fmt.format(cfg[key]) for key, default, fmt in LABEL_PARTS if cfg.get(key, default) != default]
    return ", ".join(parts)


def plot(paths: list[Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (greet_ax, drill_ax) = plt.subplots(1, 2, figsize=(14, 7.5), sharey=True)
    for ax in (greet_ax, drill_ax):
        ax.set_prop_cycle(color=plt.cm.tab20.colors)  # a colour per run
    for p in paths:
        recs = [json.loads(line) for line in p.read_text().splitlines()]
        cfg = recs[0]["config"]
        ev = [x for x in recs[1:] if "held_exact" in x]
        label = run_label(cfg)
        steps = [x["step"] for x in ev]
        if float(cfg["drill"]) < 1:  # greetings trained: the name lookup (by position or by content)
            greet_ax.plot(steps, [x["held_first"] for x in ev], label=label)
        else:  # drills only: copying by content, which no position can do
            drill_ax.plot(steps, [x["held_copy"] for x in ev], label=label)
    greet_ax.set_title("greetings + drills: first name piece greeted (held-out)")
    drill_ax.set_title("drills only: chunk span copied after its first token (held-out)")
    for ax in (greet_ax, drill_ax):
        ax.set_xlabel("step")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    greet_ax.set_ylabel("accuracy")
    fig.suptitle("copying out of the chunk: the tiny moshi LM vs a textbook transformer")
    fig.tight_layout()
    fig.savefig(out)
    print(f"wrote {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["moshi", "vanilla"], default="moshi")
    p.add_argument("--steps", type=int, default=2500)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--vocab", type=int, default=1000, help="word pieces names and words are made of")
    p.add_argument("--chunk", type=int, default=96, help="chunk tokens (the Level-1 MemChunk, shortened)")
    p.add_argument("--dialog", type=int, default=48, help="dialog ticks")
    p.add_argument("--space", action="store_true", help="a separator token after every word (as a space in bytes)")
    p.add_argument("--lead", type=int, default=0,
                   help="up to this many random words before `name:` (0: the name always starts at position 1)")
    p.add_argument("--drill", type=float, default=0.8, help="share of rows that read a span of the chunk")
    p.add_argument("--span", type=int, nargs=2, default=[6, 30], metavar=("MIN", "MAX"),
                   help="tokens a drill writes (at most the dialog's length - 2)")
    p.add_argument("--audio-rows", choices=["initial", "noise", "zero"], default="initial",
                   help="moshi: what the 16 audio rows hold (module docstring)")
    p.add_argument("--text-emb-std", type=float, default=None,
                   help="moshi: re-initialise the text embedding with this std (moshi's own: 1/sqrt(dim))")
    p.add_argument("--smear", type=int, default=0,
                   help="moshi: chunk audio rows 1..N hold the chunk's text 1..N steps back (keys that know their prefix)")
    p.add_argument("--lookahead", type=int, default=0,
                   help="moshi: the next chunk audio rows hold the chunk's text 1..N steps ahead (values that know what follows)")
    p.add_argument("--positions", choices=["rope", "sin", "sin_rope"], default="rope",
                   help="moshi: its positional embedding (the engine needs rope; sin = absolute, as the peer's)")
    p.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE",
                   help="moshi: LMModel keyword overrides of the tiny preset (strings), e.g. norm=layer_norm gating=none")
    p.add_argument("--no-out-norm", action="store_true",
                   help="moshi: drop LMModel's final norm before the text head")
    p.add_argument("--torch-init", action="store_true",
                   help="moshi: re-initialise the transformer's linear layers with torch's defaults")
    p.add_argument("--core", choices=["torch", "moshi"], default="torch",
                   help="vanilla: its transformer stack (moshi = moshi's StreamingTransformer, LayerNorm, plain MLP)")
    p.add_argument("--no-bias", action="store_true", help="vanilla: no biases anywhere, head included (as moshi)")
    p.add_argument("--out-norm", action="store_true", help="vanilla: a final norm before the head (as moshi)")
    p.add_argument("--byte-ids", action="store_true", help="moshi: rows in the byte tokenizer's ids (pieces = letters, "
                   "so --vocab <= 26) and the tiny preset's 260-id text vocabulary")
    p.add_argument("--save", type=Path, help="moshi --byte-ids: write the trained LM here (Moshi safetensors; "
                   "`diag_memchunk_copy.py --init` starts from it)")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("runs/diag_induction.jsonl"))
    p.add_argument("--plot", type=Path, nargs="+", help="plot these JSONL runs to bench/results/diag_induction.png")
    a = p.parse_args()
    if a.byte_ids and (a.model != "moshi" or a.vocab > 26):
        p.error("--byte-ids maps pieces to the letters a-z: use it with --model moshi and --vocab <= 26")
    if a.save is not None and not a.byte_ids:
        p.error("--save writes a tiny-preset checkpoint: use it with --byte-ids")
    if a.plot:
        plot(a.plot, Path("bench/results/diag_induction.png"))
    else:
        train(a)


if __name__ == "__main__":
    main()
