"""EgoMem configuration: one typed place, defaults that run offline.

Sources, later ones win:
  1. the dataclass defaults below (they run on a laptop CPU with no network);
  2. a TOML file (`--config PATH`, or the `EGOMEM_CONFIG` environment variable);
  3. environment overrides `EGOMEM__<SECTION>__<KEY>=value` (e.g. `EGOMEM__SERVER__GRPC_PORT=9001`).

Every path to weights is explicit: `None` means "use the offline default" and the code says so
plainly in its logs and in `egomem doctor`. Invalid values raise `ConfigError`, which names the key
and the values it allows.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

REPO_ROOT = Path(__file__).resolve().parent.parent
ENV_PREFIX = "EGOMEM__"
CONFIG_ENV = "EGOMEM_CONFIG"

Device = Literal["auto", "cpu", "cuda"]


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
    host: str = "127.0.0.1"  # address the orchestrator dials
    startup_timeout_s: float = 180.0  # torch import + model build per Python stub on a 2-core CPU
    shutdown_timeout_s: float = 30.0
    device: Device = "auto"  # auto: KIND_GPU when CUDA is visible, else KIND_CPU
    models: list[str] = field(default_factory=lambda: ["mimi_codec"])  # loaded at start
    tritonserver_binary: Path | None = None  # None: the one inside the nvidia-pytriton wheel
    log_verbose: int = 0


@dataclass
class MimiConfig:
    """The Mimi neural audio codec (24 kHz PCM <-> 8 codebooks at 12.5 Hz)."""

    weights: Path | None = None  # Moshi-format Mimi safetensors; None = random-initialised (offline)
    preset: Literal["tiny", "full"] = "tiny"  # tiny: same classes, fewer channels, real-time on 2 CPU cores
    num_codebooks: int = 8
    max_streams: int = 64  # streaming-state slots held by one mimi_codec instance
    stream_ttl_s: float = 600.0  # a stream idle this long is reclaimed
    seed: int = 1234  # random-initialised weights are seeded, so every process agrees


@dataclass
class DialogConfig:
    """The RQ-Transformer dialog engine (`dialog_lm`). Owned by the dialog-engine work (issue 3)."""

    weights: Path | None = None  # Moshi-format LM safetensors; None = tiny random-initialised config
    tokenizer: Path | None = None  # SentencePiece .model; None = byte-level tokenizer (offline default)
    preset: Literal["tiny", "7b"] = "tiny"
    max_streams: int = 16
    seed: int = 1234


@dataclass
class IdentityConfig:
    """Face + voice identification (`face_encoder`, `speaker_encoder`). Owned by issue 4."""


@dataclass
class RetrievalConfig:
    """Level-2 text retrieval (`text_encoder`, BM25 -> embedding re-rank). Owned by issue 4."""


@dataclass
class MemoryConfig:
    """The durable memory store and the memory manager. Owned by issue 5."""

    database: Path = REPO_ROOT / "runs" / "memory.sqlite3"


@dataclass
class LLMConfig:
    """Any OpenAI-compatible chat endpoint for the extractor / update agent. Owned by issue 5."""

    base_url: str = "https://api.deepseek.com/v1"
    model: str = "deepseek-chat"
    api_key_env: str = "DEEPSEEK_API_KEY"  # the key is read from this variable, never from the file


@dataclass
class TriggerConfig:
    """The episodic trigger (`episodic_trigger`). Owned by issue 5."""


@dataclass
class OrchestratorConfig:
    """The aiohttp service. Owned by issue 6."""

    host: str = "127.0.0.1"
    port: int = 8998


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
    return cfg


def _parse_env_value(raw: str) -> Any:
    """Environment values are TOML literals when they parse as one (numbers, booleans, arrays), else strings."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


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


def to_toml(cfg: Config) -> str:
    """Render the resolved config as TOML (the launcher hands it to the model processes)."""
    lines: list[str] = []
    for section in dataclasses.fields(cfg):
        obj = getattr(cfg, section.name)
        lines.append(f"[{section.name}]")
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if v is None:
                continue  # absent key = default None
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
