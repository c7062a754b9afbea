"""Start, watch and stop a real `tritonserver` on the project's model repository.

On CPU machines the binary is the one inside the `nvidia-pytriton` wheel (docs/protocol.md#running-tritonserver-from-the-wheel): its
bundled libraries must be on LD_LIBRARY_PATH, the Python backend lives in a folder we assemble
from the wheel (backend library + utils + the stub built for this Python), and the virtualenv
must be active in the server's environment so the stub can import numpy, torch and `egomem`.

The server runs in its own process group; `stop()` (also called on Ctrl-C, at interpreter exit
and by test fixtures) sends SIGTERM to the group, waits, then SIGKILLs, so no stub is orphaned.
Started from the main thread it also gets SIGTERM when its parent dies, even by SIGKILL (Linux
PR_SET_PDEATHSIG), so a killed `egomem serve` leaves no server behind; `restart()` brings a dead
server back on the same ports with the same models. Its log and run folder are owner-only (0600 /
0700): logs can hold stream ids and request details.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from egomem.config import Config, to_toml

log = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """tritonserver could not be found, started, or made ready. The message says what to do."""


@dataclass(frozen=True)
class TritonInstall:
    """Where the pieces of a wheel-shipped Triton live on this machine."""

    binary: Path
    libs: Path | None  # nvidia_pytriton.libs (bundled shared libraries)
    python_backend: Path  # folder with libtriton_python.so + triton_python_backend_utils.py
    stub: Path  # triton_python_backend_stub built for this Python version


def find_triton(binary: Path | None = None) -> TritonInstall:
    """Locate the tritonserver binary and its Python backend; raise LaunchError naming what is missing."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise LaunchError(
            "the nvidia-pytriton package is not installed; it carries the tritonserver binary. "
            "Run the README's setup command (or `pip install nvidia-pytriton==0.7.0`)."
        )
    root = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    binary = binary or root / "bin" / "tritonserver"
    libs = root.parent.parent / "nvidia_pytriton.libs"
    backend = root / "backends" / "python"
    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / pyver / "triton_python_backend_stub"
    for what, path in [("tritonserver binary", binary), ("Python backend", backend / "libtriton_python.so"),
                       (f"Python backend stub for Python {pyver}", stub)]:
        if not path.exists():
            raise LaunchError(f"{what} not found at {path}; reinstall nvidia-pytriton==0.7.0 for Python {pyver}")
    return TritonInstall(binary, libs if libs.is_dir() else None, backend, stub)


def cuda_available() -> bool:
    """True when a CUDA device is usable (then models get KIND_GPU instances)."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - torch missing or broken CUDA runtime: treat as CPU
        return False


# -- child processes: owner-only files, die with the parent --------------------------------------
CHILD_EXEC = Path(__file__).with_name("child_exec.py")  # run as a script: sets the death signal, then execs
CHILD_UMASK = 0o077  # a service's files are owner-only too (Popen's `umask`, applied between fork and exec)


def private_dir(path: Path) -> Path:
    """mkdir -p `path` and make it owner-only (0700): run folders hold logs, tokens and recordings."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def open_private_log(path: Path):
    """`path` opened for appending (unbuffered), created or narrowed to owner-only 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)  # an older log may have been created 0644
    return os.fdopen(fd, "ab", buffering=0)


def child_argv(argv: list[str], deathsig: int | None = signal.SIGTERM) -> list[str]:
    """`argv` as the launcher starts a service process: through `child_exec.py`, which makes it get
    `deathsig` once this process dies, however it dies, when called from the main thread on Linux (the
    kernel sends it when the *thread* that forked the child ends, so children of other threads get
    none; the caller's pid file covers them); else `argv` itself."""
    main_thread = threading.current_thread() is threading.main_thread()
    if deathsig is None or not sys.platform.startswith("linux") or not main_thread:
        return list(argv)
    return [sys.executable, str(CHILD_EXEC), str(int(deathsig)), str(os.getpid()), *argv]


def start_child(argv: list[str], log, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a service process: its own session, stdin closed, stdout and stderr to `log` (an open file),
    owner-only files (`CHILD_UMASK`), and SIGTERM once this process dies (`child_argv`)."""
    return subprocess.Popen(child_argv(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, start_new_session=True, umask=CHILD_UMASK)


def process_start_time(pid: int) -> int | None:
    """The kernel's start time of `pid` (clock ticks since boot; tells a pid from its reuse), None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])


def port_owner(port: int) -> str | None:
    """'pid N (name)' of the process listening on TCP `port`, from /proc (Linux); None if unknown."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{f[9]}]")
    if not inodes:
        return None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd) in inodes:
                    name = (proc / "comm").read_text().strip()
                    return f"pid {proc.name} ({name})"
        except OSError:
            continue
    return "a process of another user"


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports: all n stay bound until every one is picked (ports taken one at a time
    can repeat, since the OS may hand a just-released port out again)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def free_port() -> int:
    """One free TCP port; take several with `free_ports(n)`, not with repeated calls."""
    return free_ports(1)[0]


class TritonServer:
    """One tritonserver process on the project's model repository (explicit model control).

    Use as a context manager, or `start()` / `stop()`. `models` are loaded at start; more can be
    loaded later with `load()`.
    """

    def __init__(self, cfg: Config, models: list[str] | None = None, run_dir: Path | None = None,
                 env: dict[str, str] | None = None):
        self.cfg = cfg
        self.models = list(cfg.server.models if models is None else models)
        self.run_dir = Path(run_dir or cfg.server.run_dir)
        self.extra_env = dict(env or {})
        self.proc: subprocess.Popen | None = None
        self.log_path = self.run_dir / "tritonserver.log"
        self.device = self._resolve_device()

    # -- addresses ------------------------------------------------------------------------------
    @property
    def grpc_url(self) -> str:
        return f"{self.cfg.server.host}:{self.cfg.server.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.cfg.server.host}:{self.cfg.server.http_port}"

    def _resolve_device(self) -> str:
        d = self.cfg.server.device
        if d == "auto":
            return "cuda" if cuda_available() else "cpu"
        if d == "cuda" and not cuda_available():
            raise LaunchError("server.device = 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
        return d

    # -- preparation ----------------------------------------------------------------------------
    def _prepare(self, inst: TritonInstall) -> tuple[list[str], dict[str, str]]:
        """Assemble backend folder, rendered repository, resolved config; return argv and env."""
        private_dir(self.run_dir)
        backends = self.run_dir / "backends" / "python"
        backends.mkdir(parents=True, exist_ok=True)
        for src in (inst.python_backend / "libtriton_python.so",
                    inst.python_backend / "triton_python_backend_utils.py", inst.stub):
            dst = backends / src.name
            if dst.is_symlink() or dst.exists():
                dst.unlink()
            dst.symlink_to(src)
        repo = self._render_repository()
        config_path = self.run_dir / "egomem.resolved.toml"
        write_private(config_path, to_toml(self.cfg))

        argv = [
            str(inst.binary),
            f"--model-repository={repo}",
            f"--backend-directory={self.run_dir / 'backends'}",
            "--model-control-mode=explicit",
            *[f"--load-model={m}" for m in self.models],
            f"--http-port={self.cfg.server.http_port}",
            f"--grpc-port={self.cfg.server.grpc_port}",
            f"--metrics-port={self.cfg.server.metrics_port}",
            f"--http-address={self.cfg.server.host}",
            f"--grpc-address={self.cfg.server.host}",
            "--allow-metrics=true",
            "--strict-readiness=true",
            "--exit-on-error=false",
            # Open sequences keep a model "live" at shutdown; don't wait the default 30 s for them.
            f"--exit-timeout-secs={max(1, int(self.cfg.server.shutdown_timeout_s) // 2)}",
            f"--log-verbose={self.cfg.server.log_verbose}",
        ]
        env = dict(os.environ)
        libdirs = [str(inst.libs)] if inst.libs else []
        pylib = sysconfig.get_config_var("LIBDIR")  # this Python's libpython, so the stub embeds the same one
        if pylib and list(Path(pylib).glob("libpython3*.so*")):
            libdirs.append(pylib)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(libdirs + [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p])
        venv = Path(sys.prefix)
        env["VIRTUAL_ENV"] = str(venv)
        env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "")])
        env["EGOMEM_CONFIG"] = str(config_path)
        env.setdefault("HF_HUB_OFFLINE", "1")  # models never reach for a hub
        if self.device == "cpu" and "OMP_NUM_THREADS" not in env:
            # One torch/OpenMP thread per model process: several stubs with a thread per core each
            # oversubscribe the cores and OpenMP's spinning barriers make every step ~40x slower
            # (measured: dialog_lm 25 ms -> 1 s per tick on 2 cores). An explicit $OMP_NUM_THREADS wins.
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = "1"
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        env.update(self.extra_env)
        return argv, env

    def _render_repository(self) -> Path:
        """Copy config.pbtxt files with the instance kind for this device; link version folders."""
        src = Path(self.cfg.server.model_repository)
        if not src.is_dir():
            raise LaunchError(f"model repository {src} not found (server.model_repository)")
        dst = self.run_dir / "model_repository"
        if dst.exists():
            shutil.rmtree(dst)
        dst.mkdir(parents=True)
        kind = "KIND_GPU" if self.device == "cuda" else "KIND_CPU"
        for model_dir in sorted(p for p in src.iterdir() if (p / "config.pbtxt").is_file()):
            out = dst / model_dir.name
            out.mkdir()
            text = (model_dir / "config.pbtxt").read_text()
            (out / "config.pbtxt").write_text(re.sub(r"KIND_(CPU|GPU)", kind, text))
            for child in model_dir.iterdir():
                if child.name != "config.pbtxt":
                    (out / child.name).symlink_to(child.resolve())
        missing = [m for m in self.models if not (dst / m).is_dir()]
        if missing:
            raise LaunchError(f"models {missing} not in repository {src}; available: {sorted(p.name for p in dst.iterdir())}")
        return dst

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, timeout_s: float | None = None, port_wait_s: float = 0.0) -> TritonServer:
        """Start the server and wait until it and its models are ready. `port_wait_s`: how long a
        busy port may take to be freed (a restart after a crash: the old stubs are still exiting)."""
        if self.proc is not None:
            raise LaunchError("this TritonServer is already started")
        inst = find_triton(self.cfg.server.tritonserver_binary)
        deadline = time.monotonic() + port_wait_s
        for port in (self.cfg.server.http_port, self.cfg.server.grpc_port, self.cfg.server.metrics_port):
            while True:
                try:
                    _require_free_port(self.cfg.server.host, port)
                    break
                except LaunchError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.25)
        argv, env = self._prepare(inst)
        logf = open_private_log(self.log_path)
        log.info("starting tritonserver (%s, %s instances), log: %s", inst.binary.name,
                 "GPU" if self.device == "cuda" else "CPU", self.log_path)
        self.proc = start_child(argv, logf, env)
        logf.close()
        atexit.register(self.stop)
        try:
            self.wait_ready(timeout_s or self.cfg.server.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout_s: float) -> None:
        """Poll /v2/health/ready until the server and its loaded models are ready."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise LaunchError(f"tritonserver exited (code {code}) before it was ready.\n{self.log_tail()}")
            if self._http_ok("/v2/health/ready") and all(self._http_ok(f"/v2/models/{m}/ready") for m in self.models):
                return
            failed = self._failed_models()
            if failed:
                raise LaunchError(f"models failed to load: {failed}.\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise LaunchError(f"tritonserver not ready after {timeout_s:.0f} s "
                                  f"(server.startup_timeout_s).\n{self.log_tail()}")
            time.sleep(0.25)

    def _failed_models(self) -> dict[str, str]:
        """Models of ours the repository index reports UNAVAILABLE with a reason (a failed load)."""
        import json

        req = urllib.request.Request(f"{self.http_url}/v2/repository/index", data=b"{}", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=2) as r:
                index = json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError):
            return {}
        return {m["name"]: m.get("reason", "") for m in index
                if m.get("name") in self.models and m.get("state") == "UNAVAILABLE" and m.get("reason")}

    def _http_ok(self, path: str) -> bool:
        try:
            with urllib.request.urlopen(self.http_url + path, timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def load(self, name: str, timeout_s: float | None = None) -> None:
        """Load (or reload) one model through the repository API; raise with the log tail on failure."""
        req = urllib.request.Request(f"{self.http_url}/v2/repository/models/{name}/load", data=b"{}", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.cfg.server.startup_timeout_s):
                pass
        except urllib.error.HTTPError as e:
            body = e.read().decode(errors="replace")
            raise LaunchError(f"loading model {name!r} failed: {body}\n{self.log_tail()}") from e
        if name not in self.models:
            self.models.append(name)

    def restart(self, timeout_s: float | None = None) -> TritonServer:
        """Stop what is left of the server (its stubs too) and start it again on the same ports with
        the same models (those loaded later included)."""
        self.stop()
        return self.start(timeout_s, port_wait_s=30.0)

    def stop(self) -> None:
        """SIGTERM the server's process group, wait, then SIGKILL. Safe to call twice."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        atexit.unregister(self.stop)
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=self.cfg.server.shutdown_timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("tritonserver did not stop in %.0f s; killing it", self.cfg.server.shutdown_timeout_s)
        _signal_group(proc.pid, signal.SIGKILL)  # stubs left behind by a crashed server, if any
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 10
        while group_alive(proc.pid) and time.monotonic() < deadline:  # SIGKILLed stubs: gone in a moment
            time.sleep(0.05)

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no tritonserver log)"
        return "--- tritonserver log (last lines) ---\n" + "\n".join(text[-lines:])

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_alive(pgid: int) -> bool:
    """True while any process of process group `pgid` exists (zombies count until reaped)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path`, owner-only (0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _require_free_port(host: str, port: int) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT from a restarted server is fine
        try:
            s.bind((host, port))
        except OSError:
            owner = port_owner(port)
            raise LaunchError(
                f"port {host}:{port} is in use{f' by {owner}' if owner else ''} (another tritonserver or "
                f"egomem serve?). Stop it, or set server.http_port / grpc_port / metrics_port to free ports."
            ) from None
