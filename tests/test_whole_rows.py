"""The whole-row TPU kernel of the divergences without a one-pass form (``_whole_rows``).

JSD (``0 < beta < 1``), skew KL, skew reverse KL and TVD take their row statistics and
class sums on TPU from one Pallas kernel that reads the logits once. On CPU the kernel runs
in Pallas' interpreter: its sums against the XLA passes it replaces, on rows with ``-inf``,
NaN and ``+inf`` logits, identical rows, rows without mass, row and class counts that are
not multiples of a block, bfloat16 logits, soft-caps and traced parameters; the public
losses through it (values, gradients, a hessian, ``vmap``) against the CPU path; and the
lowerings: the kernel in a program lowered for TPU and nowhere else, the XLA passes for
what it does not take, and a program exported for CPU, CUDA and TPU that runs on CPU.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _references import enable_x64, hostile_logits, tpu_kernel
from jax import export

import kldiv_jax as kd
from kldiv_jax._class_sums import Needs
from kldiv_jax._whole_rows import X64_KERNEL_JAX, pallas_row_sums, takes_whole_rows, xla_row_sums

# (name, static params (None where traced), traced values)
FORMULAS = [
  ("jsd", (0.5,), ()),
  ("jsd", (None,), (0.3,)),
  ("skew_kl", (0.1,), ()),
  ("skew_reverse_kl", (None,), (0.2,)),
  ("tvd", (), ()),
]


def _logits(rows, classes, dtype, seed=0):
  """Two ``[rows, classes]`` logits with hostile rows (:func:`_references.hostile_logits`)."""
  z, y = hostile_logits(rows, classes, seed)
  return jnp.asarray(z, dtype), jnp.asarray(y, dtype)


@pytest.mark.parametrize("formula", FORMULAS, ids=lambda f: f"{f[0]}{f[1]}")
@pytest.mark.parametrize(
  "rows,classes,dtype,caps,masked",
  [
    (13, 300, jnp.float32, (None, None), False),  # neither a multiple of a block
    (24, 2048, jnp.bfloat16, (None, None), False),  # whole slices
    (9, 1000, jnp.float32, (20.0, 30.0), False),  # soft-caps
    (21, 700, jnp.float32, (None, None), True),  # a mask of rows, one of classes, a scalar one
  ],
)
def test_kernel_sums_match_the_xla_passes(formula, rows, classes, dtype, caps, masked):
  name, static, traced = formula
  needs = Needs(a=True, b=True, params=tuple(s is None for s in static))
  z, y = _logits(rows, classes, dtype)
  masks = ()
  if masked:
    row_mask = jnp.arange(rows)[:, None] % 7 != 6  # rows 6, 13 and 20 masked out
    class_mask = jnp.arange(classes)[None, :] % 5 != 0
    masks = (row_mask, class_mask, jnp.ones((1, 1), bool))
  spec = (name, static, needs, caps, len(masks))
  args = (z, y, jnp.float32(2.0), *(jnp.float32(t) for t in traced), *masks)
  assert takes_whole_rows(spec, z, y, args[2], masks)
  got = np.concatenate(jax.jit(functools.partial(pallas_row_sums, spec, interpret=True))(*args), 1)
  want = np.concatenate(jax.jit(functools.partial(xla_row_sums, spec))(*args), 1)
  assert got.shape == want.shape == (rows, 5 + 3 + len(traced))
  if masked:  # a masked row has no mass: zero statistics, identical (0 gap)
    np.testing.assert_array_equal(got[[6, 13, 20]], want[[6, 13, 20]])
    assert (got[[6, 13, 20], 1] == 0).all() and (got[[6, 13, 20], 4] == 0).all()
  # The sums of exponentials are finite, infinite or NaN on the same rows, and the
  # identical-rows gap is 0 on the same rows (rows 2 and 5).
  for col in (1, 3):
    np.testing.assert_array_equal(np.isnan(got[:, col]), np.isnan(want[:, col]))
  np.testing.assert_array_equal(got[:, 4] == 0, want[:, 4] == 0)
  assert (got[5, 4] == 0) and np.isnan(got[[3, 4], 1]).all()
  assert (got[2, 4] == 0) == (caps[0] == caps[1])  # identical logits, the same caps
  # Where the engine uses them (rows with finite statistics that are not identical), the
  # maxes, sums of exponentials and class sums agree to float32 rounding (the XLA passes
  # sum in another order; a soft-cap's tanh is approximated differently per fusion).
  used = np.isfinite(want[:, 1]) & np.isfinite(want[:, 3]) & (want[:, 4] != 0)
  assert used.sum() >= rows - 4 - 3 * masked
  cols = [0, 1, 2, 3, *range(5, got.shape[1])]
  scale = 1.0 + np.abs(want[used][:, cols])
  np.testing.assert_array_less(np.abs(got[used][:, cols] - want[used][:, cols]) / scale, 1e-4)


def _loss(name, static, traced, **options):
  params = dict(
    zip({"jsd": ["beta"], "skew_kl": ["alpha"], "skew_reverse_kl": ["alpha"]}.get(name, []), static)
  )
  for k, t in zip(params, traced):
    params[k] = jnp.float32(t) if params[k] is None else params[k]
  divergence = kd.Divergence(name, **params)
  return lambda z, y: kd.divergence_from_logits(
    z, y, divergence=divergence, temperature=2.0, **options
  )


@pytest.mark.parametrize("formula", FORMULAS, ids=lambda f: f"{f[0]}{f[1]}")
def test_public_loss_through_the_kernel(formula):
  """Value and gradients (student and teacher) of ``divergence_from_logits`` on the TPU
  path, the kernel interpreted, against the CPU path."""
  z, y = _logits(11, 384, jnp.float32, seed=1)
  loss = _loss(*formula)
  program = jax.jit(
    jax.value_and_grad(lambda z, y: jnp.sum(jnp.nan_to_num(loss(z, y), nan=0.0)), (0, 1))
  )
  want = program(z, y)
  with tpu_kernel():
    got = program(z, y)
    per_row = np.asarray(jax.jit(loss)(z, y))
  np.testing.assert_allclose(per_row, loss(z, y), rtol=2e-5, atol=1e-6)
  assert np.isnan(per_row[[3, 4]]).all() and per_row[2] == 0 and per_row[5] == 0
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-6)


def test_masks_through_the_kernel():
  """``where`` per example (a mask of rows: the kernel) and per element (the XLA passes), and
  the fused LM-head loss with JSD (its chunks' token mask), on the TPU path against CPU."""
  z, y = _logits(11, 384, jnp.float32, seed=3)
  example = jnp.arange(11) % 4 != 1
  element = jnp.asarray(np.random.default_rng(4).random((11, 384)) > 0.2)
  rng = np.random.default_rng(5)
  h = jnp.asarray(rng.standard_normal((37, 16)), jnp.float32)
  w, tw = (jnp.asarray(rng.standard_normal((16, 256)), jnp.float32) for _ in range(2))
  tokens = jnp.arange(37) % 6 != 0

  def fused(h, w):
    return kd.fused_distillation_loss(
      h, w, h, tw, divergence="jsd", temperature=2.0, chunk_size=16, where=tokens
    )

  losses = {
    "example": lambda z: jnp.nansum(_loss("jsd", (0.5,), (), where=example)(z, y)),
    "element": lambda z: jnp.nansum(_loss("tvd", (), (), where=element)(z, y)),
  }
  programs = {k: jax.jit(jax.value_and_grad(f)) for k, f in losses.items()}
  fused_program = jax.jit(jax.value_and_grad(fused, (0, 1)))
  want = {k: p(z) for k, p in programs.items()}
  want_fused = fused_program(h, w)
  with tpu_kernel():
    got = {k: p(z) for k, p in programs.items()}
    got_fused = fused_program(h, w)
  for g, w_ in zip(jax.tree.leaves((got, got_fused)), jax.tree.leaves((want, want_fused))):
    np.testing.assert_allclose(g, w_, rtol=2e-5, atol=1e-6)
  assert "tpu_custom_call" in _tpu_text(losses["example"], z)
  assert "tpu_custom_call" in _tpu_text(fused, h, w)
  assert "tpu_custom_call" not in _tpu_text(losses["element"], z)


def test_hessian_and_vmap_through_the_kernel():
  """A hessian (the kernel's statistics differentiated: the XLA passes' derivatives); a
  ``vmap`` over a batch of examples (stacked into one kernel call); and one with a batched
  mask and temperature (the XLA passes mapped)."""
  rng = np.random.default_rng(2)
  z = jnp.asarray(rng.standard_normal((3, 40)), jnp.float32)
  y = jnp.asarray(rng.standard_normal((3, 40)), jnp.float32)
  loss = _loss("skew_kl", (0.1,), ())
  hessian = jax.jit(jax.hessian(lambda z: jnp.sum(loss(z, y))))
  batched = jax.jit(jax.vmap(loss))
  zb, yb = jnp.stack([z, 2 * z]), jnp.stack([y, y + 1])
  masked = jax.jit(
    jax.vmap(
      lambda z, y, w, t: kd.divergence_from_logits(z, y, divergence="tvd", where=w, temperature=t)
    )
  )
  wb, tb = (
    jnp.asarray([[[True], [False], [True]], [[True], [True], [False]]]),
    jnp.asarray([1.0, 3.0]),
  )
  want = hessian(z), batched(zb, yb), masked(zb, yb, wb, tb)
  with tpu_kernel():
    got = hessian(z), batched(zb, yb), masked(zb, yb, wb, tb)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(got[1], want[1], rtol=2e-5, atol=1e-7)
  np.testing.assert_allclose(got[2], want[2], rtol=2e-5, atol=1e-7)
  assert _tpu_text(jax.vmap(loss), zb, yb).count("@tpu_custom_call") == 1


def _tpu_text(fn, *args):
  return export.export(jax.jit(fn), platforms=("tpu",))(*args).mlir_module()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_tpu_program_holds_the_kernel(dtype):
  """A program lowered for TPU holds the Pallas kernel (a Mosaic custom call), in the loss
  and its gradient; one lowered for CPU or CUDA does not."""
  z, y = _logits(16, 256, dtype)
  grad = jax.grad(lambda z: jnp.sum(_loss("jsd", (0.5,), ())(z, y)))
  assert "tpu_custom_call" in _tpu_text(grad, z)
  for platform in ("cpu", "cuda"):
    text = export.export(jax.jit(grad), platforms=(platform,))(z).mlir_module()
    assert "tpu_custom_call" not in text


def test_x64_lowers_the_kernel_in_int32(monkeypatch, capsys):
  """Under ``jax_enable_x64``, float32 logits (with a traced beta and a mask of rows) still
  take the kernel, and its Mosaic module computes no index in int64: Mosaic takes none (a
  Python int is int64 under x64; libtpu failed to compile such a kernel). Read from the
  module Pallas prints with ``debug=True``."""
  from jax.experimental import pallas as pl

  monkeypatch.setattr(pl, "pallas_call", functools.partial(pl.pallas_call, debug=True))
  z, y = _logits(16, 300, jnp.float32)
  with enable_x64():
    beta = jnp.float32(0.3)
    loss = _loss("jsd", (None,), (0.3,), where=jnp.arange(16)[:, None] > 2)
    text = _tpu_text(lambda z, b: jnp.sum(loss(z, y)) * b, z, beta)
  if jax.__version_info__ < X64_KERNEL_JAX:  # Pallas there cannot lower it: the XLA passes
    assert "tpu_custom_call" not in text
    return
  assert "tpu_custom_call" in text
  module = capsys.readouterr().out
  assert "func.func @_kernel" in module
  int64 = re.findall(r"(?:arith\.\w+|return|func\.func @transform).*\bi64\b.*", module)
  assert not int64, int64[:3]


def test_what_the_kernel_does_not_take_keeps_the_xla_passes():
  """Masks of single elements (``where`` of the logits' shape), float16 logits, float64
  (x64), rows too long for VMEM and the one-pass KL family lower without the kernel on TPU."""
  z, y = _logits(16, 256, jnp.float32)
  where = jnp.ones((16, 256), bool)
  assert "tpu_custom_call" in _tpu_text(_loss("tvd", (), ()), z, y)
  assert "tpu_custom_call" not in _tpu_text(_loss("tvd", (), (), where=where), z, y)
  assert "tpu_custom_call" not in _tpu_text(_loss("tvd", (), ()), z.astype(jnp.float16), y)
  assert "tpu_custom_call" not in _tpu_text(_loss("forward_kl", (), ()), z, y)
  # Rows whose double-buffered blocks pass 12 MiB of VMEM (a v4 TensorCore has 16 MiB).
  long = jnp.zeros((8, 98304 + 128), jnp.float32)
  assert "tpu_custom_call" in _tpu_text(_loss("tvd", (), ()), long[:, :98304], long[:, :98304])
  assert "tpu_custom_call" not in _tpu_text(_loss("tvd", (), ()), long, long)
  with enable_x64():
    z64, y64 = z.astype(jnp.float64), y.astype(jnp.float64)
    assert "tpu_custom_call" not in _tpu_text(_loss("tvd", (), ()), z64, y64)


def test_exported_for_every_platform_runs_on_cpu():
  """One artefact for CPU, CUDA and TPU holds the kernel for TPU and runs on CPU (where a
  ``pallas_call`` inside ``lax.platform_dependent`` would fail to lower)."""
  z, y = _logits(300, 256, jnp.float32)
  program = jax.jit(
    jax.value_and_grad(lambda z, y: jnp.sum(jnp.nan_to_num(_loss("jsd", (0.5,), ())(z, y))), (0, 1))
  )
  exported = export.export(program, platforms=("cpu", "cuda", "tpu"))(z, y)
  assert "tpu_custom_call" in exported.mlir_module()
  got = export.deserialize(exported.serialize()).call(z, y)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(program(z, y))):
    np.testing.assert_array_equal(g, w)


def test_implementation_xla_keeps_the_kernel_out_per_call_and_globally(monkeypatch):
  """``implementation="xla"`` leaves no Mosaic call in a program lowered for TPU, for every
  public loss that can reach the kernel (the loss and its gradient); so do
  ``set_implementation("xla")`` and ``$KLDIV_JAX_IMPLEMENTATION=xla``, read at trace time;
  ``"pallas"`` (the default) keeps the kernel. Values: the interpreted kernel and the XLA
  passes agree on CPU."""
  z, y = _logits(16, 256, jnp.float32)
  w = jnp.eye(256, dtype=jnp.float32)  # the fused loss's heads: its logits are z and y
  labels = jnp.arange(16) % 256
  losses = {
    "divergence_from_logits": lambda z, y, **kw: kd.divergence_from_logits(
      z, y, divergence="tvd", **kw
    ),
    "generalized_jsd": lambda z, y, **kw: kd.generalized_jsd(z, y, beta=0.3, **kw),
    "distillation_loss": lambda z, y, **kw: kd.distillation_loss(
      z, y, labels, divergence="jsd", **kw
    ),
    "fused_distillation_loss": lambda z, y, **kw: kd.fused_distillation_loss(
      z, w, y, w, labels, divergence="jsd", **kw
    ),
    "metric": lambda z, y, **kw: (
      kd.DivergenceMetric.configure(divergence="tvd").from_model_output(z, y, **kw).total
    ),
  }
  for name, loss in losses.items():

    def grad(z, loss=loss, **kw):
      return jax.grad(lambda z: jnp.sum(loss(z, y, **kw)))(z)

    assert "tpu_custom_call" in _tpu_text(grad, z), name
    assert "tpu_custom_call" not in _tpu_text(functools.partial(grad, implementation="xla"), z)
  loss = losses["divergence_from_logits"]

  def fresh(**kw):  # a new function: jax.jit caches a function's trace, and the default is
    return lambda z, y: loss(z, y, **kw)  # read when tracing

  previous = kd.set_implementation("xla")
  try:
    assert "tpu_custom_call" not in _tpu_text(fresh(), z, y)
    # A per-call choice wins over the default.
    assert "tpu_custom_call" in _tpu_text(fresh(implementation="pallas"), z, y)
  finally:
    assert kd.set_implementation(previous) == "xla"
  monkeypatch.setenv("KLDIV_JAX_IMPLEMENTATION", "xla")
  assert "tpu_custom_call" not in _tpu_text(fresh(), z, y)
  monkeypatch.setenv("KLDIV_JAX_IMPLEMENTATION", "pallas")
  assert "tpu_custom_call" in _tpu_text(fresh(), z, y)
  monkeypatch.setenv("KLDIV_JAX_IMPLEMENTATION", "mosaic")
  with pytest.raises(
    ValueError, match=r"KLDIV_JAX_IMPLEMENTATION must be one of 'xla', 'pallas'; got 'mosaic'"
  ):
    loss(z, y)
  monkeypatch.delenv("KLDIV_JAX_IMPLEMENTATION")
  with pytest.raises(ValueError, match="divergence_from_logits: implementation must be"):
    loss(z, y, implementation="triton")
  with tpu_kernel():
    pallas = jax.jit(loss)(z, y)
    xla = jax.jit(functools.partial(loss, implementation="xla"))(z, y)
  np.testing.assert_allclose(pallas, xla, rtol=2e-5, atol=1e-6)
