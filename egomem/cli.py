"""The `egomem` command line: serve, doctor, and the project's jobs.

Every subcommand takes `--config PATH` (TOML; see README "Configuration") and has `--help`.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from egomem.config import ConfigError, load_config, with_overrides


def _add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="PATH", help="TOML config file (default: $EGOMEM_CONFIG, else built-in defaults)")


SERVE_PARTS = ("triton", "orchestrator", "worker")


def cmd_serve(args: argparse.Namespace) -> int:
    """Start tritonserver, the orchestrator and the memory worker (or the `--parts` this machine runs);
    keep them up until Ctrl-C / SIGTERM.

    A child that dies is restarted (server.max_restarts within server.restart_window_s, with backoff);
    the children die with this process, and <server.run_dir>/serve.pid lets the next `serve` stop any
    left by a killed one."""
    from egomem.serving.launcher import LaunchError
    from egomem.stack import Stack, models_for

    cfg = load_config(args.config)
    if args.models:
        cfg = with_overrides(cfg, {"server": {"models": args.models.split(",")}}, source="--models")
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(SERVE_PARTS))
    if unknown or not parts:
        print(f"--parts {args.parts!r}: choose among {', '.join(SERVE_PARTS)} (comma-separated)", file=sys.stderr)
        return 2
    if args.no_worker and "worker" in parts:
        parts.remove("worker")
    stop = threading.Event()

    def on_signal(*_) -> None:
        if stop.is_set():  # a second Ctrl-C: stop waiting for a restart in progress
            raise KeyboardInterrupt
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    stack = Stack(cfg, models=args.models.split(",") if args.models else models_for(cfg), worker="worker" in parts,
                  triton="triton" in parts, orchestrator="orchestrator" in parts)
    if "triton" in parts:
        print(f"starting tritonserver with models {stack.triton.models} (log: {stack.triton.log_path}) ...", flush=True)
    try:
        with stack:
            ready = []
            if "orchestrator" in parts:
                ready.append(f"chat ws://{cfg.orchestrator.host}:{cfg.orchestrator.port}/api/chat, REST {stack.url}/api, "
                             f"metrics {stack.url}/metrics; tokens in "
                             f"{cfg.orchestrator.tokens_file or cfg.server.run_dir / 'tokens.json'}; Triton replicas "
                             f"{', '.join(cfg.server.grpc_urls())}")
            if "triton" in parts:
                ready.append(f"Triton gRPC {stack.triton.grpc_url}")
            if "worker" in parts:
                ready.append(f"memory worker on {cfg.memory.backend}")
            print(f"ready: {'; '.join(ready)}. Ctrl-C to stop.", flush=True)
            while not stop.wait(1.0):
                try:
                    stack.supervise(stop)
                except LaunchError as e:
                    print(f"giving up: {e}", file=sys.stderr, flush=True)
                    return 1
    except LaunchError as e:
        print(f"egomem serve could not start: {e}", file=sys.stderr, flush=True)
        return 1
    print("stopped.")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """Talk to a running `egomem serve`: microphone (or --audio FILE) and --image or --video files in, events out."""
    import asyncio
    from pathlib import Path

    from egomem.chat import run_chat
    from egomem.stack import tokens_path

    cfg = load_config(args.config)
    token = args.token
    if token is None:
        import json

        path = tokens_path(cfg)
        if not path.is_file():
            print(f"no token: pass --token, or run `egomem serve` first (it writes {path})", file=sys.stderr)
            return 2
        token = next(t for t, scope in json.loads(path.read_text()).items() if scope in ("stream", "admin"))
    url = args.url or f"http://{cfg.orchestrator.host}:{cfg.orchestrator.port}"
    if args.fps <= 0:
        print(f"--fps {args.fps}: must be > 0", file=sys.stderr)
        return 2
    if args.tail is not None and not args.tail >= 0:
        print(f"--tail {args.tail}: must be >= 0", file=sys.stderr)
        return 2
    return asyncio.run(run_chat(url, token, Path(args.audio) if args.audio else None,
                                [Path(p) for p in args.image], args.say, args.seconds,
                                Path(args.save_audio) if args.save_audio else None,
                                video=Path(args.video) if args.video else None, fps=args.fps,
                                max_pixels=cfg.identity.max_image_pixels,
                                max_frame_bytes=cfg.orchestrator.max_message_bytes - 1,  # 1 byte: message kind
                                **({} if args.tail is None else {"tail_s": args.tail})))


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the scripted two-day memory scenario end to end on CPU (a private stack on free ports)."""
    from pathlib import Path

    from egomem.demo import main as demo_main
    from egomem.serving.launcher import free_ports

    cfg = load_config(args.config)
    run_dir = Path(args.out) if args.out else cfg.server.run_dir / "demo"
    demo: dict = {"server": {"run_dir": run_dir}, "orchestrator": {"tokens_file": run_dir / "demo_tokens.json"}}
    if not args.keep_ports:
        http, grpc, metrics, orchestrator = free_ports(4)
        demo["server"].update(http_port=http, grpc_port=grpc, metrics_port=metrics)
        demo["orchestrator"]["port"] = orchestrator
    cfg = with_overrides(cfg, demo, source="egomem demo")
    return demo_main(cfg, Path(args.data) if args.data else None, cfg.server.run_dir, args.seconds)


def cmd_doctor(args: argparse.Namespace) -> int:
    """Check the installation and print what to do about each problem."""
    from egomem.doctor import run_doctor

    return run_doctor(load_config(args.config))


# Jobs with their own parsers (module.main(argv)); imported only when run, so `egomem --help` stays light.
JOBS = {
    "train-codec": ("egomem.codec.train", "train the tiny Mimi codec on speech (resumable); the shipped offline codec"),
    "train-trigger": ("egomem.trigger.train", "train the episodic trigger on synthetic streams (resumable)"),
    "make-corpus": ("egomem.training.build",
                    "synthesise MemChunk training data: people, relation graphs, dialogs, speech, masks"),
    "train-backbone": ("egomem.training.backbone",
                       "pre-train a dialog model to copy from its context (synthetic drills): finetune's start"),
    "finetune": ("egomem.training.finetune", "fine-tune a Moshi-format dialog model on MemChunk data (resumable)"),
    "soup-dialog": ("egomem.training.soup",
                    "average the weights of dialog models fine-tuned from one start (a model soup) into a run folder"),
    "ship-dialog": ("egomem.training.ship",
                    "a fine-tuned dialog model as the small checkpoint serving loads with no config (bf16 + metadata)"),
    "eval-dialog": ("egomem.training.eval_dialog",
                    "evaluate how a dialog model uses its memory: Fact Score, query words, fps (paper Table 3)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="egomem",
        description="EgoMem: lifelong memory of people for full-duplex speech+vision dialog models, served on Triton.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="start tritonserver (and the service) on the embedded defaults",
                       description=cmd_serve.__doc__)
    _add_config(p)
    p.add_argument("--models", help="comma-separated models to load (default: what the orchestrator needs)")
    p.add_argument("--no-worker", action="store_true", help="do not run a memory worker in this process")
    p.add_argument("--parts", default=",".join(SERVE_PARTS), metavar="LIST",
                   help="what this machine runs, comma-separated among triton, orchestrator, worker (default: all; "
                        "several machines: README 'Several machines')")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("chat", help="terminal chat client: microphone or a speech file, images, events",
                       description=cmd_chat.__doc__)
    _add_config(p)
    p.add_argument("--url", help="orchestrator base URL (default: from [orchestrator] host/port)")
    p.add_argument("--token", help="bearer token (default: the first one in the tokens file `serve` wrote)")
    p.add_argument("--audio", metavar="FILE", help="speech file to stream in real time (default: the microphone)")
    camera = p.add_mutually_exclusive_group()
    camera.add_argument("--image", metavar="FILE", action="append", default=[],
                        help="camera frame (JPEG/PNG); repeatable, sent once a second in turn")
    camera.add_argument("--video", metavar="FILE",
                        help="video file (mp4/webm/mkv/avi/...): its frames in real time; its audio when no --audio")
    p.add_argument("--fps", type=float, default=1.0,
                   help="frames per second taken from --video (default 1; the server identifies every 2 s)")
    p.add_argument("--say", metavar="TEXT", help="what the user says, as a transcript line (no ASR on the client)")
    p.add_argument("--seconds", type=float, help="stop after this many seconds of audio")
    p.add_argument("--save-audio", metavar="WAV", help="write the model's voice here")
    p.add_argument("--tail", type=float, default=None, metavar="SECONDS",
                   help="silence streamed after an --audio/--video file's sound, so the model can answer (default 4)")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("demo", help="scripted two-day memory scenario, end to end on CPU",
                       description=cmd_demo.__doc__)
    _add_config(p)
    p.add_argument("--data", help="folder with the demo's speech and face files (default: tests/data/identity)")
    p.add_argument("--out", help="output folder (default: <server.run_dir>/demo)")
    p.add_argument("--seconds", type=float, default=6.0, help="seconds of speech per visit")
    p.add_argument("--keep-ports", action="store_true", help="use the configured ports instead of free ones")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("doctor", help="check the installation; say what to do for each problem",
                       description=cmd_doctor.__doc__)
    _add_config(p)
    p.set_defaults(func=cmd_doctor)

    for name, (_, help_text) in JOBS.items():  # each job owns its arguments: `egomem <job> --help` lists them
        sub.add_parser(name, help=help_text, add_help=False).set_defaults(func=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in JOBS:
        import importlib

        job = importlib.import_module(JOBS[argv[0]][0])
        try:
            return int(job.main(argv[1:]) or 0)
        except ConfigError as e:
            print(f"configuration error: {e}", file=sys.stderr)
            return 2
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"configuration error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
