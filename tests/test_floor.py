"""The dependency floor: pyproject.toml's lower bounds are the versions CI tests.

``tests/constraints-floor.txt`` pins the oldest supported versions for the CI
run at the floor; these tests keep it and pyproject.toml saying the same.
"""

import re
import tomllib
from pathlib import Path

from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
PINS = dict(
  re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line).groups()
  for line in (ROOT / "tests" / "constraints-floor.txt").read_text().splitlines()
  if line.strip() and not line.startswith("#")
)


def _floors(requirements: list[str]) -> dict[str, Version]:
  """``{name: version}`` of each ``name>=version`` requirement."""
  out = {}
  for req in requirements:
    match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", req)
    if match:
      out[match.group(1)] = Version(match.group(2))
  return out


def test_every_pin_is_a_floor_of_pyproject():
  floors = _floors(PYPROJECT["dependencies"])
  assert set(floors) == {"jax", "jaxlib"}
  floors |= _floors(PYPROJECT["optional-dependencies"]["test"])
  assert {name: Version(pin) for name, pin in PINS.items()} == {name: floors[name] for name in PINS}


def test_the_numerical_stack_is_pinned():
  assert {"jax", "jaxlib", "optax", "chex", "numpy"} <= set(PINS)


def test_examples_share_the_optax_floor():
  assert _floors(PYPROJECT["optional-dependencies"]["examples"])["optax"] == Version(PINS["optax"])


def test_python_floor_is_jax_floors():
  # jax 0.7.0 requires Python >= 3.11; so does kldiv_jax.
  assert PINS["jax"] == "0.7.0"
  assert PYPROJECT["requires-python"] == ">=3.11"
