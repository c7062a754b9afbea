"""The `egomem` command line: serve, doctor, and the project's jobs.

Every subcommand takes `--config PATH` (TOML; see README "Configuration") and has `--help`.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from egomem.config import ConfigError, load_config


def _add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="PATH", help="TOML config file (default: $EGOMEM_CONFIG, else built-in defaults)")


def cmd_serve(args: argparse.Namespace) -> int:
    """Start tritonserver on the model repository and keep it up until Ctrl-C / SIGTERM."""
    from egomem.serving.launcher import TritonServer

    cfg = load_config(args.config)
    if args.models:
        cfg.server.models = args.models.split(",")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server = TritonServer(cfg)
    print(f"starting tritonserver with models {cfg.server.models} (log: {server.log_path}) ...", flush=True)
    with server:
        print(f"ready: gRPC {server.grpc_url}, HTTP {server.http_url}, metrics :{cfg.server.metrics_port}. "
              f"Ctrl-C to stop.", flush=True)
        while not stop.wait(1.0):
            if not server.is_alive():
                print(f"tritonserver exited unexpectedly.\n{server.log_tail()}", file=sys.stderr)
                return 1
    print("stopped.")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    """Check the installation and print what to do about each problem."""
    from egomem.doctor import run_doctor

    return run_doctor(load_config(args.config))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="egomem",
        description="EgoMem: lifelong memory of people for full-duplex speech+vision dialog models, served on Triton.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="start tritonserver (and the service) on the embedded defaults",
                       description=cmd_serve.__doc__)
    _add_config(p)
    p.add_argument("--models", help="comma-separated models to load (default: server.models)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("doctor", help="check the installation; say what to do for each problem",
                       description=cmd_doctor.__doc__)
    _add_config(p)
    p.set_defaults(func=cmd_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"configuration error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
