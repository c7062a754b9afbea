"""Config rules between keys (checked at every load), one place per setting, no mutation after load."""

from __future__ import annotations

import typing

import pytest

from egomem.config import (
    DIALOG_PRESET_CONTEXT,
    Config,
    ConfigError,
    DialogConfig,
    load_config,
    validate,
    with_overrides,
)


def test_defaults_pass_validation():
    validate(Config())
    validate(load_config(env={}))


@pytest.mark.parametrize("overrides, keys", [
    ({"dialog": {"l1_steps": 2800, "l2_steps": 300}}, ("dialog.l1_steps", "dialog.l2_steps")),
    ({"dialog": {"ring_steps": 5000}}, ("dialog.ring_steps", "dialog.preset")),
    ({"identity": {"face_threshold_dlib": 0.0}}, ("identity.face_threshold_dlib",)),
    ({"identity": {"cohort_top_k": 300, "cohort_size": 200}}, ("identity.cohort_top_k", "identity.cohort_size")),
    ({"retrieval": {"top_k": 60}}, ("retrieval.bm25_candidates", "retrieval.top_k")),
    ({"trigger": {"window_steps": 400, "window_overlap_steps": 200}},
     ("trigger.window_steps", "trigger.window_overlap_steps")),
    ({"server": {"grpc_port": 8000}}, ("server.http_port", "server.grpc_port")),
    ({"server": {"triton_urls": ["gpu-1"]}}, ("server.triton_urls",)),
    ({"server": {"triton_urls": ["gpu-1:8001", "gpu-1:8001"]}}, ("server.triton_urls",)),
    ({"server": {"replica_probe_s": 0.0}}, ("server.replica_probe_s",)),
    ({"memory": {"worker_poll_s": 60.0}}, ("memory.worker_poll_s", "memory.job_lease_s")),
    ({"memory": {"backend": "postgres"}}, ("memory.backend", "memory.dsn")),
    ({"memory": {"forget_prepare_timeout_s": 0.0}}, ("memory.forget_prepare_timeout_s",)),
    ({"memory": {"orchestrator_heartbeat_s": 10.0}}, ("memory.orchestrator_heartbeat_s", "memory.orchestrator_live_s")),
    ({"memory": {"forget_prepare_timeout_s": 600.0}}, ("memory.forget_prepare_timeout_s", "memory.forget_prepare_ttl_s")),
    ({"mimi": {"max_streams": 0}}, ("mimi.max_streams",)),
    ({"dialog": {"start_temperature": -0.5}}, ("dialog.start_temperature",)),
    ({"dialog": {"start_floor": 1.0}}, ("dialog.start_floor",)),
    ({"trigger": {"boundary_window_steps": -1}}, ("trigger.boundary_window_steps",)),
    ({"orchestrator": {"max_streams": 20}}, ("orchestrator.max_streams", "dialog.max_streams")),
    ({"mimi": {"max_streams": 4}}, ("orchestrator.max_streams", "mimi.max_streams")),
    ({"orchestrator": {"identify_window_s": 0.5}}, ("orchestrator.identify_window_s", "identity.min_voiced_s")),
])
def test_cross_field_rules_name_the_keys(tmp_path, overrides, keys):
    with pytest.raises(ConfigError) as err:
        with_overrides(Config(), overrides)
    for key in keys:
        assert key in str(err.value)
    path = tmp_path / "c.toml"  # the same rule at load from a file
    path.write_text("".join(f"[{s}]\n" + "".join(f"{k} = {v!r}\n" for k, v in kv.items()) for s, kv in overrides.items()))
    with pytest.raises(ConfigError, match=keys[0].replace(".", r"\.")):
        load_config(path, env={})


def test_an_optional_number_is_auto_by_default_and_read_from_the_environment():
    assert load_config(env={}).dialog.start_temperature == "auto"  # the checkpoint's own (egomem/dialog/card.py)
    assert load_config(env={}).dialog.new_person == "auto"
    assert load_config(env={"EGOMEM__DIALOG__START_TEMPERATURE": "1.0"}).dialog.start_temperature == 1.0
    assert load_config(env={"EGOMEM__DIALOG__START_TEMPERATURE": "none"}).dialog.start_temperature is None
    with pytest.raises(ConfigError, match="dialog.start_temperature"):
        load_config(env={"EGOMEM__DIALOG__START_TEMPERATURE": "warm"})


def test_with_overrides_returns_a_new_config_and_leaves_the_old_one():
    cfg = load_config(env={})
    new = with_overrides(cfg, {"dialog": {"l2_steps": 128}, "server": {"run_dir": "/tmp/x"}})
    assert new.dialog.l2_steps == 128 and str(new.server.run_dir) == "/tmp/x"
    assert cfg.dialog.l2_steps == 256 and cfg == load_config(env={})
    with pytest.raises(ConfigError, match="unknown key dialog.l3_steps"):
        with_overrides(cfg, {"dialog": {"l3_steps": 1}})


def test_level2_length_has_one_key():
    assert "memchunk_steps" not in typing.get_type_hints(type(Config().retrieval))
    with pytest.raises(ConfigError, match=r"retrieval\.memchunk_steps is no longer a setting.*dialog\.l2_steps"):
        with_overrides(Config(), {"retrieval": {"memchunk_steps": 128}})


def test_preset_contexts_match_the_models():
    from egomem.dialog.presets import lm_kwargs

    presets = typing.get_args(typing.get_type_hints(DialogConfig)["preset"])
    assert set(DIALOG_PRESET_CONTEXT) == set(presets)
    for preset in presets:
        assert DIALOG_PRESET_CONTEXT[preset] == lm_kwargs(preset)["context"]
