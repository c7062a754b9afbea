"""Train the tiny Mimi on speech (`egomem train-codec`), so the offline codes carry what was said and who said it.

The model is moshi's own `MimiModel` at the `tiny` preset (`egomem.codec.mimi.mimi_config`), trained
as Mimi was (Défossez et al. 2024, §3.2), scaled to a 2-core CPU:

  1. **Autoencoder warm-up** (`--warmup-steps`): no quantisation, so the encoder learns a latent
     worth clustering before any codebook exists.
  2. **Codebooks from real latents**: each of the 8 residual codebooks is k-means-initialised on
     that layer's residuals of ~40k frames of training speech (moshi's `_run_kmeans`), then follows
     moshi's EMA updates with dead-code replacement; the encoder gets the commitment loss.
  3. **Mimi's recipe**: quantisation applied to half the batch items only (`no_quantization_rate`
     0.5), quantiser dropout on the acoustic codebooks; the last `--quantized-tail` of the steps
     fully quantised, so the decoder meets exactly what serving feeds it.
  4. **Losses**: multi-scale log-mel + linear-mel L1 (windows 256-2048), a small waveform L1, the
     commitment penalty, and two **distillation** terms on every frame of the quantised latent, as
     Mimi distils WavLM into its first codebook: a linear head predicts the frame's own log-mel
     spectrum (content: without it the tiny encoder's output barely varies over time for thousands
     of steps, and k-means then collapses every codebook onto a handful of codes), and another
     predicts the utterance's GE2E (Resemblyzer) voice embedding (cosine: speaker identity in every
     frame's codes). No adversarial loss (optional in the issue; slow on CPU).
  5. **Input scaling**: before training, the encoder's first convolution is scaled so that real
     speech drives it at unit std (`scale_input_conv`; with the default init its output is ~95 %
     bias and the tiny encoder's latent barely follows the audio).

Data: every `--data` root. A root laid out as the project's shared LibriSpeech set (`cohort/` +
`test-other/`) contributes only the trigger's *training* split (`egomem.trigger.synth.source_files`),
so the held-out speakers of `bench/bench_codec.py` and `bench/bench_trigger.py` are never heard; any
other root contributes all its `*.flac`/`*.wav`. Crops get random level, and 30 % are mixed with
noise at 0-20 dB SNR (coloured noise or babble of other training speakers) — the codec must code
the noised streams the trigger sees.

**A codec that hears through noise** (session 58, not shipped). The trained codec's codes do not survive
noise: on held-out speech under the noised streams' backgrounds only 1-10 % of first-codebook codes equal the
codes of the same clean speech (0-20 dB; `bench/bench_codec.py`, code stability), so every model that reads
them learns the noised condition as a second code language. `--denoise 1` makes a noised crop's
reconstruction (and frame-mel) target the crop without its noise, `--consistency-weight W` pulls the inputs
of the first codebooks for the noised crop to those of the clean one (stop-gradient), `--stream-noise 1`
draws the six background kinds of the noised streams (`egomem.trigger.noise`) instead of coloured noise and
two-voice babble, and `--init-weights F` fine-tunes a trained codec (its input scaling and k-means codebooks
kept; pass `--warmup-steps 0`). A codec's codes change with it: the trigger and the dialog model must be
retrained on its codes before it can serve (docs/trigger.md, "Codes under noise").

Seeded and resumable: batch s is drawn from rng([seed, s]) and the torch/quantiser RNGs are reseeded
per step, so a resumed run equals an uninterrupted one. The shipped checkpoint is made by

    egomem train-codec --data /work/shared/data/speech --seed 0

(README "The trained tiny codec" gives its time and figures; `bench/bench_codec.py` measures it.)
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from egomem.codec.mimi import FRAME_SAMPLES, SAMPLE_RATE, SHIPPED_TINY_CODEC
from egomem.config import REPO_ROOT, MimiConfig

log = logging.getLogger(__name__)

AUDIO_SUFFIXES = (".flac", ".wav")
MEL_WINDOWS = (256, 512, 1024, 2048)  # multi-scale mel loss windows (samples at 24 kHz), hop = window / 4
N_MELS = 64


@dataclass
class CodecTrainConfig:
    """Every knob of a codec run (also the resume key: a checkpoint refuses a run with other values)."""

    seed: int = 0
    steps: int = 3000
    warmup_steps: int = 400  # autoencoder only, then k-means codebooks
    quantized_tail: float = 0.15  # last fraction of steps: every item quantised
    batch: int = 12
    crop_frames: int = 36  # 2.88 s crops
    lr: float = 1e-3
    noise_p: float = 0.3
    speaker_weight: float = 0.5
    frame_mel_weight: float = 1.0
    waveform_weight: float = 0.1
    commit_weight: float = 1.0
    kmeans_frames: int = 40_000  # latent frames the codebooks are k-means-initialised on (~20 per centroid)
    # A denoising codec (session 58; "A codec that hears through noise" in the module docstring). Defaults: off,
    # so the shipped codec's command reproduces it.
    denoise: int = 0  # 1: a noised crop's reconstruction and frame-mel targets are the crop without its noise
    consistency_weight: float = 0.0  # pull the first codebooks' input for a noised crop to the clean crop's
    stream_noise: int = 0  # 1: noise of the six kinds the noised streams carry (egomem.trigger.noise)
    init_weights: str = ""  # start from a trained codec (no input scaling, no k-means; use --warmup-steps 0)

    def key(self) -> dict:
        return dict(vars(self))


# ----------------------------------------------------------------------------------------------
# data


def speech_files(roots: list[Path]) -> list[Path]:
    """The training utterances under `roots` (see the module docstring for the held-out rule)."""
    from egomem.trigger.synth import source_files

    files: list[Path] = []
    for root in roots:
        if not root.is_dir():
            raise SystemExit(f"--data {root} is not a folder of speech (*.flac / *.wav)")
        if (root / "cohort").is_dir() and (root / "test-other").is_dir():
            users, assistant = source_files(root, "train")
            files += users + assistant
        else:
            files += sorted(p for p in root.rglob("*") if p.suffix.lower() in AUDIO_SUFFIXES)
    if not files:
        raise SystemExit(f"no speech files (*.flac, *.wav) under {', '.join(map(str, roots))}; pass --data "
                         f"<folder>, e.g. LibriSpeech (the project's shared set: /work/shared/data/speech)")
    return files


class SpeechCrops:
    """Training utterances at 24 kHz with their GE2E voice embeddings; draws seeded, augmented crops."""

    def __init__(self, files: list[Path], progress: bool = True) -> None:
        from tqdm import tqdm

        from egomem.identity.voice import to_16k
        from egomem.trigger.synth import default_voice_encoder, load_24k

        voice = default_voice_encoder()
        self.audio: list[np.ndarray] = []
        voices = []
        for p in tqdm(files, desc="load speech", unit="utt", disable=not progress):
            x = load_24k(p)
            if len(x) < FRAME_SAMPLES * 4:
                continue
            x = x / (np.abs(x).max() + 1e-9)
            self.audio.append(x.astype(np.float32))
            e = np.asarray(voice.embed_speech(to_16k(x, SAMPLE_RATE)), np.float32)
            voices.append(e / (np.linalg.norm(e) + 1e-9))
        if not self.audio:
            raise SystemExit("every speech file is shorter than 0.32 s")
        self.voices = np.stack(voices)  # [U, 256]
        lengths = np.array([len(a) for a in self.audio], np.float64)
        self.weights = lengths / lengths.sum()  # sample utterances by length: every second equally likely
        self.seconds = float(lengths.sum() / SAMPLE_RATE)

    def _crop(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, int]:
        u = int(rng.choice(len(self.audio), p=self.weights))
        a = self.audio[u]
        if len(a) <= n:
            return np.pad(a, (0, n - len(a))), u
        s = int(rng.integers(0, len(a) - n))
        return a[s:s + n], u

    def batch(self, rng: np.random.Generator, batch: int, frames: int, noise_p: float, stream_noise: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(audio [B, 1, frames*1920], GE2E targets [B, 256], the same audio without its noise) for one step.

        `stream_noise`: the noise is one of the noised streams' six kinds (`egomem.trigger.noise`, babble of
        training utterances), else coloured noise or two-voice babble as the shipped codec trained on."""
        from egomem.trigger.noise import background
        from egomem.trigger.synth import make_noise

        n = frames * FRAME_SAMPLES
        xs, vs, cleans = [], [], []
        for _ in range(batch):
            x, u = self._crop(rng, n)
            x = x * 10 ** rng.uniform(-1.3, -0.1)  # peak level -26..-2 dBFS
            cleans.append(np.clip(x, -1, 1))
            if rng.random() < noise_p:
                rms = np.sqrt(np.mean(x**2)) + 1e-9
                if stream_noise:
                    noise = background(rng, n, self.audio)
                elif rng.random() < 0.5:
                    noise = make_noise(rng, n)
                else:  # babble: two other training utterances
                    noise = sum(self._crop(rng, n)[0] for _ in range(2))
                    noise = noise / (np.sqrt(np.mean(noise**2)) + 1e-9)
                x = x + noise * rms / 10 ** (rng.uniform(0, 20) / 20)
            xs.append(np.clip(x, -1, 1))
            vs.append(self.voices[u])
        as_batch = lambda a: torch.from_numpy(np.stack(a)[:, None].astype(np.float32))  # noqa: E731
        return as_batch(xs), torch.from_numpy(np.stack(vs)), as_batch(cleans)


# ----------------------------------------------------------------------------------------------
# losses


class MelLoss(torch.nn.Module):
    """Multi-scale mel L1 (log and linear magnitudes), as in EnCodec/Mimi's reconstruction losses."""

    def __init__(self) -> None:
        super().__init__()
        import torchaudio

        self.mels = torch.nn.ModuleList(
            torchaudio.transforms.MelSpectrogram(SAMPLE_RATE, n_fft=w, win_length=w, hop_length=w // 4,
                                                 n_mels=N_MELS, power=1.0, normalized=False)
            for w in MEL_WINDOWS)

    def forward(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        loss = y.new_zeros(())
        for mel in self.mels:
            my, mx = mel(y), mel(x)
            loss = loss + (my - mx).abs().mean() + (torch.log(my + 1e-5) - torch.log(mx + 1e-5)).abs().mean()
        return loss / len(self.mels)


class FrameMel(torch.nn.Module):
    """Log-mel spectrum of each 80 ms frame (one row per latent frame): the content distillation target."""

    def __init__(self) -> None:
        super().__init__()
        import torchaudio

        self.mel = torchaudio.transforms.MelSpectrogram(SAMPLE_RATE, n_fft=FRAME_SAMPLES, hop_length=FRAME_SAMPLES,
                                                        n_mels=N_MELS, power=1.0, center=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, 1, T * 1920] -> [B, T, N_MELS]."""
        return torch.log(self.mel(x[:, 0]) + 1e-5).transpose(1, 2)


def mel_distance(y: torch.Tensor, x: torch.Tensor) -> float:
    """Log-mel L1 distance at 1024/256 (the benchmark's reconstruction figure; lower is better)."""
    import torchaudio

    mel = torchaudio.transforms.MelSpectrogram(SAMPLE_RATE, n_fft=1024, hop_length=256, n_mels=N_MELS, power=1.0)
    return float((torch.log(mel(y) + 1e-5) - torch.log(mel(x) + 1e-5)).abs().mean())


def si_snr(y: torch.Tensor, x: torch.Tensor) -> float:
    """Scale-invariant SNR (dB) of a reconstruction `y` of `x` (1-D tensors)."""
    x = x - x.mean()
    y = y - y.mean()
    target = (y @ x) / (x @ x + 1e-9) * x
    return float(10 * torch.log10((target @ target) / ((y - target) @ (y - target) + 1e-9) + 1e-9))


# ----------------------------------------------------------------------------------------------
# the quantiser


def codebooks(model: torch.nn.Module) -> list[tuple[torch.nn.Module, list[torch.nn.Module]]]:
    """(residual quantiser, its codebook layers) for Mimi's split RVQ: the first (semantic) and the rest."""
    q = model.quantizer
    return [(rvq, list(rvq.vq.layers)) for rvq in (q.rvq_first, q.rvq_rest)]


def set_quantization(model: torch.nn.Module, no_quantization_rate: float, q_dropout: bool) -> None:
    for rvq, _ in codebooks(model):
        rvq.no_quantization_rate = no_quantization_rate
    model.quantizer.rvq_rest.q_dropout = q_dropout


@torch.no_grad()
def kmeans_init(model: torch.nn.Module, crops: SpeechCrops, cfg: CodecTrainConfig, progress: bool = True) -> None:
    """Initialise every codebook by k-means on its own residuals of real speech latents, layer by layer."""
    from moshi.quantization.core_vq import _run_kmeans
    from tqdm import tqdm

    rng = np.random.default_rng([cfg.seed, 1, 0])
    latents = []
    n_batches = -(-cfg.kmeans_frames // (cfg.batch * cfg.crop_frames))
    model.eval()
    for _ in tqdm(range(n_batches), desc="latents for k-means", disable=not progress):
        x, _, _ = crops.batch(rng, cfg.batch, cfg.crop_frames, cfg.noise_p)
        latents.append(model._encode_to_unquantized_latent(x))  # [B, D, T]
    emb = torch.cat(latents, 0)
    torch.manual_seed(cfg.seed)  # _run_kmeans samples its starting means with torch's global RNG
    for rvq, layers in tqdm(codebooks(model), desc="k-means codebooks", disable=not progress):
        residual = rvq.input_proj(emb)  # [B, d, T]
        residual = residual.transpose(0, 1).reshape(rvq.dimension, -1)[None]  # [1, d, N]: all frames as one row
        for layer in layers:
            cb = layer._codebook
            x = layer.project_in(residual.transpose(1, 2))[0]  # [N, d]
            centroids, usage = _run_kmeans(x, cb.codebook_size, num_iters=20)
            cb.embedding_sum.data.copy_(centroids * usage[:, None])
            cb.cluster_usage.data.copy_(usage.float())
            cb._initialized.data.fill_(1.0)
            cb.register_buffer("_embedding", None, persistent=False)
            residual = residual - layer.decode(layer.encode(residual))
    model.train()


@torch.no_grad()
def scale_input_conv(model: torch.nn.Module, crops: SpeechCrops, cfg: CodecTrainConfig) -> float:
    """Scale the encoder's first convolution so that real speech drives it at unit std; returns the factor.

    Speech sits at ~0.05 RMS; with PyTorch's default init the first layer's output is then ~95 %
    bias, the signal fades through the ELU stack, and the encoder's latent barely follows the audio:
    the model learns an average spectrum for thousands of steps (measured: a speaker probe on the
    latent at chance after 700 steps; 14 % after 200 with this scaling). Scaling every convolution
    (LSUV) was tried too and learnt slower (its decoder starts far too loud)."""
    conv = model.encoder.model[0].conv.conv
    x, _, _ = crops.batch(np.random.default_rng([cfg.seed, 2, 0]), cfg.batch, cfg.crop_frames, cfg.noise_p)
    signal = torch.nn.functional.conv1d(x, conv.weight)  # the input-driven part, no bias
    factor = float(1.0 / (signal.std() + 1e-9))
    conv.weight.mul_(factor)
    return factor


# ----------------------------------------------------------------------------------------------
# training


def lr_at(step: int, cfg: CodecTrainConfig) -> float:
    """Linear warm-up over 100 steps, cosine to a tenth by the end."""
    warm = min(1.0, (step + 1) / 100)
    return cfg.lr * warm * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * min(1.0, step / cfg.steps))))


class CodecTrainer:
    """One seeded, resumable training run of the tiny Mimi (state in `<work>/last.pt`)."""

    def __init__(self, cfg: CodecTrainConfig, crops: SpeechCrops, work: Path, mimi: MimiConfig | None = None) -> None:
        from egomem.codec.mimi import build_mimi

        self.cfg, self.crops, self.work = cfg, crops, work
        mimi = mimi or MimiConfig(random_init=True)
        if mimi.preset != "tiny":
            log.warning("training the '%s' Mimi preset on a CPU takes far longer than 'tiny' (about an hour)", mimi.preset)
        torch.manual_seed(cfg.seed)
        if cfg.init_weights:  # fine-tune a trained codec: its input scaling and codebooks are kept
            mimi = MimiConfig(**{**vars(mimi), "weights": Path(cfg.init_weights), "random_init": False})
        self.model = build_mimi(mimi).train()
        if not cfg.init_weights:
            scale_input_conv(self.model, crops, cfg)
        dim = self.model.quantizer.rvq_first.output_dimension
        self.heads = torch.nn.ModuleDict({"speaker": torch.nn.Linear(dim, crops.voices.shape[1]),
                                          "frame_mel": torch.nn.Linear(dim, N_MELS)})
        self.params = [p for p in self.model.parameters() if p.requires_grad] + list(self.heads.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=(0.8, 0.99), weight_decay=0.0)
        self.mel = MelLoss()
        self.frame_mel = FrameMel()
        self.step = 0
        self.history: list[dict] = []

    @property
    def ckpt(self) -> Path:
        return self.work / "last.pt"

    def save(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        tmp = self.ckpt.with_suffix(".tmp")
        torch.save({"model": self.model.state_dict(), "heads": self.heads.state_dict(),
                    "opt": self.opt.state_dict(), "step": self.step, "history": self.history,
                    "cfg": self.cfg.key()}, tmp)
        tmp.replace(self.ckpt)  # atomic: a kill mid-save keeps the previous state

    def resume(self) -> bool:
        if not self.ckpt.is_file():
            return False
        state = torch.load(self.ckpt, map_location="cpu", weights_only=False)
        if state["cfg"] != self.cfg.key():
            raise SystemExit(f"{self.ckpt} was made with other settings ({state['cfg']}); "
                             f"pass --no-resume or another --work")
        self.model.load_state_dict(state["model"])
        for _, layers in codebooks(self.model):
            for layer in layers:
                layer._codebook._cached_initialized = False
                layer._codebook.register_buffer("_embedding", None, persistent=False)
        self.heads.load_state_dict(state["heads"])
        self.opt.load_state_dict(state["opt"])
        self.step, self.history = state["step"], state["history"]
        return True

    def train_step(self) -> dict:
        cfg, step = self.cfg, self.step
        if step == cfg.warmup_steps and not cfg.init_weights:
            kmeans_init(self.model, self.crops, cfg, progress=False)
        if step < cfg.warmup_steps:
            set_quantization(self.model, 1.0, q_dropout=False)
        elif step < cfg.steps * (1 - cfg.quantized_tail):
            set_quantization(self.model, 0.5, q_dropout=True)
        else:
            set_quantization(self.model, 0.0, q_dropout=False)
        torch.manual_seed(cfg.seed * 1_000_003 + step)  # no-quantisation masks: a function of the step
        self.model.quantizer.rvq_rest.rng_dropout.seed(cfg.seed * 1_000_003 + step)
        for g in self.opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        x, voice, clean = self.crops.batch(np.random.default_rng([cfg.seed, step]), cfg.batch, cfg.crop_frames,
                                           cfg.noise_p, bool(cfg.stream_noise))
        target = clean if cfg.denoise else x
        emb = self.model._encode_to_unquantized_latent(x)
        q = self.model.quantizer(emb, self.model.frame_rate)
        y = self._decode(q.x)
        mel = self.mel(y, target)
        wav = (y - target).abs().mean()
        frames = q.x.transpose(1, 2)  # [B, T, D]: every frame's quantised latent
        spk = 1 - F.cosine_similarity(self.heads["speaker"](frames), voice[:, None, :], dim=-1).mean()
        frame_mel = (self.heads["frame_mel"](frames) - self.frame_mel(target)).abs().mean()
        commit = q.penalty if q.penalty is not None else y.new_zeros(())
        commit_weight = cfg.commit_weight if step >= cfg.warmup_steps else 0.0  # no pull to unfit codebooks
        consistency = y.new_zeros(())
        if cfg.consistency_weight:  # the first codebooks' inputs of the noised crop -> those of the clean one
            with torch.no_grad():
                emb_clean = self.model._encode_to_unquantized_latent(clean)
            for rvq, _ in codebooks(self.model):
                ref = rvq.input_proj(emb_clean)
                consistency = consistency + F.mse_loss(rvq.input_proj(emb), ref) / (ref.var() + 1e-9)
        loss = (mel + cfg.waveform_weight * wav + cfg.speaker_weight * spk + cfg.frame_mel_weight * frame_mel
                + commit_weight * commit + cfg.consistency_weight * consistency)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.step += 1
        rec = {"step": self.step, "loss": loss.item(), "mel": mel.item(), "wav": wav.item(), "speaker": spk.item(),
               "frame_mel": frame_mel.item(), "commit": commit.item(), "consistency": consistency.item()}
        self.history.append(rec)
        return rec

    def _decode(self, latent: torch.Tensor) -> torch.Tensor:
        """Quantised latent at the frame rate -> waveform (MimiModel.decode without the codebook lookup)."""
        m = self.model
        z = m._to_encoder_framerate(latent)
        if m.decoder_transformer is not None:
            (z,) = m.decoder_transformer(z)
        return m.decoder(z)


def save_codec(model: torch.nn.Module, path: Path, meta: dict) -> None:
    """The Mimi state dict (fp32: the codes must equal the trained model's) + metadata strings."""
    from safetensors.torch import save_file

    model.eval()
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path), metadata={k: str(v) for k, v in meta.items()})


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="egomem train-codec", description=__doc__.split("\n\n")[0])
    d = CodecTrainConfig()
    p.add_argument("--data", type=Path, action="append", required=True,
                   help="speech folder (repeatable): a LibriSpeech root with cohort/ + test-other/ (training split "
                        "only), or any folder of *.flac / *.wav")
    p.add_argument("--out", type=Path, default=SHIPPED_TINY_CODEC, help="the trained codec (safetensors)")
    p.add_argument("--work", type=Path, default=REPO_ROOT / "runs" / "codec",
                   help="resumable training state (last.pt, log.jsonl); rerunning the command resumes")
    p.add_argument("--config", type=Path, help="EgoMem TOML config (mimi.preset and mimi.seed pick the model trained)")
    p.add_argument("--no-resume", action="store_true")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    for name, value in vars(d).items():
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    return p.parse_args(argv)


def release_freed_memory() -> None:
    """Hand the heap's freed pages back to the OS (glibc `malloc_trim`), called every few steps.

    Without it the training loop's freed activations stay in glibc's heap, fragmented: the process grew
    ~10 MB per step and was killed for memory after 1,560 steps on a 24 GB machine. A fixed mmap
    threshold also stops the growth but made steps 2.5x slower; trimming every 10 steps costs nothing
    measurable. No effect on results."""
    import ctypes
    import ctypes.util

    libc = ctypes.util.find_library("c")
    if libc and sys.platform.startswith("linux"):
        ctypes.CDLL(libc).malloc_trim(0)


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = CodecTrainConfig(**{k: getattr(args, k) for k in vars(CodecTrainConfig())})
    files = speech_files(args.data)
    crops = SpeechCrops(files)
    log.info("train-codec: %d utterances, %.1f min of speech", len(crops.audio), crops.seconds / 60)
    from egomem.config import load_config

    mimi = load_config(args.config).mimi
    mimi = MimiConfig(**{**vars(mimi), "weights": None, "random_init": True})  # training starts from the seeded init
    trainer = CodecTrainer(cfg, crops, args.work, mimi)
    if args.no_resume and trainer.ckpt.exists():
        trainer.ckpt.unlink()
    if trainer.resume():
        log.info("resuming from %s at step %d", trainer.ckpt, trainer.step)
    t0 = time.time()
    bar = tqdm(range(trainer.step, cfg.steps), initial=trainer.step, total=cfg.steps, desc="train codec", unit="step")
    log_path = args.work / "log.jsonl"
    args.work.mkdir(parents=True, exist_ok=True)
    for _ in bar:
        rec = trainer.train_step()
        if trainer.step % 10 == 0:
            release_freed_memory()
        bar.set_postfix(mel=f"{rec['mel']:.3f}", spk=f"{rec['speaker']:.3f}")
        if trainer.step % 100 == 0 or trainer.step == cfg.steps:
            with log_path.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            trainer.save()
    last = trainer.history[-100:]
    meta = {
        "format": "egomem-mimi-tiny/1",
        "trained": "egomem train-codec",
        "train_command": "egomem train-codec " + shlex.join(argv),
        "seed": cfg.seed, "steps": cfg.steps, "config": json.dumps(cfg.key()),
        "utterances": len(crops.audio), "speech_minutes": round(crops.seconds / 60, 1),
        "final_mel_loss": round(float(np.mean([r["mel"] for r in last])), 4) if last else "nan",
        "train_seconds_last_run": round(time.time() - t0, 1),
    }
    save_codec(trainer.model, args.out, meta)
    print(json.dumps({"out": str(args.out), **meta}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
