"""The doctests collected under kldiv_jax/ (pytest's testpaths): the Tunix integration's
modules import Flax and Tunix, the ``tunix`` extra, and are left out where it is not
installed (its tests: tests/test_integration_tunix.py, ``make integration``)."""

import importlib.util

_TUNIX = ["kldiv_jax/tunix.py", "kldiv_jax/_tunix_*.py"]
collect_ignore_glob = [] if importlib.util.find_spec("tunix") else _TUNIX
