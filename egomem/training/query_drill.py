"""Query drills: a spoken question about "my <relation>", and the `<retr>` query the model writes after it.

Fine-tuned on the corpus, the tiny model learns to write a well-formed Level-2 query whose relation words are
entries of the Level-1 profile's `people:` line, but the wrong entry (docs/training.md, "Level 2 as its own
stage"): a corpus of 400 households holds about 1,600 Level-2 turns, too few to learn which of 3-5 listed
relations was *heard*. A query drill is one such turn, cheap, drawn afresh every time:

- a row is a training household's main user, one of whose relations is set to a relation of the drill bank
  (the others kept; it must fit with them, `corpus.fits_with`, so the ground-truth query stays unambiguous),
  rendered by the real memory store into the Level-1 MemChunk as serving renders it (`MemoryTexts`: the
  `people:` line lists the relations), an empty Level-2 chunk;
- the dialog: with probability `greeting_p` the model's greeting, then one question about that relation
  (`corpus.relation_questions`: its name, "tell me about", or a fact kind whose keywords the query carries),
  spoken in a training voice (half the rows through background noise), then, after `StreamSpec.query_gap`,
  the ground-truth `<retr>:\\n<relation>\\n<keywords><answer>` on the text channel;
- supervised as the corpus's `l2_query` samples (masks.py): the text channel from the row's first tick to
  the end of the query words (the greeting, the silence while the user speaks, the query), no speak loss.

The questions are spoken once per (question, voice) into a `listen.ClipBank` (cached in the run folder):
`relations` training relations (the 23 core ones and a seeded draw of the rest) x `templates` questions each
(a seeded draw) x `voices` training voices spread over the 192, clean and `NOISED_COPIES` noised.
`egomem finetune --query-drills P` mixes them in like `--listen-drills`; `egomem train-backbone --task query`
trains on them alone in the short layout (`QueryTask`). What the tiny model learnt from them (session 47: the
question's kind, not yet which relation was said): docs/training.md, "What the tiny model reached".
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from egomem.dialog.tokenizer import ByteTokenizer

from .corpus import fits_with, greeting, make_household, relation_questions
from .listen import HOUSEHOLD_SEED, HOUSEHOLDS, ClipBank, ListenRow, drill_stream
from .memory_text import MemoryTexts
from .streams import StreamSpec, silence_code
from .tts import HELDOUT_VOICES, TRAIN_VOICES, Voice
from .types import Edge, Household, Query, Split
from .vocab import CORE_RELATIONS, pools

RELATIONS = 160  # training relations the bank speaks (the core ones always among them)
TEMPLATES = 2  # questions per relation
VOICES = 24  # training voices, spread over the 192
NOISED_COPIES = 1  # noised copies of every clip
GREETING_P, NOISED_P = 0.3, 0.5
QUERY_GENERATOR = "query-drill"


def bank_questions(relations: int, templates: int, seed: int, split: Split = "train") -> dict[str, tuple[str, Query]]:
    """question -> (relation, its ground-truth query): `templates` of each of `relations` relations of `split`
    (the core relations first, then a seeded draw of the others; each relation's questions a seeded draw)."""
    pool = pools(split).relations
    core = [r for r in pool if r in CORE_RELATIONS]
    rest = [r for r in pool if r not in CORE_RELATIONS]
    chosen = core[:relations] + random.Random(f"query-drill/{seed}").sample(rest, max(0, min(len(rest),
                                                                                             relations - len(core))))
    out: dict[str, tuple[str, Query]] = {}
    for rel in chosen:
        qs = relation_questions(rel)
        for q, query in random.Random(f"query-drill/{seed}/{rel}").sample(qs, min(templates, len(qs))):
            out[q] = (rel, query)
    return out


def bank_voices(n: int, split: Split = "train") -> tuple[Voice, ...]:
    """`n` voices of `split` spread evenly over its list (its accents and settings come in runs)."""
    voices = TRAIN_VOICES if split == "train" else HELDOUT_VOICES
    step = max(1, len(voices) // max(1, n))
    return voices[::step][:n]


class QueryRows:
    """Draws query-drill rows (module docstring) from `bank`, whose questions `questions` maps to their relation
    and query, about the main users of `split`'s households (held out: held-out people, to score a model on).
    Every draw comes from the `random.Random` passed in."""

    def __init__(self, bank: ClipBank, questions: dict[str, tuple[str, Query]], silence: np.ndarray,
                 greeting_p: float = GREETING_P, noised_p: float = NOISED_P, l1_bytes: int = 512,
                 spec: StreamSpec | None = None, split: Split = "train"):
        missing = [q for q in questions if q not in bank.speakers or (q, bank.speakers[q][0]) not in bank.clean]
        if missing:
            raise ValueError(f"the clip bank does not speak {len(missing)} of the drill questions "
                             f"(e.g. {missing[0]!r}): build it with the same questions")
        self.bank, self.questions, self.silence = bank, questions, np.asarray(silence, np.int64)
        self.split = split
        self.asked = sorted(questions)
        self.greeting_p, self.noised_p = greeting_p, noised_p
        self.spec = spec or StreamSpec()
        self.tok = ByteTokenizer()
        self.texts = MemoryTexts([], l1_bytes=l1_bytes)
        self._l1: dict[tuple[int, int, str], str] = {}  # (household, edge, relation) -> its L1 text

    def close(self) -> None:
        self.texts.close()

    def _household(self, r: random.Random, relation: str) -> tuple[int, int, Household]:
        """A training household with edge j set to `relation`, no other relation overlapping it."""
        while True:
            i = r.randrange(HOUSEHOLDS)
            h = make_household(self.split, HOUSEHOLD_SEED, i)
            j = r.randrange(len(h.edges))
            if fits_with(relation, [e.relation for k, e in enumerate(h.edges) if k != j]):
                edges = tuple(Edge(e.other, relation) if k == j else e for k, e in enumerate(h.edges))
                return i, j, replace(h, edges=edges)

    def _l1_text(self, i: int, j: int, h: Household) -> str:
        key = (i, j, h.edges[j].relation)
        if key not in self._l1:  # the store holds each variant under its own ids
            tag = f"~{len(self._l1)}"
            people = {p.user_id: replace(p, user_id=p.user_id + tag) for p in (h.main, *h.related)}
            self.texts.add(Household(people[h.main.user_id], tuple(people[p.user_id] for p in h.related),
                                     tuple(Edge(e.other + tag, e.relation) for e in h.edges), h.split))
            self._l1[key] = self.texts.l1(h.main.user_id + tag)
        return self._l1[key]

    def row(self, r: random.Random) -> ListenRow:
        question = r.choice(self.asked)
        relation, query = self.questions[question]
        i, j, h = self._household(r, relation)
        voice = r.choice(self.bank.speakers[question])  # every voice of the bank, unless built per_question
        copy = r.randrange(self.bank.copies) if r.random() < self.noised_p else None
        s = self.spec
        t = r.randint(*s.lead_in)
        text: list[tuple[int, list[int]]] = []
        if r.random() < self.greeting_p:
            ids = self.tok.encode(greeting(h.main, r).reply)
            text.append((t, ids))
            t += len(ids) + r.randint(*s.pause)
        codes = self.bank.clean[(question, voice)] if copy is None else self.bank.noised[(question, voice, copy)]
        heard, asked_at = [(t, codes)], t
        t += self.bank.speech_frames(codes) + r.randint(*s.query_gap)
        ids = self.tok.encode(query.text())
        text.append((t, ids))
        end = t + len(ids)
        stream = drill_stream(end, text, heard, self.silence, self.bank, voice, copy, r)
        l1 = self._l1_text(i, j, h)
        return ListenRow(self.tok.encode(l1), stream, [], voice, copy, [(asked_at, question)], l1,
                         kind="l2_query", supervised=(0, end), generator=QUERY_GENERATOR)


def finetune_query_rows(codec: torch.nn.Module, seed: int, l1_bytes: int, cache: Path | None,
                        relations: int = RELATIONS, templates: int = TEMPLATES, voices: int = VOICES,
                        per_question: int | None = None, progress: bool = True) -> QueryRows:
    """The rows `egomem finetune --query-drills` mixes in, their bank cached at `cache` (built when absent or
    made with other inputs: 14 minutes on one core at the defaults, beside a training run)."""
    questions = bank_questions(relations, templates, seed)
    bank = ClipBank(codec, bank_voices(voices), sorted(questions), seed, progress, cache, copies=NOISED_COPIES,
                    per_question=per_question)
    return QueryRows(bank, questions, silence_code(codec), l1_bytes=l1_bytes)



@torch.no_grad()
def query_scores_teacher_forced(lm: torch.nn.Module, rows: list[ListenRow], questions: dict[str, tuple[str, Query]],
                                layout: tuple[int, int] | None, batch: int = 8) -> dict[str, float]:
    """Teacher-forced greedy scores of query-drill rows laid out as `listen.collate` lays them out (`layout`
    (n1, n2): as serving does; None: the bare L1 text before the dialog, the query stage's rows): the share of rows whose
    query the model writes right byte for byte (`query`), its relation words (`who`: heard, then copied from the
    `people:` line) and its keywords (`what`: the question's kind heard); `start`: the query's first byte at its
    tick (when to ask)."""
    from .listen import collate, text_logits

    tok = ByteTokenizer()
    hits: dict[str, list[bool]] = {"query": [], "who": [], "what": [], "start": []}
    was_training = lm.training
    lm.eval()
    for g in range(0, len(rows), batch):
        part = rows[g:g + batch]
        packed = collate(lm, part, layout)
        right = (text_logits(lm, packed).argmax(-1) == packed.targets).numpy()
        for i, (c, row) in enumerate(zip(packed.offsets, part, strict=True)):
            (_, question), = row.spoken
            query = questions[question][1]
            text = query.text()
            T = row.stream.shape[1]
            q0 = c + T - len(tok.encode(text))  # the query is the row's last bytes
            r0 = q0 + len(tok.encode("<retr>:\n"))
            r1 = r0 + len(tok.encode(", ".join(query.relations)))
            k1 = r1 + 1 + len(tok.encode(", ".join(query.keywords)))
            hits["query"].append(bool(right[i, q0:c + T].all()))
            hits["who"].append(bool(right[i, r0:r1].all()))
            hits["what"].append(bool(right[i, r1:k1].all()))
            hits["start"].append(bool(right[i, q0]))
    lm.train(was_training)
    return {k: float(np.mean(v)) for k, v in hits.items()}


HELD_RELATIONS, HELD_VOICES, HELD_ROWS = 40, 6, 48  # the query stage's held-out rows


def new_voice_questions(questions: dict[str, tuple[str, Query]], relations: int) -> dict[str, tuple[str, Query]]:
    """The training questions about the first `relations` of their relations (sorted): what a model is asked in
    held-out voices to tell "does not hear new voices" from "cannot spell new relations"."""
    asked = sorted({rel for rel, _ in questions.values()})[:relations]
    return {q: v for q, v in questions.items() if v[0] in asked}


def new_sentence_questions(questions: dict[str, tuple[str, Query]], relations: int, per_relation: int = TEMPLATES,
                           seed: int = 0) -> dict[str, tuple[str, Query]]:
    """Questions about the first `relations` of the training relations in `questions` (sorted) in sentences
    `questions` does not hold (`per_relation` other templates of `corpus.relation_questions` each, a seeded
    draw): what tells "hears the relation word and the question's kind" from "knows the drilled sentences" (the
    corpus asks each relation in 18 sentences; a bank of 2 a relation taught the sentences, session 49)."""
    asked = sorted({rel for rel, _ in questions.values()})[:relations]
    out: dict[str, tuple[str, Query]] = {}
    for rel in asked:
        others = [(q, query) for q, query in relation_questions(rel) if q not in questions]
        for q, query in random.Random(f"query-drill/new-sentences/{seed}/{rel}").sample(
                others, min(per_relation, len(others))):
            out[q] = (rel, query)
    return out


class QueryTask:
    """The `query` task of `egomem train-backbone` (a stage after `listen`): query drills in the short layout
    (`listen.collate` without a layout: the bare L1 text, then the dialog; about half the serving layout's
    cost per row), the loss `listen.loss` over the whole row (it ends with the query), each text run's first
    `listen.HEAD_TOKENS` bytes weighted `head_weight` (the query's: "<retr>:\n" and the relation's first two bytes,
    where the entry is chosen). Held-out rows, scored by `query_scores_teacher_forced`: held-out households asked
    about `HELD_RELATIONS` held-out relations in `HELD_VOICES` held-out voices (`held_*`; their own bank,
    `held_seed`), and about up to `HELD_RELATIONS` training relations in the same voices (`voice_*`: tells "does
    not hear new voices" from "cannot spell new relations"), and about those relations in sentences the bank does
    not speak, same voices (`sentence_*`: tells "hears the relation and the question's kind" from "knows the
    drilled sentences"); `voices` / `relations` (None: `VOICES`, `RELATIONS`) shrink the training bank and cap the
    held-out ones (a quick run); `templates` sentences a relation (None: `TEMPLATES`), each spoken in
    `per_question` of the voices (None: all). Banks cached in `out` (`query_clips_train.npz`,
    `query_clips_heldout.npz`, `query_clips_heldout_voices.npz`, `query_clips_heldout_sentences.npz`)."""

    name = "query"

    def __init__(self, lm: torch.nn.Module, codec: torch.nn.Module, out: Path, seed: int, held_seed: int,
                 greeting_p: float, noised_p: float, voices: int | None = None, relations: int | None = None,
                 head_weight: float = 1.0, progress: bool = True, templates: int | None = None,
                 per_question: int | None = None):
        self.lm, self.head_weight = lm, head_weight
        silence = silence_code(codec)
        questions = bank_questions(relations or RELATIONS, templates or TEMPLATES, seed)
        bank = ClipBank(codec, bank_voices(voices or VOICES), sorted(questions), seed, progress,
                        out / "query_clips_train.npz", copies=NOISED_COPIES, per_question=per_question)
        self.fingerprint = {"train": bank.fingerprint}
        self.train = QueryRows(bank, questions, silence, greeting_p, noised_p)
        held_questions = bank_questions(min(HELD_RELATIONS, relations or HELD_RELATIONS), TEMPLATES, held_seed,
                                        split="heldout")
        held_voices = bank_voices(min(HELD_VOICES, voices or HELD_VOICES), "heldout")
        r = random.Random(held_seed)

        def held_rows(split: str, asked: dict[str, tuple[str, Query]], cache: str) -> list[ListenRow]:
            """`HELD_ROWS` rows of held-out households asked `asked` in the held-out voices (bank cached in `out`)."""
            bank = ClipBank(codec, held_voices, sorted(asked), held_seed, progress, out / cache, copies=NOISED_COPIES)
            self.fingerprint[split] = bank.fingerprint
            source = QueryRows(bank, asked, silence, greeting_p, noised_p, split="heldout")
            try:
                return [source.row(r) for _ in range(HELD_ROWS)]
            finally:
                source.close()

        # score prefix -> (its rows, their questions); drawn in this order from `r`
        self.held: dict[str, tuple[list[ListenRow], dict[str, tuple[str, Query]]]] = {}
        self.held["held"] = (held_rows("heldout", held_questions, "query_clips_heldout.npz"), held_questions)
        voice_questions = new_voice_questions(questions, HELD_RELATIONS)  # training relations, new voices
        self.held["voice"] = (held_rows("heldout_voices", voice_questions, "query_clips_heldout_voices.npz"),
                              voice_questions)
        # training relations in sentences the bank does not speak, new voices (none when it speaks them all)
        sentence_questions = new_sentence_questions(questions, HELD_RELATIONS)
        if sentence_questions:
            self.held["sentence"] = (held_rows("heldout_sentences", sentence_questions,
                                               "query_clips_heldout_sentences.npz"), sentence_questions)

    def prepare(self) -> None:
        """Nothing: the listen embeddings are the weights' own (the listening stage drew them from the codec)."""

    def batch_loss(self, rows: random.Random, n: int) -> torch.Tensor:
        from .listen import collate, loss

        return loss(self.lm, collate(self.lm, [self.train.row(rows) for _ in range(n)]), self.head_weight)

    def scores(self) -> dict[str, float]:
        return {f"{prefix}_{k}": v for prefix, (rows, questions) in self.held.items()
                for k, v in query_scores_teacher_forced(self.lm, rows, questions, None).items()}

    def close(self) -> None:
        self.train.close()
