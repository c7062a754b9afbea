"""Level-2 retrieval benchmark on a generated relation graph (paper: pass@5 0.96, < 0.1 s per query).

    .venv/bin/python bench/bench_retrieval.py [--neighbours 120 --facts 5 --queries 300 --seed 0]

One user with N neighbours (relation words drawn from RELATIONS, names unique), each holding
`--facts` memory items drawn from FACTS, so >= 500 (relation, fact) documents. Queries pick a target
document and say it the way the dialog model would, in three kinds:
  combined:  relation word + paraphrased keywords (never the fact's own content words);
  keywords:  paraphrased keywords only;
  relation:  relation word only, for relations held by one neighbour with one fact of that topic.
pass@5: a document with the target's relation and item is among the first five returned (within
the 256-step budget); for keyword-only queries the item alone counts (without a relation word,
every neighbour holding the same fact supports the answer equally). Peers measured in the same run: BM25 only (no encoder) and embedding only
(relations ignored). Latency: one `retrieve` with document embeddings cached (stored memories are
embedded once, timed separately). Writes bench/results/bench_retrieval.json + .png.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np

from egomem.config import DialogConfig, RetrievalConfig
from egomem.retrieval import Level2Retriever, Neighbour, RetrievalQuery, build_documents
from egomem.retrieval.encoder import build_text_encoder

RESULTS = Path(__file__).parent / "results"
RELATIONS = ["sister", "brother", "mother", "father", "daughter", "son", "grandmother", "grandfather", "aunt",
             "uncle", "cousin", "niece", "nephew", "wife", "husband", "girlfriend", "boyfriend", "friend",
             "best friend", "roommate", "neighbor", "coworker", "boss", "teacher", "classmate", "doctor",
             "coach", "landlord", "mentor", "bandmate"]
FACTS = [  # (memory item, paraphrased keyword groups the model might use instead)
    ("plays tennis every Sunday morning", ["racket sport", "weekend sport"]),
    ("swims laps at the public pool", ["swimming", "water exercise"]),
    ("runs marathons", ["long distance running", "race"]),
    ("practices yoga before work", ["stretching routine", "meditation exercise"]),
    ("climbs at an indoor bouldering gym", ["rock climbing", "climbing wall"]),
    ("is allergic to peanuts", ["food allergy", "nut allergy"]),
    ("is a vegetarian", ["does not eat meat", "diet"]),
    ("loves spicy Sichuan food", ["chili cuisine", "favourite dish"]),
    ("bakes sourdough bread on weekends", ["baking hobby", "homemade loaf"]),
    ("drinks only green tea", ["favourite beverage", "tea preference"]),
    ("works as a nurse at the city hospital", ["job", "medical career"]),
    ("is a software engineer at a startup", ["programming job", "tech work"]),
    ("teaches high school chemistry", ["science teacher", "profession"]),
    ("runs a small bakery downtown", ["business owner", "shop"]),
    ("is studying law at university", ["student", "legal degree"]),
    ("has a golden retriever named Max", ["pet dog", "puppy"]),
    ("keeps two cats", ["pet", "kitten"]),
    ("has an aquarium with tropical fish", ["fish tank", "pet"]),
    ("plays the violin in an orchestra", ["music instrument", "classical musician"]),
    ("sings in a church choir", ["singing", "vocal group"]),
    ("collects vinyl records", ["music collection", "old albums"]),
    ("plays the drums in a rock band", ["percussion", "band"]),
    ("visited Japan last spring", ["trip abroad", "travel to Asia"]),
    ("wants to see the northern lights in Iceland", ["travel wish", "aurora"]),
    ("goes camping in the mountains every summer", ["outdoor trip", "tent"]),
    ("is afraid of flying", ["fear of planes", "phobia"]),
    ("has a birthday on the fifth of May", ["birthday", "date of birth"]),
    ("is getting married in October", ["wedding", "engagement"]),
    ("just had a baby girl", ["newborn", "new parent"]),
    ("moved to Berlin last year", ["relocation", "lives in Germany"]),
    ("is learning Spanish", ["foreign language", "language class"]),
    ("reads mystery novels", ["books", "detective stories"]),
    ("writes poetry", ["poems", "creative writing"]),
    ("paints watercolor landscapes", ["art hobby", "painting"]),
    ("knits scarves for the family", ["wool crafts", "handmade gifts"]),
    ("is a big fan of Arsenal football club", ["soccer team", "football fan"]),
    ("watches every Formula One race", ["car racing", "motorsport"]),
    ("plays chess online at night", ["board game", "strategy game"]),
    ("loves video games", ["gaming", "console"]),
    ("grows tomatoes in the garden", ["gardening", "vegetables"]),
    ("has type 1 diabetes", ["health condition", "insulin"]),
    ("had knee surgery in March", ["operation", "injury recovery"]),
    ("does not drink alcohol", ["sober", "no wine or beer"]),
    ("quit smoking two years ago", ["cigarettes", "nicotine"]),
    ("drives an old red pickup truck", ["car", "vehicle"]),
    ("rides a motorcycle to work", ["motorbike", "commute"]),
    ("volunteers at the animal shelter", ["charity work", "helping animals"]),
    ("is saving money to buy a house", ["home purchase", "savings goal"]),
    ("loves horror movies", ["scary films", "cinema taste"]),
    ("hates cilantro", ["dislikes a herb", "food dislike"]),
]


def make_graph(rng: random.Random, n: int, facts_per: int) -> list[Neighbour]:
    out = []
    for i in range(n):
        rel = RELATIONS[i % len(RELATIONS)] if i < len(RELATIONS) else rng.choice(RELATIONS)
        items = tuple(f for f, _ in rng.sample(FACTS, facts_per))
        out.append(Neighbour(f"Person{i:03d}", rel, items))
    return out


def make_queries(rng: random.Random, graph: list[Neighbour], n: int) -> list[tuple[str, RetrievalQuery, tuple[str, str]]]:
    kw = dict(FACTS)
    docs = [(nb.relation, it) for nb in graph for it in nb.items]
    qs = []
    for _ in range(n):
        rel, item = rng.choice(docs)
        words = (rng.choice(kw[item]),)
        qs.append(("combined", RetrievalQuery((rel,), words), (rel, item)))
        if len(qs) % 2 == 0:
            qs.append(("keywords", RetrievalQuery((), words), (rel, item)))
    by_rel: dict[str, list[str]] = {}
    for nb in graph:
        by_rel.setdefault(nb.relation, []).extend(nb.items)
    for rel, items in by_rel.items():
        if len(items) <= 5:  # a relation-only query can only be answered when the relation says it all
            qs.append(("relation", RetrievalQuery((rel,), ()), (rel, rng.choice(items))))
    return qs


def pass_at(retriever: Level2Retriever, graph, queries, k: int = 5) -> dict[str, float]:
    hits: dict[str, list[bool]] = {}
    for kind, q, (rel, item) in queries:
        got = retriever.retrieve(q, graph)[:k]
        ok = any(h.document.item == item and (kind == "keywords" or h.document.relation == rel) for h in got)
        hits.setdefault(kind, []).append(ok)
    out = {kind: float(np.mean(v)) for kind, v in hits.items()}
    out["all"] = float(np.mean([x for v in hits.values() for x in v]))
    out["n"] = {kind: len(v) for kind, v in hits.items()}
    return out


class _NoRelations(Level2Retriever):
    """Peer: embedding similarity only (relation words joined into the keyword text)."""

    def rank(self, query, docs):
        return super().rank(RetrievalQuery((), query.relations + query.keywords), docs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--neighbours", type=int, default=120)
    ap.add_argument("--facts", type=int, default=5)
    ap.add_argument("--queries", type=int, default=300, help="combined queries (+ half as many keyword-only)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", type=Path, default=None, help="unused (the benchmark is generated); kept for a uniform CLI")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    graph = make_graph(rng, args.neighbours, args.facts)
    n_docs = len(build_documents(graph))
    queries = make_queries(rng, graph, args.queries)
    cfg, l2_steps = RetrievalConfig(), DialogConfig().l2_steps
    t0 = time.perf_counter()
    encoder = build_text_encoder(cfg)
    load_s = time.perf_counter() - t0
    ours = Level2Retriever.from_config(cfg, encoder, l2_steps)
    t0 = time.perf_counter()
    ours.warm(build_documents(graph))
    cold_s = time.perf_counter() - t0  # embeds every document once, as the memory manager would on write
    res = {"documents": n_docs, "neighbours": len(graph), "queries": len(queries), "encoder": encoder.model_id,
           "encoder_load_s": load_s, "embed_all_documents_s": cold_s,
           "pass_at_5": {"bm25_rerank": pass_at(ours, graph, queries),
                         "bm25_only": pass_at(Level2Retriever.from_config(cfg, None, l2_steps), graph, queries),
                         "embedding_only": pass_at(_NoRelations.from_config(cfg, encoder, l2_steps), graph, queries)}}
    times = []
    for _, q, _ in queries[:100]:
        t0 = time.perf_counter()
        ours.retrieve(q, graph)
        times.append(time.perf_counter() - t0)
    enc_times = []  # peer in the same run: the bare query-embedding call every re-ranked query makes
    for _, q, _ in queries[:100]:
        t0 = time.perf_counter()
        encoder.encode([", ".join(q.relations + q.keywords)])
        enc_times.append(time.perf_counter() - t0)
    res["latency_s"] = {"p50": float(np.median(times)), "p95": float(np.percentile(times, 95)), "min": float(np.min(times)),
                        "encode_query_p50": float(np.median(enc_times))}
    p = res["pass_at_5"]
    print(f"{n_docs} documents, {len(queries)} queries ({p['bm25_rerank']['n']}), encoder {encoder.model_id}")
    print(f"{'pass@5':<16}{'combined':>10}{'keywords':>10}{'relation':>10}{'all':>8}")
    for name, r in p.items():
        print(f"{name:<16}{r.get('combined', 0):>10.3f}{r.get('keywords', 0):>10.3f}{r.get('relation', 0):>10.3f}{r['all']:>8.3f}")
    print(f"ratio all (ours / bm25_only) = {p['bm25_rerank']['all'] / max(p['bm25_only']['all'], 1e-9):.2f}")
    lat = res["latency_s"]
    print(f"latency p50 {lat['p50'] * 1e3:.1f} ms (min {lat['min'] * 1e3:.1f}); bare query embedding p50 "
          f"{lat['encode_query_p50'] * 1e3:.1f} ms -> ratio {lat['p50'] / lat['encode_query_p50']:.2f}")
    print(f"latency warm p50 {lat['p50'] * 1e3:.1f} ms  p95 {lat['p95'] * 1e3:.1f} ms; "
          f"embedding all {n_docs} documents once {cold_s:.2f} s; encoder load {load_s:.1f} s")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_retrieval.json").write_text(json.dumps(res, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    kinds = ["combined", "keywords", "relation", "all"]
    for j, (name, r) in enumerate(p.items()):
        ax.bar(np.arange(len(kinds)) + j * 0.27, [r.get(k, 0) for k in kinds], width=0.27, label=name)
    ax.axhline(0.96, color="k", ls=":", label="paper 0.96")
    ax.set_xticks(np.arange(len(kinds)) + 0.27, kinds)
    ax.set(ylabel="pass@5", ylim=(0, 1.05), title=f"Level-2 retrieval, {n_docs} docs")
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(RESULTS / "bench_retrieval.png", dpi=100)
    print(f"wrote {RESULTS / 'bench_retrieval.json'} and .png")


if __name__ == "__main__":
    main()
