"""Programs lowered for CUDA without a GPU, for the tests of the opt-in Triton kernels."""

import contextlib

import jax
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
