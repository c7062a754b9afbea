"""Benchmark the offline codec: the trained tiny Mimi against the random-initialised one, in one run.

Held-out speech only (never heard by `egomem train-codec`, the trigger's held-out split): the 51
LibriSpeech cohort speakers after the first 200 (one utterance each) and the held-out utterances of
the five test-other readers.

  - reconstruction of decode(encode(x)) on every held-out utterance: log-mel L1 distance (lower is
    better) and SI-SNR in dB (higher is better);
  - speaker identification from codes among the 51 held-out speakers, clean and noised (white/pink/
    brown noise at 10 dB SNR): each utterance's first half enrols the speaker, its second half is
    the probe.
      * histogram: a half's bag of codes (8 codebooks x 2048 counts, tf-idf weighted, unit length);
        a probe picks the enrolment with the highest cosine;
      * probe: a logistic-regression classifier on the bag of codes of 2 s windows of the first
        halves, scored on the 2 s windows of the second halves (per window);
      * latent_probe: the same on the mean and std of each window's dequantised latent (the codec's
        own codebook vectors of the codes, `decode_latent`: still a function of the codes alone);
    chance is 1/51 = 2.0 %. The issue's target: the trained codec at least 3x the random one;
  - code stability under noise (session 58): each held-out cohort utterance under one of the six
    backgrounds of the noised streams (`egomem.trigger.noise`; babble of the other held-out speakers)
    at an SNR drawn in each 5 dB band from 0 to 20 dB: the share of its steps whose code equals the
    code of the clean utterance, per codebook. What a model trained on clean codes can still read.
    SI-SNR is reported as measured; a codec trained on mel losses alone (no adversarial or waveform
    fidelity term, 3,000 CPU steps) reproduces the spectrum, not the phase, so it stays far below 0 dB.

    python bench/bench_codec.py --data /work/shared/data/speech      # shipped codec vs random init
    python bench/bench_codec.py --data ... --weights runs/codec.safetensors
    python bench/bench_codec.py --data ... --peer denoise=runs/codec_denoise/mimi.safetensors   # a third codec
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from egomem.codec.mimi import CARDINALITY, build_mimi, codec_weights
from egomem.codec.train import mel_distance, si_snr
from egomem.config import MimiConfig
from egomem.trigger.codec import encode
from egomem.trigger.synth import load_24k, make_noise, source_files

RESULTS = Path(__file__).parent / "results"
WINDOW_STEPS = 25  # the probe's 2 s windows


def bag_of_codes(codes: np.ndarray) -> np.ndarray:
    """codes [T, K] -> counts [K * 2048]."""
    K = codes.shape[1]
    flat = codes.astype(np.int64) + np.arange(K) * CARDINALITY
    return np.bincount(flat.ravel(), minlength=K * CARDINALITY).astype(np.float64)


def tfidf(rows: np.ndarray, idf: np.ndarray) -> np.ndarray:
    x = np.log1p(rows) * idf
    return x / (np.linalg.norm(x, axis=1, keepdims=True) + 1e-12)


def histogram_accuracy(enrol: list[np.ndarray], probe: list[np.ndarray]) -> float:
    """Closed-set identification: each probe half against every enrolment half (cosine of tf-idf bags)."""
    E = np.stack([bag_of_codes(c) for c in enrol])
    P = np.stack([bag_of_codes(c) for c in probe])
    idf = np.log((len(E) + 1) / (1 + (E > 0).sum(0))) + 1
    sims = tfidf(P, idf) @ tfidf(E, idf).T
    return float((sims.argmax(1) == np.arange(len(P))).mean())


def windows(codes: np.ndarray) -> list[np.ndarray]:
    return [codes[a:a + WINDOW_STEPS] for a in range(0, len(codes) - WINDOW_STEPS + 1, WINDOW_STEPS)]


def probe_accuracy(enrol: list[np.ndarray], probe: list[np.ndarray]) -> float:
    """A small linear probe (logistic regression) on 2 s bags of codes, trained on the enrolment halves."""
    from sklearn.linear_model import LogisticRegression

    Xtr, ytr, Xte, yte = [], [], [], []
    for spk, (e, p) in enumerate(zip(enrol, probe)):
        for w in windows(e):
            Xtr.append(bag_of_codes(w))
            ytr.append(spk)
        for w in windows(p):
            Xte.append(bag_of_codes(w))
            yte.append(spk)
    Xtr, Xte = np.log1p(np.stack(Xtr)), np.log1p(np.stack(Xte))
    clf = LogisticRegression(max_iter=300, C=1.0).fit(Xtr, ytr)
    return float((clf.predict(Xte) == np.asarray(yte)).mean())


@torch.no_grad()
def latent_features(model: torch.nn.Module, codes: np.ndarray) -> list[np.ndarray]:
    """Per 2 s window: mean and std of the codec's own dequantised latent of the codes (a function of the
    codes alone: codebook vectors summed and projected, `decode_latent`)."""
    z = model.decode_latent(torch.from_numpy(codes.T.astype(np.int64))[None])[0].T.numpy()  # [T, D]
    return [np.concatenate([w.mean(0), w.std(0)]) for w in windows(z)]


def latent_probe_accuracy(model: torch.nn.Module, enrol: list[np.ndarray], probe: list[np.ndarray]) -> float:
    """Logistic regression on `latent_features` of 2 s windows: enrolment halves train, probe halves test."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    Xtr, ytr, Xte, yte = [], [], [], []
    for spk, (e, p) in enumerate(zip(enrol, probe)):
        f = latent_features(model, e)
        Xtr += f
        ytr += [spk] * len(f)
        f = latent_features(model, p)
        Xte += f
        yte += [spk] * len(f)
    scale = StandardScaler().fit(Xtr)
    clf = LogisticRegression(max_iter=500, C=0.5).fit(scale.transform(Xtr), ytr)
    return float((clf.predict(scale.transform(Xte)) == np.asarray(yte)).mean())


def heldout_audio(data: Path) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(51 held-out cohort speakers' utterances, the test-other held-out utterances), 24 kHz, peak-normalised."""
    users, assistant = source_files(data, "heldout")

    def load(p: Path) -> np.ndarray:
        x = load_24k(p)
        return (x / (np.abs(x).max() + 1e-9) * 0.5).astype(np.float32)

    return [load(p) for p in users], [load(p) for p in assistant]


@torch.no_grad()
def reconstruction(model: torch.nn.Module, utterances: list[np.ndarray]) -> dict:
    mel, snr = [], []
    for x in utterances:
        n = len(x) // 1920 * 1920
        xt = torch.from_numpy(x[:n])
        codes = torch.from_numpy(encode(model, x[:n]).T.astype(np.int64))[None]  # [1, K, T]
        y = model.decode(codes)[0, 0, :n]
        mel.append(mel_distance(y, xt))
        snr.append(si_snr(y, xt))
    return {"mel_distance": round(float(np.mean(mel)), 4), "si_snr_db": round(float(np.mean(snr)), 2)}


def speaker_id(model: torch.nn.Module, users: list[np.ndarray], noised: bool, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    enrol, probe = [], []
    for x in users:
        if noised:
            rms = np.sqrt(np.mean(x**2))
            x = x + make_noise(rng, len(x)) * rms / 10 ** (10 / 20)
        codes = encode(model, x.astype(np.float32))
        half = len(codes) // 2
        enrol.append(codes[:half])
        probe.append(codes[half:])
    return {"histogram": round(histogram_accuracy(enrol, probe), 4), "probe": round(probe_accuracy(enrol, probe), 4),
            "latent_probe": round(latent_probe_accuracy(model, enrol, probe), 4)}


def code_stability(model: torch.nn.Module, users: list[np.ndarray], seed: int) -> dict:
    """Per 5 dB band: per codebook, the share of steps whose code under a background equals the clean code."""
    from egomem.trigger.listen_audio import SNR_BANDS_DB
    from egomem.trigger.noise import KINDS, background

    out = {}
    for lo, hi in SNR_BANDS_DB:
        rng = np.random.default_rng([seed, lo])
        same, steps = np.zeros(8), 0
        for i, x in enumerate(users):
            clean = encode(model, x)
            others = users[:i] + users[i + 1:]
            kind = KINDS[i % len(KINDS)]
            rms = np.sqrt(np.mean(x**2))
            noised = x + background(rng, len(x), others, kind=kind) * rms / 10 ** (rng.uniform(lo, hi) / 20)
            codes = encode(model, noised.astype(np.float32))
            same[: codes.shape[1]] += (codes == clean).sum(0)
            steps += len(codes)
        out[f"{lo}-{hi}"] = [round(float(v), 4) for v in same[: clean.shape[1]] / steps]
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["codecs"])
    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    measures = ("histogram", "probe", "latent_probe")
    labels = [f"{m}\n{c}" for c in ("clean", "noised") for m in measures]
    x, w = np.arange(len(labels)), 0.8 / len(names)
    for i, name in enumerate(names):
        s = result["codecs"][name]["speaker_id"]
        axes[0].bar(x + i * w, [s[c][m] for c in ("clean", "noised") for m in measures], w, label=name)
    axes[0].axhline(1 / 51, color="grey", ls=":", label="chance")
    axes[0].set_xticks(x + 0.4 - w / 2, labels, rotation=30, fontsize=7)
    axes[0].set_ylim(0, 0.5)
    axes[0].set_title("speaker from codes (51 held-out speakers)")
    axes[0].legend(loc="upper left", fontsize=7)
    for ax, key, title in ((axes[1], "mel_distance", "log-mel distance (lower better)"),
                           (axes[2], "si_snr_db", "SI-SNR dB (higher better)")):
        ax.bar(names, [result["codecs"][n]["reconstruction"][key] for n in names],
               color=[f"C{i}" for i in range(len(names))])
        ax.set_title(title)
        ax.tick_params(axis="x", labelsize=7)
    for i, name in enumerate(names):
        bands = result["codecs"][name]["code_stability"]
        axes[3].plot(list(bands), [v[0] for v in bands.values()], "o-", color=f"C{i}", label=f"{name} codebook 0")
        axes[3].plot(list(bands), [float(np.mean(v[1:])) for v in bands.values()], "x:", color=f"C{i}",
                     label=f"{name} codebooks 1-7")
    axes[3].set_xlabel("background SNR (dB)")
    axes[3].set_title("codes equal to the clean ones, under noise")
    axes[3].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True, help="LibriSpeech root with cohort/ and test-other/")
    ap.add_argument("--weights", type=Path, help="the trained codec (default: the shipped one)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peer", action="append", default=[], metavar="NAME=PATH",
                    help="another trained codec measured in the same run (repeatable)")
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_codec.json")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    users, assistant = heldout_audio(args.data)
    trained_cfg = MimiConfig(weights=args.weights)
    codecs = {"random_init": MimiConfig(random_init=True), "trained": trained_cfg}
    for peer in args.peer:
        name, _, path = peer.partition("=")
        if not path or name in codecs:
            ap.error(f"--peer {peer!r}: give NAME=PATH with a new name")
        codecs[name] = MimiConfig(weights=Path(path))
    result: dict = {"held_out": {"speakers": len(users), "utterances": len(users) + len(assistant),
                                 "minutes": round(sum(map(len, users + assistant)) / 24_000 / 60, 1)},
                    "trained_weights": str(codec_weights(trained_cfg)), "codecs": {}}
    for name, cfg in codecs.items():
        t = time.time()
        model = build_mimi(cfg)
        result["codecs"][name] = {
            "reconstruction": reconstruction(model, users + assistant),
            "speaker_id": {cond: speaker_id(model, users, cond == "noised", args.seed) for cond in ("clean", "noised")},
            "code_stability": code_stability(model, users, args.seed),
            "seconds": round(time.time() - t, 1),
        }
        print(name, json.dumps(result["codecs"][name]))
    r, t = result["codecs"]["random_init"]["speaker_id"], result["codecs"]["trained"]["speaker_id"]
    result["speaker_id_ratio"] = {c: {m: round(t[c][m] / max(r[c][m], 1 / 51), 2) for m in t[c]}
                                  for c in ("clean", "noised")}  # random figures below chance count as chance
    result["target_3x_met"] = all(v >= 3 for c in result["speaker_id_ratio"].values() for v in c.values())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
