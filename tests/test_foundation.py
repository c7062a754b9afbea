"""The foundation: typed config, the CLI, `egomem doctor`, and the tritonserver launcher's lifecycle."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import test_config

from egomem.cli import build_parser, main
from egomem.config import ConfigError, load_config, to_toml
from egomem.doctor import run_doctor
from egomem.serving.launcher import LaunchError, TritonServer

REPO = Path(__file__).resolve().parent.parent
EGOMEM = str(Path(sys.executable).parent / "egomem")


# -- config --------------------------------------------------------------------------------------


def test_defaults_run_offline_and_round_trip_through_toml(tmp_path):
    cfg = load_config(env={})
    assert cfg.mimi.weights is None and cfg.server.device == "auto"
    cfg.mimi.max_streams = cfg.orchestrator.max_streams = 3
    cfg.server.models = ["mimi_codec", "dialog_lm"]
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    again = load_config(path, env={})
    assert again == cfg
    cfg.dialog.start_temperature = None  # a None whose default is "auto" survives the trip (the model processes')
    path.write_text(to_toml(cfg))
    assert load_config(path, env={}).dialog.start_temperature is None


def test_toml_then_env_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[server]\ngrpc_port = 9100\n[mimi]\nweights = "/w/mimi.safetensors"\n')
    cfg = load_config(path, env={"EGOMEM__SERVER__GRPC_PORT": "9200", "EGOMEM__MIMI__MAX_STREAMS": "5",
                                 "EGOMEM__ORCHESTRATOR__MAX_STREAMS": "5"})
    assert cfg.server.grpc_port == 9200  # env beats the file
    assert cfg.mimi.max_streams == 5
    assert cfg.mimi.weights == Path("/w/mimi.safetensors")
    cfg = load_config(env={"EGOMEM_CONFIG": str(path)})
    assert cfg.server.grpc_port == 9100


@pytest.mark.parametrize(
    "toml, env, message",
    [
        ('[mimi]\npreset = "huge"\n', {}, "mimi.preset = 'huge' is not allowed; allowed values: 'tiny', 'full'"),
        ('[server]\ndevice = "tpu"\n', {}, "allowed values: 'auto', 'cpu', 'cuda'"),
        ('[server]\ngrpc_port = "eighty"\n', {}, "server.grpc_port must be an integer"),
        ('[mimi]\nwieghts = "/x"\n', {}, "unknown key mimi.wieghts; allowed: max_streams"),
        ('[mimmi]\nx = 1\n', {}, "unknown section [mimmi]"),
        ("[server\n", {}, "not valid TOML"),
        ("", {"EGOMEM__SERVER__HTTP_PORT": "x"}, "$EGOMEM__SERVER__HTTP_PORT: server.http_port must be an integer"),
        ("", {"EGOMEM__PORT": "1"}, "expected EGOMEM__<SECTION>__<KEY>"),
    ],
)
def test_invalid_config_names_the_key_and_allowed_values(tmp_path, toml, env, message):
    path = tmp_path / "c.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as err:
        load_config(path, env=env)
    assert message in str(err.value)


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", env={})


# -- CLI -----------------------------------------------------------------------------------------


def subcommands() -> list[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return sorted(action.choices)


def test_every_subcommand_has_help(capsys):
    names = subcommands()
    assert {"serve", "doctor"} <= set(names)
    for name in names:
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: egomem {name}") and "--config" in out


def test_cli_reports_config_errors_without_a_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('[server]\ndevice = "tpu"\n')
    assert main(["doctor", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "configuration error" in err and "server.device" in err and "Traceback" not in err


# -- doctor --------------------------------------------------------------------------------------


def test_doctor_passes_on_this_install_and_says_which_codec_runs():
    lines: list[str] = []
    assert run_doctor(load_config(env={}), out=lines.append) == 0
    text = "\n".join(lines)
    assert "[ ok ] tritonserver binary" in text
    assert "Python backend stub for Python 3.11" in text
    assert "[ ok ] mimi: trained tiny codec" in text and "egomem train-codec --data" in text
    assert "[ ok ] dialog: shipped fine-tuned tiny model" in text and "new person: restart" in text
    assert "turn starts at T = 1.0" in text and "the configured Mimi is" not in text  # it learnt this codec
    assert "above a chance" not in text and "query grammar" not in text
    lines.clear()
    assert run_doctor(load_config(env={"EGOMEM__DIALOG__START_FLOOR": "0.05", "EGOMEM__DIALOG__QUERY_GRAMMAR": "true"}),
                      out=lines.append) == 0
    assert "turn starts at T = 1.0 above a chance of 0.05, query relations from the profile (query grammar)" in \
        "\n".join(lines)
    cfg = load_config(env={})
    cfg.mimi.random_init = True
    cfg.dialog.random_init = True
    lines.clear()
    run_doctor(cfg, out=lines.append)
    text = "\n".join(lines)
    assert "RANDOM-INITIALISED 'tiny' Mimi" in text and "RANDOM-INITIALISED 'tiny' model" in text
    cfg.dialog.random_init = False  # the shipped model beside a codec it never heard
    lines.clear()
    run_doctor(cfg, out=lines.append)
    assert "it will not hear the user" in "\n".join(lines)


def test_doctor_on_a_broken_install_says_what_to_do(tmp_path):
    cfg = load_config(env={})
    cfg.mimi.weights = tmp_path / "missing-mimi.safetensors"
    cfg.server.tritonserver_binary = tmp_path / "no-tritonserver"
    cfg.server.models = ["mimi_codec", "no_such_model"]
    cfg.trigger.checkpoint = tmp_path / "no-trigger.safetensors"
    cfg.identity.voice_backend = "wavlm"  # the paper's model, with no local checkpoint configured
    lines: list[str] = []
    assert run_doctor(cfg, out=lines.append) == 1
    text = "\n".join(lines)
    assert f"[FAIL] episodic trigger checkpoint: missing {tmp_path / 'no-trigger.safetensors'}" in text
    assert "[FAIL] identity.wavlm_checkpoint unset" in text
    assert f"[FAIL] mimi.weights {tmp_path / 'missing-mimi.safetensors'} not found" in text
    assert "tritonserver binary not found" in text and "reinstall nvidia-pytriton" in text
    assert "[FAIL] model no_such_model" in text
    assert "-> " in text  # every failure comes with a fix


def test_doctor_reports_keys_the_one_identifier_cannot_search(tmp_path):
    """Live streams and the memory worker identify by one rule from [identity]; keys enrolled under
    another backend's model id are never searched again, and doctor says so."""
    import numpy as np

    from egomem.memory.sqlite import SQLiteMemoryStore

    cfg = load_config(env={})
    cfg.memory.database = tmp_path / "m.sqlite3"
    store = SQLiteMemoryStore(cfg.memory.database)
    ada = store.create_user("Ada")
    store.add_key(ada.user_id, "face", "facenet512", np.ones(512, np.float32) / np.sqrt(512))
    store.add_key(ada.user_id, "voice", "resemblyzer_ge2e", np.ones(256, np.float32) / 16)
    store.close()
    lines: list[str] = []
    run_doctor(cfg, out=lines.append)
    text = "\n".join(lines)
    assert "identification (live streams and memory worker alike): face dlib_resnet_v1" in text
    assert "1 user(s) have face keys of model 'facenet512'" in text and "voice keys" not in text
    cfg.identity.face_backend = "deepface"  # now the dlib keys would be the stray ones: none here
    lines.clear()
    run_doctor(cfg, out=lines.append)
    assert "have face keys" not in "\n".join(lines)


def test_settings_that_moved_say_where_they_live_now(tmp_path):
    bad = tmp_path / "c.toml"
    bad.write_text("[memory]\nface_threshold = 0.3\n")
    with pytest.raises(ConfigError, match=r"memory.face_threshold is no longer a setting.*identity.face_threshold_"):
        load_config(bad, env={})


def test_doctor_cli_exit_status(tmp_path):
    bad = tmp_path / "c.toml"
    bad.write_text(f'[mimi]\nweights = "{tmp_path / "gone.safetensors"}"\n')
    r = subprocess.run([EGOMEM, "doctor", "--config", str(bad)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "gone.safetensors not found" in r.stdout


# -- launcher lifecycle --------------------------------------------------------------------------


def processes() -> list[tuple[int, int, int]]:
    """(pid, parent pid, process group) of every live process, from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            out.append((int(stat.parent.name), int(fields[1]), int(fields[2])))
    return out


def group_members(pgid: int) -> list[int]:
    """PIDs whose process group is `pgid` (the server and its Python stubs)."""
    return [pid for pid, _, group in processes() if group == pgid]


def test_launcher_refuses_unknown_models_before_starting(tmp_path):
    cfg = test_config(tmp_path)
    with pytest.raises(LaunchError, match=r"models \['nope'\] not in repository"):
        TritonServer(cfg, models=["nope"]).start()


def test_a_model_that_fails_to_load_is_reported_and_nothing_is_left_running(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "model_repository" / "mimi_codec", repo / "broken")
    cfgtxt = (repo / "broken" / "config.pbtxt").read_text().replace('name: "mimi_codec"', 'name: "broken"')
    (repo / "broken" / "config.pbtxt").write_text(cfgtxt)
    (repo / "broken" / "1" / "model.py").write_text(
        "class TritonPythonModel:\n    def initialize(self, args):\n        raise RuntimeError('weights missing: /x/y.safetensors')\n"
    )
    cfg = test_config(tmp_path / "run")
    cfg.server.model_repository = repo
    server = TritonServer(cfg, models=["broken"])
    with pytest.raises(LaunchError) as err:
        server.start(timeout_s=120)
    assert "broken" in str(err.value) and "weights missing: /x/y.safetensors" in str(err.value)
    assert server.proc is None


def test_serve_starts_and_ctrl_c_stops_everything(tmp_path):
    cfg = test_config(tmp_path, mimi={"max_streams": 2}, orchestrator={"max_streams": 2})
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    proc = subprocess.Popen([EGOMEM, "serve", "--config", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("ready:"):
                break
            assert time.monotonic() < deadline, "".join(lines)
        else:
            pytest.fail("egomem serve exited before it was ready:\n" + "".join(lines))
        server_pids = _children(proc.pid)  # tritonserver and the orchestrator process
        assert len(server_pids) >= 2, "tritonserver and the orchestrator should run under egomem serve"
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        assert proc.wait(timeout=60) == 0
        rest = proc.stdout.read()
        assert "stopped." in rest
        time.sleep(0.5)
        alive = {pid for pid, _, _ in processes()}
        assert not alive & set(server_pids), "a service process outlived egomem serve"
        for pid in server_pids:
            assert not group_members(pid), f"processes of the group of {pid} (e.g. Triton's stubs) outlived egomem serve"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    return [child for child, parent, _ in processes() if parent == pid]
