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


def _run_quick(script, out):
  """``script --quick --out out`` in a subprocess (no progress bars); its stdout lines."""
  proc = subprocess.run(
    [sys.executable, str(script), "--quick", "--out", str(out)],
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, "TQDM_DISABLE": "1"},
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout.splitlines()


def test_distill_lm_quick(tmp_path):
  out = tmp_path / "distill_lm.png"
  lines = _run_quick(EXAMPLE, out)
  header = next(i for i, line in enumerate(lines) if line.startswith("model "))
  assert "held-out ppl" in lines[header] and "KL(teacher‖model)" in lines[header]
  rows = {line.split("  ")[0]: line for line in lines[header + 2 : header + 2 + len(MODELS)]}
  assert tuple(rows) == MODELS, lines[header:]
  for name in MODELS[2:]:
    assert "MiB" in rows[name]  # the loss's memory: materialised -> fused
  assert out.stat().st_size > 0
  assert (tmp_path / "distill_lm_top32.npz").stat().st_size > 0


CROSS = Path(__file__).resolve().parent.parent / "examples" / "distill_across_tokenizers.py"
CROSS_MODELS = ("teacher", "labels", "ULD", "hybrid", "same-tokenizer KL")


def test_distill_across_tokenizers_quick(tmp_path):
  """The cross-tokenizer demo at ``--quick``: two tokenizers, a teacher, four students; each
  model's held-out bits per character, the ULD to the teacher for the student-tokenizer
  students, the plot."""
  out = tmp_path / "cross.png"
  lines = _run_quick(CROSS, out)
  assert "shared" in lines[0]  # the matched vocabulary
  header = next(i for i, line in enumerate(lines) if line.startswith("model "))
  rows = [line.split() for line in lines[header + 2 : header + 2 + len(CROSS_MODELS)]]
  names = tuple(" ".join(r[:-4]) for r in rows)
  assert names == CROSS_MODELS, lines[header:]
  for name, row in zip(names, rows):
    assert 0 < float(row[-3]) < 16  # bits per character
    has_uld = name in ("labels", "ULD", "hybrid")
    assert (row[-2] != "—") == has_uld
    if has_uld:
      assert 0 <= float(row[-2]) <= 2  # ULD: an L1 distance of two distributions
  assert out.stat().st_size > 0
