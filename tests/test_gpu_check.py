"""The prepared device check runs end to end on the CPU (`--cpu-smoke`), so it cannot rot before a GPU
is lent: every part runs and writes its JSON, and the summary says how each went."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_cpu_smoke_runs_every_part(tmp_path):
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--cpu-smoke", "--out-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["cpu_smoke"] and [p["part"] for p in summary["parts"]] == ["parity", "kernels", "dialog", "dialog_fp8", "mimi", "finetune", "served"]
    assert all(p["status"] == "ok" for p in summary["parts"]) and summary["pending"] == []
    parity = json.loads((tmp_path / "parity.json").read_text())
    assert parity["ok"] and parity["fixed_vs_narrow_token_agreement"] == 1.0 and parity["fixed_vs_narrow_tokens"] > 0
    assert parity["vs_forward_max_abs"] <= parity["tolerance_rel"] * parity["logit_std"]
    kernels = json.loads((tmp_path / "kernels.json").read_text())
    assert kernels["ok"] and kernels["memchunk_write_exact"]
    assert kernels["decode_attention_max_abs_err"] <= kernels["decode_attention_tolerance"]
    dialog = json.loads((tmp_path / "dialog.json").read_text())
    assert [r["B"] for r in dialog["ticks"]] == [1, 2]
    assert all(r["lmgen"]["stream_steps_per_s"] > 0 and r["engine"]["p99_ms"] > 0 for r in dialog["ticks"])
    assert dialog["refresh"]["l1_refresh_ms"] > 0
    mimi = json.loads((tmp_path / "mimi.json").read_text())
    assert [r["B"] for r in mimi["rows"]] == [1, 2] and all(r["p50_ms"] > 0 for r in mimi["rows"])
    finetune = json.loads((tmp_path / "finetune.json").read_text())
    assert finetune["tiny"]["final_loss"] < 0.7 * finetune["tiny"]["first_loss"] and finetune["tiny"]["served_ticks"] == 4
    assert finetune["lora_7b"]["steps"] == 3
    assert (tmp_path / "served.json").is_file()


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the check runs for real")
def test_gpu_check_without_a_gpu_says_what_to_do():
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--parts", "kernels"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--cpu-smoke" in proc.stderr
