"""Programs lowered for CUDA without a GPU, for the tests of the opt-in Triton kernels."""

import jax
import pytest
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
