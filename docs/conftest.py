"""The pages' code runs as tests (``make docs``).

In each page every ```python block runs, in order, in one namespace per page; a
block of ``>>>`` examples is a doctest, its printed values compared with the
page's. Pages show the code a user copies, so they need no test scaffolding.
"""

import doctest
import sys
from pathlib import Path

import jax
from sybil import Sybil
from sybil.parsers.myst import PythonCodeBlockParser, SkipParser

# XLA:CPU compiles as in the test suite (tests/conftest.py): its flags make compiling cheaper.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _references import add_xla_test_flags

add_xla_test_flags()

# The multiple-devices page shards over 8 devices: simulated on the CPU. This must
# precede every computation (the CPU backend fixes its device count when it starts).
jax.config.update("jax_num_cpu_devices", 8)

collect_ignore = ["conf.py", "_build", "_autosummary"]

pytest_collect_file = Sybil(
  parsers=[
    PythonCodeBlockParser(doctest_optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE),
    SkipParser(),
  ],
  patterns=["*.md"],
).pytest()
