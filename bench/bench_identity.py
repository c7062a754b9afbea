"""Identity benchmark: face/speaker verification, closed-set speaker identification, identify latency.

    .venv/bin/python bench/bench_identity.py [--data DIR] [--sizes 1000 100000 1000000]

--data: by default the small set inside the repository (tests/data/identity: 6 faces with their
pairs.csv, 7 LibriSpeech test-other utterances, no cohort audio), enough to run every step; the
figures in docs/ come from a full folder laid out as faces/ (*.jpg + pairs.csv) and speech/test-other/,
speech/cohort/ (*.flac), e.g. `--data ../shared/data`.

- Face: verification on faces/pairs.csv: EER and accuracy at the configured threshold (cosine distance).
- Voice: EER over all utterance pairs of speech/test-other (raw cosine and AS-normed); closed-set
  identification pass@1, enrolling each test speaker from one utterance and the 251 cohort speakers
  as distractor users, with and without s-norm (the cohort is the same 251 speakers; AS-norm leaves a
  key's own cohort row out, see snorm.py).
- Latency of `Identifier.identify(face, voice)` with s-norm at N enrolled users (random unit keys,
  one face + one voice key per user), median and p95 over repeated queries, against a NumPy
  brute-force search over the same keys measured in the same loop (the peer).
Writes bench/results/bench_identity.json and a PNG (score distributions + latency).
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path

import numpy as np

from egomem.config import IdentityConfig
from egomem.identity.face import build_face_encoder
from egomem.identity.identify import Identifier
from egomem.identity.index import UserKeyIndex
from egomem.identity.snorm import AdaptiveSNorm, default_cohort_file
from egomem.identity.voice import build_speaker_encoder

RESULTS = Path(__file__).parent / "results"
DEFAULT_DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "identity"


def _faces_dir(data: Path) -> Path:
    """faces/ of a full data folder, else the folder itself (the repository's small flat set)."""
    return data / "faces" if (data / "faces").is_dir() else data


def _speech_files(data: Path, split: str) -> list[Path]:
    """speech/<split>/ of a full data folder; the flat set has test utterances only (no cohort audio)."""
    if (data / "speech").is_dir():
        folder = data / "speech" / split
        return sorted(folder.rglob("*.flac") if split == "test-other" else folder.glob("*.flac"))
    return sorted(data.glob("*.flac")) if split == "test-other" else []


def eer(same: np.ndarray, diff: np.ndarray, higher_is_same: bool = True) -> tuple[float, float]:
    """Equal error rate and the threshold where false accepts ~= false rejects."""
    if not higher_is_same:
        same, diff = -same, -diff
    best = (1.0, 0.0)
    for t in np.unique(np.concatenate([same, diff])):
        far, frr = float(np.mean(diff >= t)), float(np.mean(same < t))
        if abs(far - frr) < best[0] or (abs(far - frr) == best[0] and (far + frr) / 2 < best[1]):
            best = (abs(far - frr), t)
    t = best[1]
    rate = (float(np.mean(diff >= t)) + float(np.mean(same < t))) / 2
    return rate, float(t if higher_is_same else -t)


def face_bench(data: Path, cfg: IdentityConfig) -> dict:
    from PIL import Image

    enc = build_face_encoder(cfg)
    emb: dict[str, np.ndarray] = {}
    t0 = time.perf_counter()
    for img in sorted(_faces_dir(data).glob("*.jpg")):
        res = enc.encode(np.asarray(Image.open(img).convert("RGB")))
        if len(res):
            emb[img.name] = res.embeddings[res.speaker]
    per_image = (time.perf_counter() - t0) / max(len(emb), 1)
    same, diff = [], []
    with open(_faces_dir(data) / "pairs.csv") as f:
        for row in csv.DictReader(f):
            if row["file_x"] in emb and row["file_y"] in emb:
                d = 1.0 - float(emb[row["file_x"]] @ emb[row["file_y"]])
                (same if row["same"] == "1" else diff).append(d)
    s, d = np.array(same), np.array(diff)
    rate, thr = eer(s, d, higher_is_same=False)
    acc = (np.sum(s < enc.threshold) + np.sum(d >= enc.threshold)) / (len(s) + len(d))
    return {"model": enc.model_id, "images_with_face": len(emb), "pairs_same": len(s), "pairs_diff": len(d),
            "threshold": enc.threshold, "accuracy_at_threshold": float(acc), "eer": rate, "eer_threshold": thr,
            "s_per_image": per_image, "same": s.tolist(), "diff": d.tolist()}


def voice_embed(files: list[Path], enc) -> tuple[np.ndarray, list[str]]:
    import soundfile as sf

    vecs, names = [], []
    if not files:
        return np.zeros((0, 0), np.float32), names  # no distractors
    for f in files:
        pcm, sr = sf.read(f, dtype="float32")
        r = enc.encode(pcm, sr)
        if r.embedding is not None:
            vecs.append(r.embedding)
            names.append(f.stem.split("-")[0])
    return np.stack(vecs), names


def voice_bench(data: Path, cfg: IdentityConfig) -> dict:
    enc = build_speaker_encoder(cfg)
    t0 = time.perf_counter()
    test, spk = voice_embed(_speech_files(data, "test-other"), enc)
    per_utt = (time.perf_counter() - t0) / len(spk)
    cohort_vecs, cohort_spk = voice_embed(_speech_files(data, "cohort"), enc)
    sn = AdaptiveSNorm.from_file(cfg.cohort_file or default_cohort_file(enc.model_id), cfg.cohort_top_k, cfg.cohort_size)
    labels = np.array(spk)
    iu = np.triu_indices(len(spk), 1)
    raw = (test @ test.T)[iu]
    mu, sd = sn.stats(test)
    normed = sn.normalize(test @ test.T, (mu[:, None], sd[:, None]), (mu[None, :], sd[None, :]))[iu]
    same = (labels[:, None] == labels[None, :])[iu]
    eer_raw, thr_raw = eer(raw[same], raw[~same])
    eer_sn, thr_sn = eer(normed[same], normed[~same])
    # closed-set identification: first utterance of each test speaker enrols it; the rest are queries
    out = {"model": enc.model_id, "utterances": len(spk), "pairs": int(len(raw)), "s_per_utterance": per_utt,
           "eer_raw": eer_raw, "eer_raw_threshold": thr_raw, "eer_snorm": eer_sn, "eer_snorm_threshold": thr_sn,
           "snorm_k": sn.k, "cohort_rows": int(sn.cohort.shape[0]), "distractors": len(cohort_spk),
           "same_snorm": normed[same].tolist(), "diff_snorm": normed[~same].tolist()}
    for use_snorm in (False, True):
        ident = Identifier(UserKeyIndex(), "f", enc.model_id, 0.0, -1e9, sn if use_snorm else None, 400)
        enrolled = set()
        queries = []
        for v, s in zip(test, spk):
            if s in enrolled:
                queries.append((v, s))
            else:
                ident.enrol_voice(s, v)
                enrolled.add(s)
        for v, s in zip(cohort_vecs, cohort_spk):
            ident.enrol_voice(f"cohort-{s}", v)
        hits = sum(ident.match_voice(v)[0] == s for v, s in queries)
        out[f"pass_at_1_{'snorm' if use_snorm else 'raw'}"] = hits / len(queries)
        out["id_queries"] = len(queries)
    return out


def latency_bench(sizes: list[int], cfg: IdentityConfig, repeats: int) -> list[dict]:
    rng = np.random.default_rng(0)
    sn = AdaptiveSNorm.from_file(cfg.cohort_file or default_cohort_file("resemblyzer_ge2e"), cfg.cohort_top_k, cfg.cohort_size)
    rows = []
    for n in sizes:
        idx = UserKeyIndex()
        users = [f"u{i}" for i in range(n)]
        faces = rng.standard_normal((n, 128), dtype=np.float32)  # random keys (the index normalises them)
        voices = rng.standard_normal((n, 256), dtype=np.float32)
        for start in range(0, n, 100_000):
            idx.add_many(users[start:start + 100_000], "face", "f", faces[start:start + 100_000])
            idx.add_many(users[start:start + 100_000], "voice", "v", voices[start:start + 100_000])
        faces /= np.linalg.norm(faces, axis=1, keepdims=True)
        voices /= np.linalg.norm(voices, axis=1, keepdims=True)
        ident = Identifier(idx, "f", "v", cfg.face_threshold_dlib, cfg.voice_threshold_resemblyzer, sn, cfg.snorm_candidates)
        times, peer = [], []
        for r in range(repeats + 2):
            f, v = rng.standard_normal((1, 128)).astype(np.float32), rng.standard_normal(256).astype(np.float32)
            t0 = time.perf_counter()
            ident.identify(f, v)
            t1 = time.perf_counter()
            # peer: NumPy brute force over the same keys (top-1 face, top-C voice candidates), no s-norm
            int(np.argmax(faces @ f[0]))
            np.argpartition(-(voices @ v), min(cfg.snorm_candidates, n - 1))[: cfg.snorm_candidates]
            t2 = time.perf_counter()
            if r >= 2:  # first calls warm faiss/BLAS up
                times.append(t1 - t0)
                peer.append(t2 - t1)
        rows.append({"users": n, "p50_s": float(np.median(times)), "p95_s": float(np.percentile(times, 95)),
                     "numpy_brute_force_p50_s": float(np.median(peer))})
        r_ = rows[-1]
        print(f"identify @ {n:>9,} users: p50 {r_['p50_s'] * 1e3:7.2f} ms  p95 {r_['p95_s'] * 1e3:7.2f} ms  "
              f"numpy brute-force peer p50 {r_['numpy_brute_force_p50_s'] * 1e3:7.2f} ms  "
              f"ratio {r_['p50_s'] / r_['numpy_brute_force_p50_s']:.2f}")
        del idx, ident, faces, voices
    return rows


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    if "face" in res:
        f = res["face"]
        ax[0].hist(f["same"], bins=20, alpha=0.6, label="same person")
        ax[0].hist(f["diff"], bins=20, alpha=0.6, label="different")
        ax[0].axvline(f["threshold"], color="k", ls="--", label="threshold")
        ax[0].set(title=f"face ({f['model']}): cosine distance", xlabel="distance")
        ax[0].legend()
    if "voice" in res:
        v = res["voice"]
        ax[1].hist(v["same_snorm"], bins=30, alpha=0.6, density=True, label="same speaker")
        ax[1].hist(v["diff_snorm"], bins=30, alpha=0.6, density=True, label="different")
        ax[1].axvline(res["config"]["voice_threshold_resemblyzer"], color="k", ls="--", label="threshold")
        ax[1].set(title=f"voice ({v['model']}): AS-normed score", xlabel="s'")
        ax[1].legend()
    if res.get("latency"):
        lat = res["latency"]
        ax[2].loglog([r["users"] for r in lat], [r["p50_s"] * 1e3 for r in lat], "o-", label="p50")
        ax[2].loglog([r["users"] for r in lat], [r["p95_s"] * 1e3 for r in lat], "s--", label="p95")
        ax[2].axhline(100, color="r", ls=":", label="paper bound (100 ms @ 1k)")
        ax[2].set(title="identify latency", xlabel="enrolled users", ylabel="ms")
        ax[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA,
                    help="folder with faces/ and speech/ (default: the repository's small set, tests/data/identity)")
    ap.add_argument("--sizes", type=int, nargs="*", default=[1000, 100_000, 1_000_000])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--skip", nargs="*", default=[], choices=["face", "voice", "latency"])
    args = ap.parse_args()
    cfg = IdentityConfig()
    res: dict = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(cfg).items()}}
    if "face" not in args.skip:
        res["face"] = face_bench(args.data, cfg)
        f = res["face"]
        print(f"face  {f['model']}: acc@{f['threshold']:.2f} = {f['accuracy_at_threshold']:.3f}  "
              f"EER {f['eer']:.3f} (thr {f['eer_threshold']:.3f})  {f['s_per_image'] * 1e3:.0f} ms/image")
    if "voice" not in args.skip:
        res["voice"] = voice_bench(args.data, cfg)
        v = res["voice"]
        print(f"voice {v['model']}: EER raw {v['eer_raw']:.3f} (thr {v['eer_raw_threshold']:.3f})  "
              f"EER s-norm {v['eer_snorm']:.3f} (thr {v['eer_snorm_threshold']:.2f})  "
              f"pass@1 raw {v['pass_at_1_raw']:.3f}  s-norm {v['pass_at_1_snorm']:.3f}  "
              f"({v['id_queries']} queries, {v['distractors']} distractors)")
    if "latency" not in args.skip:
        res["latency"] = latency_bench(args.sizes, cfg, args.repeats)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_identity.json").write_text(json.dumps(res, indent=1))
    plot(res, RESULTS / "bench_identity.png")
    print(f"wrote {RESULTS / 'bench_identity.json'} and .png")


if __name__ == "__main__":
    main()
