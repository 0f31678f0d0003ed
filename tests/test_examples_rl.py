"""Smoke test of the GRPO example (``examples/grpo_digits.py --quick``).

Skipped where the ``examples`` extra is not installed (the dependency-floor venv
installs ``test`` only): the example needs ``tqdm``.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tqdm")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "grpo_digits.py"


def test_grpo_digits_quick(tmp_path):
  out = tmp_path / "grpo_digits.png"
  # This checkout's kldiv_jax first, whatever the venv has installed.
  path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
  env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONPATH": path}
  proc = subprocess.run(
    [sys.executable, str(EXAMPLE), "--quick", "--out", str(out)],
    capture_output=True,
    text=True,
    timeout=300,
    env=env,
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  lines = proc.stdout.splitlines()
  header = next(i for i, line in enumerate(lines) if line.startswith("run "))
  assert lines[header].split() == ["run", "reward", "exact", "KL(pi||ref)", "entropy"]
  rows = [line.split() for line in lines[header + 2 : header + 4]]
  assert [row[0] for row in rows] == ["beta=0.3", "beta=0"], lines[header:]
  for row in rows:
    reward, exact, kl, entropy = map(float, row[1:])
    assert 0 <= reward <= 1 and 0 <= exact <= 1 and kl >= 0 and 0 < entropy <= 2.4  # log(11)
  assert out.stat().st_size > 0
