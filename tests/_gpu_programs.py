"""Programs lowered for CUDA without a GPU, for the tests of the opt-in Triton kernels."""

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _references import platform_branch
from jax import export
from jax.experimental.pallas import triton as plgpu

# The custom call of a Pallas Triton kernel in a lowered module.
TRITON_CALL = getattr(plgpu, "CUSTOM_CALL_TARGET_NAME", "__gpu$xla.gpu.triton")


def cuda_text(fn, *args):
  """The module of ``fn`` lowered for CUDA (without a GPU: Pallas' Triton lowering needs none
  up to jax 0.10; from 0.11 it asks for one, and the test is skipped)."""
  checks = [export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
  try:
    exported = export.export(jax.jit(fn), platforms=("cuda",), disabled_checks=checks)(*args)
  except RuntimeError as err:
    if "No supported GPU devices" not in str(err):
      raise
    pytest.skip("this jax's Pallas lowers a Triton kernel only with a GPU attached")
  return exported.mlir_module()


# The switch needs jax.make_user_context (jax 0.7.2): below it the kernels stay off. (jax 0.11
# deprecates Pallas' Triton backend: the library lowers the kernels without the warning, and
# the tests ignore it should it come from elsewhere.)
GPU_KERNEL_MARKS = [
  pytest.mark.skipif(
    not hasattr(jax, "make_user_context"), reason="the GPU kernels need jax >= 0.7.2"
  ),
  pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
]
# On a GPU the kernels are compiled by Triton; elsewhere they run in Pallas' interpreter.
ON_GPU = jax.default_backend() == "gpu"


@contextlib.contextmanager
def cuda_branch():
  """The CUDA branch of every ``lax.platform_dependent`` (on CPU), or the GPU itself."""
  if ON_GPU:
    yield
    return
  with platform_branch("cuda"):
    yield


def count_calls(monkeypatch, module, name):
  """A list that grows by one each time ``module.name`` is called (traced): whether a
  program took a kernel rather than XLA's fallback."""
  calls = []
  fn = getattr(module, name)

  def counted(*args, **kwargs):
    calls.append(1)
    return fn(*args, **kwargs)

  monkeypatch.setattr(module, name, counted)
  return calls


def pallas_and_xla(program, *args):
  """On the CUDA branch, ``program(implementation)`` at ``args`` with the kernels
  (``"pallas"``) and with the XLA chunk loop (``"xla"``), and the kernels' program as jaxpr
  text: ``(got, want, text)``."""
  with cuda_branch():
    got, want = program("pallas")(*args), program("xla")(*args)
    text = str(jax.make_jaxpr(program("pallas"))(*args))
  return got, want, text


def loss_and_parts_program(loss):
  """``jit(value_and_grad)`` wrt ``(hidden, weight, bias)`` of ``loss(h, w, b)``, a fused
  distillation loss called with ``return_parts=True``, its parts' soft and hard sums the
  auxiliary output."""

  def value(h, w, b):
    out, parts = loss(h, w, b)
    return out, (parts.soft, parts.hard)

  return jax.jit(jax.value_and_grad(value, (0, 1, 2), has_aux=True))


def normal_arrays(rng, dtype):
  """``arr(shape, scale=1.0)``: ``scale`` times standard normal draws from ``rng``, made
  float32, then ``dtype``."""

  def arr(shape, scale=1.0):
    return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32).astype(dtype)

  return arr


# float32's relative tolerance: in the interpreter the kernels' float32 dots are exact; on a
# GPU, Triton's and XLA's both run TF32 at JAX's default matmul precision (10-bit mantissas).
F32 = 1e-2 if ON_GPU else 2e-5


def agree(got, want, f32):
  """Every leaf of ``got`` close to ``want``'s (NaN where it is NaN): float32's tolerance
  (:data:`F32`) or bf16's, relative and against the largest finite entry."""
  for g, x in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g, x = np.asarray(g, np.float64), np.asarray(x, np.float64)
    np.testing.assert_array_equal(np.isnan(g), np.isnan(x))
    scale = np.abs(x[np.isfinite(x)]).max(initial=1e-3)
    rtol, atol = (F32, F32 * scale) if f32 else (2e-2, 1e-2 * scale)
    np.testing.assert_allclose(g, x, rtol=rtol, atol=atol)


def kernel_counts(text):
  """``(Triton calls, distinct fused-head kernels)`` in a module lowered for CUDA."""
  names = set(re.findall(r"kldiv_jax_gpu_head_[a-z]+_kernel", text))
  return text.count(f"@{TRITON_CALL}"), len(names)


def small_blocks(module):
  """An autouse fixture: blocks of 16 tokens, vocabulary columns and hidden columns for
  ``module``'s kernels (several of each on the tests' shapes), in Pallas' interpreter unless
  on a GPU. A test module takes it as ``small_blocks = small_blocks(module)``."""

  @pytest.fixture(autouse=True)
  def fixture(monkeypatch):
    from kldiv_jax import _gpu_fused_head

    monkeypatch.setattr(_gpu_fused_head, "INTERPRET", not ON_GPU)
    for name in ("BLOCK_TOKENS", "BLOCK_VOCAB", "BLOCK_HIDDEN"):
      monkeypatch.setattr(module, name, 16)

  return fixture
