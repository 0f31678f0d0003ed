"""Which implementation the losses lower to: XLA only, or the library's Pallas kernels.

The convention of JAX's kernel libraries (``jax.nn.dot_product_attention(implementation=)``,
the kernels of ``jax.experimental.pallas.ops``): a per-call ``implementation=`` keyword, with
a process-wide default.

* ``"xla"``: XLA's fusions only, on every platform: no custom kernel is lowered.
* ``"pallas"``: the Pallas kernels wherever the library has one for the platform and the
  operands take it: the TPU whole-row kernel (:mod:`kldiv_jax._whole_rows`) and the opt-in
  Triton kernels for NVIDIA GPUs (:mod:`kldiv_jax._gpu_rows`, and the fused LM-head kernels
  of :mod:`kldiv_jax._gpu_fused_head`); XLA elsewhere.
* ``None`` (every loss's default): the process-wide default, :func:`set_implementation`'s
  value, else the environment variable :data:`ENV_VAR` (``KLDIV_JAX_IMPLEMENTATION``), else
  the library's choice per platform (:data:`AUTO`): the Pallas kernel on TPU, XLA on GPUs
  (the Triton kernels measured no faster than XLA's fusions on an H200:
  ``benchmarks/README.md``), XLA on CPU.

The choice is read when a loss is traced (it is a static argument of the kernels): a
function already traced and compiled under ``jax.jit`` keeps the implementation it was
traced with; a new trace (another jitted function, an eager call) reads the new default.
Values are the same either way (the kernels compute the XLA passes' sums); the tests check
that ``"xla"`` leaves no Mosaic call in a program lowered for TPU.
"""

import os

ENV_VAR = "KLDIV_JAX_IMPLEMENTATION"
IMPLEMENTATIONS = ("xla", "pallas")
# The resolved value of ``None`` with nothing set: Pallas on TPU, XLA on GPUs and CPU.
AUTO = "auto"
DEFAULT = AUTO

# set_implementation's value (None: the environment variable, else DEFAULT).
_default: str | None = None


def _checked(where: str, value: object, none: bool = True) -> str:
  if not isinstance(value, str) or value not in IMPLEMENTATIONS:
    allowed = ", ".join(repr(c) for c in IMPLEMENTATIONS)
    raise ValueError(
      f"{where} must be {'None or ' if none else ''}one of {allowed}; got {value!r}."
    )
  return value


def default_implementation() -> str:
  """The process-wide default: :func:`set_implementation`'s, else ``$KLDIV_JAX_IMPLEMENTATION``
  (read now), else :data:`AUTO` (the library's choice per platform)."""
  if _default is not None:
    return _default
  env = os.environ.get(ENV_VAR)
  if env is None or env == "":
    return DEFAULT
  return _checked(f"the environment variable {ENV_VAR}", env.strip().lower(), none=False)


def resolve_implementation(name: str, implementation: object) -> str:
  """A loss's ``implementation=`` checked and resolved at trace time: ``"xla"``,
  ``"pallas"`` or, for ``None`` with no default set, :data:`AUTO` (:func:`default_implementation`);
  errors name ``name``."""
  if implementation is None:
    return default_implementation()
  return _checked(f"{name}: implementation", implementation)


def set_implementation(implementation: str | None) -> str | None:
  """Sets the implementation every loss uses when its ``implementation=`` is ``None``.

  ``"xla"`` turns the library's Pallas kernels off everywhere (XLA's fusions only);
  ``"pallas"`` turns them on wherever they exist (the TPU whole-row kernel, and the opt-in
  Triton kernels on NVIDIA GPUs); ``None`` goes back to the environment variable
  ``KLDIV_JAX_IMPLEMENTATION`` (``"xla"`` or ``"pallas"``), and without it to the library's
  choice per platform (the TPU kernel on, the GPU kernels off). Read when a loss is traced: functions
  already compiled keep theirs. Returns the previous setting (``None`` if unset), so that a
  caller can restore it.

  Args:
    implementation: ``"xla"``, ``"pallas"`` or ``None``.

  Returns:
    The previous value given to :func:`set_implementation` (``None`` if none).

  Raises:
    ValueError: another value.

  Examples:
    >>> import jax.numpy as jnp
    >>> import kldiv_jax
    >>> previous = kldiv_jax.set_implementation("xla")  # no Pallas kernel from now on
    >>> kldiv_jax.divergence_from_logits(jnp.zeros((1, 3)), jnp.zeros((1, 3)), divergence="tvd")
    Array([0.], dtype=float32)
    >>> kldiv_jax.set_implementation(previous)
    'xla'
  """
  global _default
  if implementation is not None:
    _checked("set_implementation: implementation", implementation)
  previous, _default = _default, implementation
  return previous
