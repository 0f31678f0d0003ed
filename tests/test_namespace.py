"""What a reader of the package sees: ``dir(kldiv_jax)`` and ``help()`` of each public name."""

import inspect
import os
import pydoc
import subprocess
import sys
import types
from pathlib import Path

import kldiv_jax


def test_dir_holds_the_public_names_dunders_and_private_modules_only():
  """No helper leaks into the namespace (importlib's ``version``, ``PackageNotFoundError``)."""
  extra = set(dir(kldiv_jax)) - set(kldiv_jax.__all__)
  for name in sorted(extra):
    if name.startswith("__") and name.endswith("__"):
      continue
    value = getattr(kldiv_jax, name)
    # The private modules (``kldiv_jax._distill``, ...): attributes of every imported package.
    private_module = isinstance(value, types.ModuleType) and value.__name__ == f"kldiv_jax.{name}"
    assert name.startswith("_") and private_module, (name, value)
  assert set(kldiv_jax.__all__) <= set(dir(kldiv_jax))


def _public_callables():
  for name in kldiv_jax.__all__:
    obj = getattr(kldiv_jax, name)
    yield name, obj
    if inspect.isclass(obj):  # the methods a class documents (DivergenceMetric.configure, ...)
      for attr in vars(obj):
        if not attr.startswith("_") and callable(getattr(obj, attr)):
          yield f"{name}.{attr}", getattr(obj, attr)


def test_help_shows_the_annotations_as_written():
  """``help()`` prints ``ArrayLike``, not the eight members of the Union behind it."""
  seen_array_like = 0
  for name, obj in _public_callables():
    text = pydoc.render_doc(obj, renderer=pydoc.plaintext)
    for expansion in ("Union[", "numpy.ndarray", "jaxlib", "numpy.bool"):
      assert expansion not in text, (name, expansion, text[:400])
    seen_array_like += "ArrayLike" in text
  assert seen_array_like >= len(kldiv_jax.__all__) - 8  # most public names take arrays


def test_distillation_loss_signature_reads_as_written():
  sig = str(inspect.signature(kldiv_jax.distillation_loss))
  assert "student_logits: 'jax.typing.ArrayLike'" in sig, sig
  assert "-> 'jax.Array | tuple[jax.Array, DistillationParts]'" in sig, sig


def test_import_pulls_neither_tunix_nor_flax():
  """``kldiv_jax.tunix`` is a submodule of its own (the ``tunix`` extra): ``import kldiv_jax``
  imports no Flax or Tunix, even where they are installed, and has no ``tunix`` attribute."""
  code = (
    "import sys, kldiv_jax\n"
    "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('flax', 'tunix'))\n"
    "assert not heavy, heavy\n"
    "assert not hasattr(kldiv_jax, 'tunix')\n"
  )
  root = Path(__file__).resolve().parent.parent
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
  proc = subprocess.run(
    [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120
  )
  assert proc.returncode == 0, proc.stderr
