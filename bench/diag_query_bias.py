"""Diagnosis: does the shipped soup know *when* to ask, under a query it no longer writes greedily?

The soup of session 46's model and the query stage `vq` writes no `<retr>` query (docs/training.md, "A soup of
two stages"): on a Level-2 question its first byte of the reply is a word. This adds `--bias` nats to the logit
of the query header's first token in the *first word* of a turn only (the turn-start word draw of
`engine.sample_text`, after the wait-or-start decision, which stays the model's own), then runs `egomem
eval-dialog` with the remaining arguments. If the query's first byte ranks near the top on Level-2 turns and
low on Level-1 turns, a small bias recovers the query with little cost to Level 1.

    python bench/diag_query_bias.py --bias 4 [--keyword-line 24] [--raw] -- --data runs/s49/heldout_trainrel \
        --query-grammar --judge rules --temperature 0 --start-temperature 1.0 --new-person restart --draws 1 \
        --seed 0 --fps-ticks 0 --out <json>

Measured in session 62 (docs/training.md, "A soup of two stages"): the bias makes the soup open the query and
the grammar gives it a relation, but it then reads its Level-1 MemChunk out where the keywords belong; its
query skill is gone, not below the greedy threshold.
"""

from __future__ import annotations

import argparse
import sys

import torch

import egomem.dialog.engine as engine
from egomem.dialog.query_grammar import HEADER
from egomem.dialog.tokenizer import ByteTokenizer
from egomem.training import eval_dialog


def keyword_line(limit: int) -> None:
    """Patch `DialogEngine._sample_text`: after a query's relation line (the grammar's newline out of it), the
    keyword line may not hold a newline and ends with `<answer>`, forced after `limit` bytes (a per-slot state
    kept on the host: a diagnosis, not the serving path)."""
    tok = ByteTokenizer()
    newline, close = tok.encode("\n")[0], tok.encode("<answer>")
    state: dict[int, int] = {}  # slot -> bytes on its keyword line so far; -k: k-th byte of "<answer>" next
    original = engine.DialogEngine._sample_text

    def patched(self, logits, last, rows, offsets):
        g = self.grammar
        before = g.state[rows].tolist()
        logits = logits.clone()
        slots = rows.tolist()
        for i, slot in enumerate(slots):
            k = state.get(slot)
            if k is None:
                continue
            if k < 0 or k >= limit:  # inside "<answer>", or the line is full: the next byte of the close
                at = -k if k < 0 else 0
                forced = logits[i].clone().fill_(float("-inf"))
                forced[..., close[at]] = 0.0
                logits[i] = forced
            else:
                logits[i, ..., newline] = float("-inf")
        text = original(self, logits, last, rows, offsets)
        for i, slot in enumerate(slots):
            t = int(text[i].reshape(-1)[0])
            k = state.get(slot)
            if k is None:
                if before[i] >= g.H and t == newline:  # the relation line ended: the keyword line starts
                    state[slot] = 0
            elif k < 0 or t == close[0]:  # the close goes on (or starts) byte by byte
                at = (-k if k < 0 else 0) + 1
                state[slot] = -at if at < len(close) else None
                if state[slot] is None:
                    del state[slot]
            elif t != self.lm.text_padding_token_id:
                state[slot] = k + 1
        return text

    engine.DialogEngine._sample_text = patched


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bias", type=float, required=True, help="nats added to the query's first token at a turn's first word")
    p.add_argument("--keyword-line", type=int, default=0, metavar="M",
                   help="with the query grammar: the keyword line after the relation line holds no newline and "
                        "closes with <answer> (forced after M bytes); 0: free as before")
    p.add_argument("--raw", action="store_true", help="record replies with their query markup (no strip_queries)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="-- then eval-dialog's arguments")
    args = p.parse_args()
    first = ByteTokenizer().encode(HEADER)[0]
    original = engine.sample_text

    def biased(logits: torch.Tensor, pad: int, temperature: float, top_k: int, start_temperature=None,
               silent=None, uniform=None, start_floor: float = 0.0) -> torch.Tensor:
        free = original(logits, pad, temperature, top_k, start_temperature, silent, uniform, start_floor)
        if start_temperature is None or silent is None:
            return free
        started = silent & (free != pad)  # a turn's first word: redraw it among words with the bias
        if not bool(started.any()):
            return free
        words = logits.clone()
        words[..., pad] = float("-inf")
        words[..., first] += args.bias
        return torch.where(started, engine.draw_token(words, temperature, top_k), free)

    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    if args.keyword_line > 0 and "--query-grammar" not in rest:
        raise SystemExit("--keyword-line follows the query grammar's relation line: pass --query-grammar to eval-dialog")
    engine.sample_text = biased
    if args.keyword_line > 0:
        keyword_line(args.keyword_line)
    if args.raw:
        import egomem.training.evaluate as evaluate
        evaluate.strip_queries = lambda text: text
    return eval_dialog.main(rest)


if __name__ == "__main__":
    sys.exit(main())
