"""The opt-in Pallas Triton kernel of the engine's gradient pass for NVIDIA GPUs (``_gpu_grad``).

Without a GPU the kernel runs in Pallas' interpreter on CPU (``test_gpu_rows.gpu_kernel``: the
CUDA lowerings registered for CPU); with one, compiled by Triton. Against XLA's pass (the same
CUDA branch, kernels off): the gradients wrt the student's and the teacher's logits of every
divergence family, at ``T = 1`` and ``T != 1``, in float32 and bfloat16, with soft-caps, masks
of rows and of classes, ``-inf`` logits, NaN and ``+inf`` (NaN rows' gradients NaN), rows and
classes no multiple of a program's block or tile; ``jit``, ``vmap`` of ``grad`` (a batch
stacked into one call), ``jvp``, a hessian (XLA's pass differentiated) and a temperature's
gradient beside the kernel's; and the program lowered for CUDA (the kernel's Triton call in a
gradient only, one for both sides).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _gpu_programs import GPU_KERNEL_MARKS, TRITON_CALL, count_calls, cuda_text
from test_gpu_rows import _logits, gpu_kernel, xla_path

import kldiv_jax as kd
from kldiv_jax import _gpu_grad
from kldiv_jax._platform import gpu_kernels

pytestmark = GPU_KERNEL_MARKS

FAMILIES = [
  ("forward_kl", {}),
  ("reverse_kl", {}),
  ("symmetric_kl", {}),
  ("jsd", {"beta": 0.3}),
  ("skew_kl", {"alpha": 0.1}),
  ("skew_reverse_kl", {"alpha": 0.2}),
  ("tvd", {}),
  ("alpha_beta", {"alpha": 0.5, "beta": 0.3}),
]
# (temperature, dtype, soft-caps, mask, layout of the switch: (rows per program, tile, warps,
# stages); 11 rows and 150 classes are no multiple of 2 rows or 32 classes)
CASES = {
  "T1-f32": (1.0, jnp.float32, {}, None, (2, 32, 4, 1)),
  "T2-bf16-rows-softcap": (2.0, jnp.bfloat16, {"softcap": 30.0}, "rows", (4, 64, 4, 1)),
  "T0.7-f32-classes": (0.7, jnp.float32, {"target_softcap": 20.0}, "classes", True),
}


@pytest.fixture
def spy(monkeypatch):
  """Counts the kernel's traces (the CUDA lowering took the kernel, not XLA's pass)."""
  return count_calls(monkeypatch, _gpu_grad, "_grad_kernel")


def _loss(name, params, temperature=2.0, where=None, **caps):
  divergence = kd.Divergence(name, **params)
  return lambda z, y: kd.divergence_from_logits(
    z, y, divergence=divergence, temperature=temperature, where=where, **caps
  )


def _mask(kind, rows=11, classes=150):
  if kind == "rows":
    return jnp.arange(rows)[:, None] != 9
  if kind == "classes":
    return jnp.arange(classes)[None, :] % 7 != 3
  return None


def _compare(got, want, dtype):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == w.dtype
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    if dtype == jnp.bfloat16:  # an ulp of bf16 where the two roundings differ
      np.testing.assert_allclose(g, w, rtol=1e-2, atol=1e-3)
    else:  # row 7's logits of 500 / T: an ulp of 714 is 6e-5, and so is exp's relative error
      np.testing.assert_allclose(g, w, rtol=1e-4, atol=2e-6)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name,params", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_gradients_match_the_xla_pass(name, params, case, spy):
  """Both sides' gradients of a per-row weighted sum of the loss (NaN rows give NaN
  gradients, ``+inf`` rows their finite convention) with the kernel against XLA's pass."""
  temperature, dtype, caps, mask, layout = CASES[case]
  loss = _loss(name, params, temperature, _mask(mask), **caps)
  z, y = (x.astype(dtype) for x in _logits(11, 150, jnp.float32, seed=3))
  weights = jnp.asarray(np.random.default_rng(0).uniform(0.5, 2.0, 11), jnp.float32)
  run = jax.jit(jax.grad(lambda z, y: jnp.sum(loss(z, y) * weights), (0, 1)))
  with xla_path():
    want = run(z, y)
  with gpu_kernel(), gpu_kernels(layout):
    got = run(z, y)
  assert spy  # the kernel, not XLA's pass
  _compare(got, want, dtype)
  dz = np.asarray(got[0], np.float32)
  assert np.isnan(dz[3]).all()  # a NaN logit: NaN gradients
  assert np.isfinite(dz[[0, 1, 6, 7]]).all()
  np.testing.assert_array_equal(dz[5], 0.0)  # a row without mass
  if mask == "rows":
    np.testing.assert_array_equal(dz[9], 0.0)


def test_derivatives_beside_the_kernel(spy):
  """``vmap`` of ``grad`` (a batch of logits stacked: the kernel once), a hessian (XLA's pass
  differentiated), ``jvp`` (XLA's fusion), the temperature's and a traced parameter's
  gradients beside the kernel's, each against XLA's pass."""
  rng = np.random.default_rng(2)
  z = jnp.asarray(rng.standard_normal((3, 70)), jnp.float32)
  y = jnp.asarray(rng.standard_normal((3, 70)), jnp.float32)
  zb, yb = jnp.stack([z, 2 * z]), jnp.stack([y, y + 1])
  tz = jnp.asarray(rng.standard_normal((3, 70)), jnp.float32)

  def loss(z, y, t=2.0, beta=0.3):
    divergence = kd.Divergence("jsd", beta=beta)
    return jnp.sum(kd.divergence_from_logits(z, y, divergence=divergence, temperature=t))

  kl = _loss("forward_kl", {})
  programs = [
    (jax.vmap(jax.grad(loss, (0, 1))), (zb, yb)),
    (jax.hessian(loss), (z, y)),
    (jax.hessian(lambda z, y: jnp.sum(kl(z, y)), (0, 1)), (z, y)),
    (lambda z, y: jax.jvp(lambda z: loss(z, y), (z,), (tz,)), (z, y)),
    (jax.grad(loss, (0, 1, 2, 3)), (z, y, jnp.float32(1.5), jnp.float32(0.4))),
  ]
  with xla_path():
    want = [jax.jit(f)(*args) for f, args in programs]
  with gpu_kernel():
    got = [jax.jit(f)(*args) for f, args in programs]
  assert spy
  for g, w in zip(got, want):
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(w)):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  with gpu_kernel():  # vmap of grad: one stacked call
    text = str(jax.make_jaxpr(programs[0][0])(zb, yb))
  assert text.count("kldiv_jax_gpu_grad_pass[") == 1


def test_second_derivatives_in_every_mode():
  """Forward over forward (the tangent primitive's ``jvp``), reverse over reverse (the
  kernel's ``jvp`` transposed), reverse over forward and a hessian wrt both logits, with a
  mask of classes, a soft-cap, a temperature: XLA's pass's derivatives."""
  rng = np.random.default_rng(5)
  z = jnp.asarray(rng.standard_normal((3, 40)), jnp.float32)
  y = jnp.asarray(rng.standard_normal((3, 40)), jnp.float32)
  loss = _loss("skew_kl", {"alpha": 0.2}, 1.5, jnp.arange(40)[None, :] % 5 != 1, softcap=10.0)
  total = lambda z, y: jnp.sum(loss(z, y))  # noqa: E731
  programs = [
    jax.jacfwd(jax.jacfwd(total)),
    jax.jacrev(jax.jacrev(total)),
    jax.jacrev(jax.jacfwd(total)),
    jax.hessian(total, (0, 1)),
  ]
  with xla_path():
    want = [jax.jit(f)(z, y) for f in programs]
  with gpu_kernel():
    got = [jax.jit(f)(z, y) for f in programs]
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["forward_kl", "tvd"])
def test_the_cuda_program_holds_the_kernel(name):
  """Lowered for CUDA with the kernels on: a loss's value holds the statistics' kernel only;
  its gradient, one more Triton call (the gradient pass), one for both sides (wrt the student
  and the teacher); off, none; masks of single elements keep XLA's pass."""
  z, y = _logits(16, 256, jnp.float32)
  loss = _loss(name, {})
  both = jax.grad(lambda z, y: jnp.sum(loss(z, y)), (0, 1))
  student = jax.grad(lambda z, y: jnp.sum(loss(z, y)))
  assert TRITON_CALL not in cuda_text(both, z, y)
  with gpu_kernels(True):
    value = cuda_text(loss, z, y).count(f"@{TRITON_CALL}")
    assert cuda_text(student, z, y).count(f"@{TRITON_CALL}") == value + 1 == 2
    text = cuda_text(both, z, y)
    element = _loss(name, {}, where=jnp.ones((16, 256), bool))
    text_element = cuda_text(jax.grad(lambda z, y: jnp.sum(element(z, y))), z, y)
  assert text.count(f"@{TRITON_CALL}") == 2
  assert "kldiv_jax_gpu_grad" in text
  assert TRITON_CALL not in text_element


def test_the_grid_covers_any_shape():
  """The kernel's grid for ragged and long rows: blocks of rows and tiles of columns that
  cover them (131072 classes: 128 tiles of 1024), the switch's layout where it gives one."""
  assert _gpu_grad.grad_layout(11, 150) == (4, 256, 4)
  assert _gpu_grad.grad_layout(2048, 131072) == (4, 1024, 4)
  assert _gpu_grad.grad_layout(3, 10) == (4, 32, 4)
  assert _gpu_grad.grad_layout(4096, 8192, (2, 0, 16, 1)) == (2, 1024, 16)
  assert _gpu_grad.grad_layout(4096, 8192, (8, 512, 8, 2)) == (8, 512, 8)


def test_off_by_default():
  """Without the switch, XLA's pass: neither primitive in the gradient's program."""
  z, y = _logits(8, 64, jnp.float32)
  loss = _loss("forward_kl", {})
  text = str(jax.make_jaxpr(jax.grad(lambda z: jnp.sum(loss(z, y))))(z))
  assert "kldiv_jax_gpu_grad" not in text
  with gpu_kernels(True):
    text = str(jax.make_jaxpr(jax.grad(lambda z: jnp.sum(loss(z, y))))(z))
  assert "kldiv_jax_gpu_grad_pass" in text
