"""Smoke test of the language-model distillation demo (``examples/distill_lm.py --quick``).

Skipped where the ``examples`` extra is not installed (the dependency-floor venv
installs ``test`` only): the demo needs ``tokenizers`` and ``tqdm``.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("tqdm")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "distill_lm.py"
MODELS = ("teacher", "student (labels)", "student (fused KD)", "student (top-32)")


def test_distill_lm_quick(tmp_path):
  out = tmp_path / "distill_lm.png"
  env = {**os.environ, "TQDM_DISABLE": "1"}
  proc = subprocess.run(
    [sys.executable, str(EXAMPLE), "--quick", "--out", str(out)],
    capture_output=True,
    text=True,
    timeout=300,
    env=env,
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  lines = proc.stdout.splitlines()
  header = next(i for i, line in enumerate(lines) if line.startswith("model "))
  assert "held-out ppl" in lines[header] and "KL(teacher‖model)" in lines[header]
  rows = {line.split("  ")[0]: line for line in lines[header + 2 : header + 2 + len(MODELS)]}
  assert tuple(rows) == MODELS, lines[header:]
  for name in MODELS[2:]:
    assert "MiB" in rows[name]  # the loss's memory: materialised -> fused
  assert out.stat().st_size > 0
  assert (tmp_path / "distill_lm_top32.npz").stat().st_size > 0
