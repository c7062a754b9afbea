"""The project's Mimi as the trigger's tokeniser: build it, encode audio to codes, fingerprint it.

The trigger is trained on the codes of the project's default Mimi (`egomem.codec.mimi.build_mimi`),
so it reads exactly what `mimi_codec` produces at serving time. A checkpoint records the
`codec_fingerprint` of the Mimi it was trained on; a mismatch means "retrain the trigger".

A Mimi whose codes do not vary with the audio (random codebooks far from the encoder's latent)
is refused: a trigger trained on it would learn nothing.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from egomem.config import MimiConfig

SAMPLE_RATE = 24_000
FRAME_SAMPLES = 1920  # one 80 ms step


def probe_signal(seed: int, seconds: float) -> np.ndarray:
    """Seeded speech-like audio (harmonic voiced bursts, noise, near-silence, gains over 40 dB), no data files."""
    rng = np.random.default_rng(seed)
    out, n_total = [], int(seconds * SAMPLE_RATE)
    while sum(len(o) for o in out) < n_total:
        n = int(rng.uniform(0.2, 1.5) * SAMPLE_RATE)
        t = np.arange(n) / SAMPLE_RATE
        kind = rng.choice(3, p=[0.6, 0.25, 0.15])
        if kind == 0:  # voiced: harmonics of a gliding f0 with a syllable-rate envelope
            f0 = rng.uniform(80, 300) * (1 + 0.1 * np.sin(2 * np.pi * rng.uniform(0.5, 3) * t))
            phase = 2 * np.pi * np.cumsum(f0) / SAMPLE_RATE
            tilt = rng.uniform(0.5, 1.5)
            x = sum(np.sin(k * phase) / k**tilt for k in range(1, int(4000 / f0.max()) + 1))
            x *= 0.5 * (1 + np.sin(2 * np.pi * rng.uniform(2, 6) * t + rng.uniform(0, 6)))
        elif kind == 1:  # noise, crudely coloured by a one-pole filter
            a = rng.uniform(0, 0.97)
            w = rng.standard_normal(n)
            x = w.copy()
            x[1:] += a * w[:-1]
        else:
            x = rng.standard_normal(n) * 1e-3
        x = x / (np.abs(x).max() + 1e-9) * 10 ** rng.uniform(-2.5, -0.3)
        out.append(x)
    return np.concatenate(out)[:n_total].astype(np.float32)


def _probe_codes(model: torch.nn.Module) -> np.ndarray:
    audio = probe_signal(seed=7, seconds=8.0)
    return encode(model, audio)


def build_codec(cfg: MimiConfig) -> torch.nn.Module:
    """The project's Mimi (`build_mimi`), refused if it maps all audio to constant codes."""
    from egomem.codec.mimi import build_mimi

    model = build_mimi(cfg, device="cpu")
    codes = _probe_codes(model)
    if all(len(np.unique(codes[:, k])) <= 2 for k in range(codes.shape[1])):
        raise RuntimeError(
            "the configured Mimi maps all audio to (nearly) constant codes, so a trigger cannot learn from "
            "them; random-initialised codebooks must be seeded from data (egomem.codec.mimi)"
        )
    return model


@torch.no_grad()
def encode(model: torch.nn.Module, audio: np.ndarray) -> np.ndarray:
    """24 kHz mono float audio [S] -> codes [T, K] int16 (T = ceil(S / 1920))."""
    x = torch.as_tensor(np.asarray(audio, dtype=np.float32))[None, None]  # 1,1,S
    codes = model.encode(x)[0]  # K,T
    return codes.T.numpy().astype(np.int16)


def codec_fingerprint(model: torch.nn.Module) -> str:
    """Short hash of the codes of a fixed probe signal: equal fingerprints = same tokeniser."""
    return hashlib.sha256(_probe_codes(model).tobytes()).hexdigest()[:16]


@torch.no_grad()
def codebook_vectors(model: torch.nn.Module) -> torch.Tensor:
    """[8, 2048, d]: each codebook's centroids in its quantiser's space (codebook 0 = `rvq_first`, 1-7 =
    `rvq_rest`'s levels), i.e. what a code stands for. Neighbouring centroids are similar audio, which the
    code ids alone do not say."""
    q = model.quantizer
    layers = [*q.rvq_first.vq.layers, *q.rvq_rest.vq.layers]
    return torch.stack([layer._codebook.embedding.detach().float() for layer in layers])
