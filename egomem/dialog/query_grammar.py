"""The query grammar: a `<retr>` query's relation line names only relations the Level-1 MemChunk holds.

Structured output on the dialog model's text channel (what vLLM's and SGLang's guided decoding do for JSON),
for the one place where the model's words become a database lookup. Once the model has written the query
header (`<retr>:` and a newline, paper §3.2.2), every text token of the relation line is drawn among the
tokens that continue one of the relations on the Level-1 profile's `people:` line ("Name (relation); ...",
`egomem.memory.store.Store.render_profile`); a relation ends with a newline (the keyword line follows) or with
", " and another relation (at most `GrammarTokens.max_relations` on a line); a newline at once (no relation)
is always allowed. The keywords, the answer and
everything else stay free. Level-2 retrieval looks only among the user's own relations, so a relation outside
them retrieves nothing: the grammar turns a garbled relation ("rin teacher") into one the user has, chosen by
the model's own scores for the tokens that can follow. `[dialog] query_grammar` (default off), `eval-dialog
--query-grammar`; docs/training.md#a-grammar-for-the-query.

Per slot the grammar is a small automaton in fixed-shape device tables (`DialogEngine` masks and advances it
inside the tick: no host sync, CUDA-graph safe). States 0 .. H-1 are free text, the state counting the header
tokens matched so far; states H .. are the relation line's trie nodes (H: its root), each with up to
`max_children` (token, next state) pairs. Leaving the line (its newline) returns to state 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

HEADER = "<retr>:\n"  # what opens a query on the text channel (egomem.training.types.Query.text)
SEPARATOR = ", "  # between two relations on the relation line
NEWLINE = "\n"  # ends the relation line
_PEOPLE = re.compile(r"\(([^()]*)\)")  # "Name (relation)" -> relation


def profile_relations(l1_text: str) -> list[str]:
    """The relations a Level-1 profile text names on its `people:` line, in order, without repeats: what a
    query's relation line may say (a relation holding the separator or a newline cannot be written, and is left out)."""
    out: list[str] = []
    for line in l1_text.splitlines():
        if not line.startswith("people: "):
            continue
        for part in line[len("people: "):].split(";"):
            for rel in _PEOPLE.findall(part)[-1:]:  # the last bracket: a name may hold one too
                rel = " ".join(rel.split())
                if rel and "," not in rel and rel not in out:
                    out.append(rel)
    return out


@dataclass(frozen=True)
class GrammarTokens:
    """The query grammar's fixed token sequences, from the dialog tokenizer, and how many relations a line
    may name (the training corpus's queries name at most one; the format allows more)."""
    header: tuple[int, ...]
    separator: tuple[int, ...]
    newline: tuple[int, ...]
    max_relations: int = 2

    @classmethod
    def from_tokenizer(cls, tokenizer, max_relations: int = 2) -> GrammarTokens:
        t = cls(tuple(tokenizer.encode(HEADER)), tuple(tokenizer.encode(SEPARATOR)), tuple(tokenizer.encode(NEWLINE)),
                max_relations)
        if max_relations < 1:
            raise ValueError(f"a query's relation line names at least one relation; max_relations = {max_relations}")
        if not (t.header and t.separator and t.newline):
            raise ValueError(f"the dialog tokenizer encodes the query header, separator or newline to nothing: {t}")
        if t.header[0] in t.header[1:]:  # the free states' match assumes it (a restart only on the first token)
            raise ValueError(f"the query header's first token recurs in it ({t.header}); the grammar cannot follow it")
        return t


class QueryGrammar:
    """The automaton's tables for `slots` slots (module docstring); `relations(slot, ids)` loads one slot's."""

    def __init__(self, tokens: GrammarTokens, slots: int, device: torch.device | str, max_states: int = 384,
                 max_children: int = 16):
        self.tokens = tokens
        self.H = len(tokens.header)
        if max_states < self.H + tokens.max_relations + len(tokens.separator) + len(tokens.newline):
            raise ValueError(f"max_states {max_states} leaves no room for the relation line")
        self.max_states, self.max_children = max_states, max_children
        self.device = torch.device(device)
        self.header = torch.tensor(tokens.header, dtype=torch.long, device=self.device)  # [H]
        self.child_tok = torch.full((slots, max_states, max_children), -1, dtype=torch.long, device=self.device)
        self.child_next = torch.zeros((slots, max_states, max_children), dtype=torch.long, device=self.device)
        self.state = torch.zeros(slots, dtype=torch.long, device=self.device)  # [S]
        self.loaded: dict[int, int] = {}  # slot -> how many relations its table holds
        for s in range(slots):
            self.relations(s, [])

    def table(self, relations: list[list[int]]) -> tuple[list[list[tuple[int, int]]], int]:
        """One slot's (token, next state) pairs per state from H on, and how many of `relations` (token ids)
        fit: a relation that would overflow `max_states` or a node's `max_children`, or whose tokens run into
        the separator's or the newline's, is left out (the profile's order decides who fits first). The line
        holds at most `tokens.max_relations` relations: one trie per place on the line."""
        sep, nl, places = self.tokens.separator, self.tokens.newline, self.tokens.max_relations
        FREE = -1  # a link out of the relation line, to free text
        nodes: list[dict[int, int]] = [{} for _ in range(places)]  # local ids; place p's root is node p (0: state H)

        def chain(seq: tuple[int, ...], end: int) -> int:
            """Nodes for seq[1:] ending at `end`; returns where seq[0] leads."""
            to = end
            for tok in reversed(seq[1:]):
                nodes.append({tok: to})
                to = len(nodes) - 1
            return to

        after_nl = chain(nl, FREE)
        after_sep = [chain(sep, p + 1) for p in range(places - 1)]  # "son, " goes on to a relation, not a newline
        fixed = len(nodes)  # the roots and the chains: a relation grows only from a root
        nodes[0][nl[0]] = after_nl  # no relation at all
        fitted = 0
        for rel in relations:
            trial = [dict(n) for n in nodes]
            ok = bool(rel)
            for place in range(places if ok else 0):
                node = place
                for tok in rel:
                    nxt = trial[node].get(tok)
                    if nxt is None:
                        trial.append({})
                        nxt = trial[node][tok] = len(trial) - 1
                    elif nxt < fixed:  # the relation runs into the separator or the newline
                        ok = False
                        break
                    node = nxt
                ends = [(nl[0], after_nl)] + ([(sep[0], after_sep[place])] if place < places - 1 else [])
                for tok, to in ends:
                    ok = ok and trial[node].setdefault(tok, to) == to
            if not ok or self.H + len(trial) > self.max_states or max(map(len, trial)) > self.max_children:
                continue
            nodes, fitted = trial, fitted + 1
        return [[(tok, 0 if to == FREE else self.H + to) for tok, to in n.items()] for n in nodes], fitted

    def relations(self, slot: int, relations: list[list[int]]) -> int:
        """Load `slot`'s relation line from `relations` (token ids each) and reset its state to free text;
        returns how many fitted."""
        rows, fitted = self.table(relations)
        tok = torch.full((self.max_states, self.max_children), -1, dtype=torch.long)
        nxt = torch.zeros((self.max_states, self.max_children), dtype=torch.long)
        for i, children in enumerate(rows):
            for j, (t, n) in enumerate(children):
                tok[self.H + i, j], nxt[self.H + i, j] = t, n
        self.child_tok[slot] = tok.to(self.device)
        self.child_next[slot] = nxt.to(self.device)
        self.state[slot] = 0
        self.loaded[slot] = fitted
        return fitted

    def mask(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """`logits` [B, ..., V] with the tokens the grammar forbids at `rows`' states set to -inf."""
        B, V = rows.shape[0], logits.shape[-1]
        st = self.state[rows]  # [B]
        children = self.child_tok[rows, st]  # [B, M]
        allowed = torch.zeros(B, V + 1, dtype=torch.bool, device=logits.device)
        allowed.scatter_(1, torch.where(children >= 0, children, V), True)  # column V: the empty entries
        keep = allowed[:, :V] | (st < self.H)[:, None]  # free text: every token
        return logits.masked_fill(~keep.view(B, *([1] * (logits.dim() - 2)), V), float("-inf"))

    def advance(self, rows: torch.Tensor, tokens: torch.Tensor, pad: int, exec_mask: torch.Tensor | None) -> None:
        """Move `rows`' states on by this tick's text `tokens` [B] (rows outside `exec_mask` keep theirs)."""
        st = self.state[rows]
        free = torch.where(tokens == self.header[st.clamp(max=self.H - 1)], st + 1,
                           (tokens == self.header[0]).long())
        free = torch.where(tokens == pad, st, free)  # a pad neither opens nor breaks the header
        children = self.child_tok[rows, st]  # [B, M]
        hit = children == tokens[:, None]
        ruled = torch.where(hit.any(1), (self.child_next[rows, st] * hit).sum(1), 0)
        new = torch.where(st < self.H, free, ruled)
        if exec_mask is not None:
            new = torch.where(exec_mask, new, st)
        self.state[rows] = new
