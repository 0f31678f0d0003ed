"""The opt-in Pallas Triton kernels of the row statistics for NVIDIA GPUs (``_gpu_rows``).

Without a GPU the kernels run in Pallas' interpreter on CPU (the CUDA lowerings registered
for CPU, every ``lax.platform_dependent`` on its CUDA branch); with one (``jax.default_backend()
== "gpu"``, as ``benchmarks/gpu_check.sh`` runs this file) they are compiled by Triton for real and
compared with the XLA path on the same device. Against the XLA passes they replace: the KL
family's one-pass statistics and the class sums of JSD, skew KL, skew reverse KL and TVD
(split over columns, and from whole rows held by a program: one read), on rows with ``-inf``, NaN and ``+inf`` logits, identical rows, rows without mass, shapes
that are no multiple of a block or a split, bfloat16, soft-caps, masks of rows and classes
and traced parameters; the public losses through them (values, gradients, a hessian,
``vmap``); the switch (off by default, on in its context, the jit caches keyed by it); and
the program lowered for CUDA (a Triton custom call where switched on, none where off). The
gradient pass's kernel (``_gpu_grad``) runs inside these losses' gradients too; its own tests are
``tests/test_gpu_grad_pass.py``.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _gpu_programs import GPU_KERNEL_MARKS, ON_GPU, TRITON_CALL, count_calls, cuda_text
from _references import enable_x64, hostile_logits, platform_branch
from jax.interpreters import mlir

import kldiv_jax as kd
from kldiv_jax import _gpu_grad, _gpu_one_pass, _gpu_rows
from kldiv_jax._class_sums import Needs
from kldiv_jax._gpu_one_pass import ONE_PASS_SUMS, triton_one_pass_sums, xla_one_pass_sums
from kldiv_jax._gpu_rows import layout, triton_row_sums, whole_rows_layout
from kldiv_jax._platform import gpu_kernels, gpu_kernels_setting
from kldiv_jax._whole_rows import ROW_SUMS, xla_row_sums

pytestmark = GPU_KERNEL_MARKS
INTERPRET = not ON_GPU

# (name, static params (None where traced), traced values)
TWO_PASS = [
  ("jsd", (0.5,), ()),
  ("jsd", (None,), (0.3,)),
  ("skew_kl", (0.1,), ()),
  ("skew_reverse_kl", (None,), (0.2,)),
  ("tvd", (), ()),
]
# A grid of several row blocks, splits and tiles for the small test shapes (rows and classes
# no multiple of any of them): the last split holds fewer tiles, the last tile is partial.
SMALL = dict(block_rows=4, tile=32, splits=3)


def _logits(rows, classes, dtype, seed=0):
  """Two ``[rows, classes]`` logits with hostile rows: ``-inf`` classes, a row without
  teacher mass, identical rows, a NaN, a ``+inf``, a row without any mass, a row whose mass
  sits in one tile of the last split, and large logits (no overflow)."""
  z, y = hostile_logits(rows, classes, seed)  # rows 0-5
  z[6, : classes - 3] = -np.inf
  z[7] += 500.0
  return jnp.asarray(z, dtype), jnp.asarray(y, dtype)


@contextlib.contextmanager
def gpu_kernel():
  """Inside the block the GPU kernels are switched on; on CPU the CUDA path runs with the
  kernels in Pallas' interpreter (and restored after)."""
  if ON_GPU:
    with gpu_kernels(True):
      yield
    return
  with platform_branch("cuda"), gpu_kernels(True):
    mlir.register_lowering(
      ROW_SUMS, functools.partial(_gpu_rows.cuda_lowering, interpret=True), platform="cpu"
    )
    mlir.register_lowering(
      ONE_PASS_SUMS,
      functools.partial(_gpu_one_pass.one_pass_cuda_lowering, interpret=True),
      platform="cpu",
    )
    mlir.register_lowering(
      _gpu_grad.GRAD_PASS,
      functools.partial(_gpu_grad.grad_pass_cuda_lowering, interpret=True),
      platform="cpu",
    )
    try:
      yield
    finally:
      from kldiv_jax._whole_rows import XLA_LOWERING

      mlir.register_lowering(ROW_SUMS, XLA_LOWERING, platform="cpu")
      mlir.register_lowering(ONE_PASS_SUMS, _gpu_one_pass.ONE_PASS_XLA_LOWERING, platform="cpu")
      mlir.register_lowering(_gpu_grad.GRAD_PASS, _gpu_grad.GRAD_PASS_XLA_LOWERING, platform="cpu")


@contextlib.contextmanager
def xla_path():
  """The reference: the same CUDA branch (XLA's passes) with the kernels off."""
  if ON_GPU:
    yield
    return
  with platform_branch("cuda"):
    yield


def _close(got, want, used, tol):
  """Finite/infinite/NaN on the same used rows; the finite values to ``tol`` relative to
  ``1 + |want|``."""
  got, want = np.asarray(got, np.float64)[used], np.asarray(want, np.float64)[used]
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
  finite = np.isfinite(want)
  err = np.abs(got[finite] - want[finite]) / (1.0 + np.abs(want[finite]))
  assert err.max(initial=0.0) < tol, err.max()


@pytest.mark.parametrize("kind", [("kl",), ("ab", 0.5, 0.3)], ids=["kl", "ab"])
@pytest.mark.parametrize(
  "rows,classes,dtype,caps,masked,grid",
  [
    (13, 300, jnp.float32, (None, None), False, SMALL),
    (13, 300, jnp.float32, (None, None), False, None),  # the default layout: one split
    (10, 200, jnp.bfloat16, (None, None), False, SMALL),
    (9, 250, jnp.float32, (20.0, 30.0), True, dict(block_rows=2, tile=64, splits=2)),
  ],
)
def test_one_pass_sums_match_the_xla_pass(kind, rows, classes, dtype, caps, masked, grid):
  """The one-pass statistics ``(mu, su, mv, sv, *sums)`` against ``online_kl_sums`` (``gv,
  gu``) and ``online_ab_sums`` (``G, H, T``)."""
  z, y = _logits(rows, classes, dtype)
  masks = ()
  if masked:
    masks = (jnp.arange(rows)[:, None] % 4 != 1, jnp.arange(classes)[None, :] % 5 != 0)
  grid = grid and layout(rows, classes, **grid)
  kernel = functools.partial(triton_one_pass_sums, kind, caps, grid=grid, interpret=INTERPRET)
  got = np.concatenate(jax.jit(kernel)(z, y, jnp.float32(2.0), *masks), 1)
  xla = functools.partial(xla_one_pass_sums, kind, caps)
  want = np.concatenate(jax.jit(xla)(z, y, 2.0, *masks), 1)
  assert got.shape == want.shape == (rows, 6 if kind == ("kl",) else 7)
  # The maxes exactly (but on row 3: Triton's max skips a NaN, XLA's returns it; the sums
  # are NaN either way); rows without mass: zeros; rows 3 and 4 (NaN, +inf): NaN sums.
  rows_ = np.arange(rows) != 3
  # Exactly in the interpreter; on a GPU to an ulp or two: with a soft-cap, Triton's tanh is
  # not XLA:GPU's (an H200 showed 1-ulp differences in the capped rows' maxes).
  maxes = got[rows_][:, [0, 2]], want[rows_][:, [0, 2]]
  if INTERPRET:
    np.testing.assert_array_equal(*maxes)
  else:
    np.testing.assert_allclose(*maxes, rtol=3e-7, atol=0)
  np.testing.assert_array_equal(got[5], 0.0)
  assert np.isnan(got[[3, 4], 1]).all()
  valid = np.isfinite(want[:, 1]) & np.isfinite(want[:, 3])
  assert valid.sum() >= rows - 2
  _close(got, want, valid, 1e-5)
  if masked:  # a masked row has no mass on either side
    np.testing.assert_array_equal(got[1::4], 0.0)


def _row_sums_call(formula, rows, classes, dtype, caps, masked, temperature):
  """``(spec, args)`` of a two-pass formula's row sums (``ROW_SUMS``' operands) on hostile
  logits, with masks of rows and classes if ``masked``."""
  name, static, traced = formula
  needs = Needs(a=True, b=True, params=tuple(s is None for s in static))
  z, y = _logits(rows, classes, dtype)
  masks = ()
  if masked:
    masks = (jnp.arange(rows)[:, None] % 4 != 1, jnp.arange(classes)[None, :] % 5 != 0)
  spec = (name, static, needs, caps, len(masks))
  return spec, (z, y, jnp.float32(temperature), *(jnp.float32(t) for t in traced), *masks)


@pytest.mark.parametrize("formula", TWO_PASS, ids=lambda f: f"{f[0]}{f[1]}")
@pytest.mark.parametrize(
  "rows,classes,dtype,caps,masked",
  [
    (13, 300, jnp.float32, (None, None), False),
    (10, 200, jnp.bfloat16, (None, 25.0), True),
  ],
)
def test_row_sums_match_the_xla_passes(formula, rows, classes, dtype, caps, masked):
  """The statistics, identical-rows gap and class sums of the two-pass formulas against
  ``xla_row_sums``."""
  spec, args = _row_sums_call(formula, rows, classes, dtype, caps, masked, 2.0)
  needs = spec[2]
  grid = layout(rows, classes, **SMALL)
  kernel = functools.partial(triton_row_sums, spec, grid=grid, interpret=INTERPRET)
  got = np.concatenate(jax.jit(kernel)(*args), 1)
  want = np.concatenate(jax.jit(functools.partial(xla_row_sums, spec))(*args), 1)
  assert got.shape == want.shape == (rows, 5 + needs.num_sums())
  np.testing.assert_array_equal(got[:, 4] == 0, want[:, 4] == 0)  # identical rows
  assert got[5, 4] == 0 and (got[2, 4] == 0) == (caps[0] == caps[1])
  assert np.isnan(got[[3, 4], 1]).all()
  used = np.isfinite(want[:, 1]) & np.isfinite(want[:, 3]) & (want[:, 4] != 0)
  assert used.sum() >= rows - 5 - 3 * masked
  _close(got, want, used, 1e-4)


@pytest.mark.parametrize("formula", TWO_PASS, ids=lambda f: f"{f[0]}{f[1]}")
@pytest.mark.parametrize(
  "rows,classes,dtype,caps,masked,block_rows,temperature",
  [
    (13, 300, jnp.float32, (None, None), False, None, 2.0),  # the default: one program
    (13, 300, jnp.float32, (20.0, 30.0), True, 2, 1.0),  # 7 programs, the last half empty
    (10, 200, jnp.bfloat16, (None, 25.0), True, 4, 2.0),
    (9, 256, jnp.float32, (None, None), False, 1, 1.0),  # a row a program, no padding
    (11, 37, jnp.float32, (None, None), True, 8, 0.5),
  ],
)
def test_whole_row_sums_match_the_xla_passes(
  formula, rows, classes, dtype, caps, masked, block_rows, temperature
):
  """The whole-row kernel (one Triton call: a program's rows held on chip, the statistics
  then the class sums) against ``xla_row_sums``: statistics, identical-rows gap, class sums,
  on hostile rows, odd row counts and widths (padded to a power of 2), bfloat16, soft-caps,
  masks of rows and classes, traced parameters, several temperatures."""
  spec, args = _row_sums_call(formula, rows, classes, dtype, caps, masked, temperature)
  needs = spec[2]
  grid = whole_rows_layout(rows, classes, block_rows)
  assert grid is not None and grid[1] >= classes and grid[2:] == (1, 1)
  kernel = functools.partial(triton_row_sums, spec, grid=grid, interpret=INTERPRET)
  assert str(jax.make_jaxpr(kernel)(*args)).count("pallas_call[") == 1  # one read
  got = np.concatenate(jax.jit(kernel)(*args), 1)
  want = np.concatenate(jax.jit(functools.partial(xla_row_sums, spec))(*args), 1)
  assert got.shape == want.shape == (rows, 5 + needs.num_sums())
  # The maxes exactly (but on row 3, a NaN: Triton's max skips it, XLA's returns it).
  keep = np.arange(rows) != 3
  if INTERPRET:
    np.testing.assert_array_equal(got[keep][:, [0, 2]], want[keep][:, [0, 2]])
  np.testing.assert_array_equal(got[:, 4] == 0, want[:, 4] == 0)  # identical rows
  assert got[5, 4] == 0 and (got[2, 4] == 0) == (caps[0] == caps[1])
  assert np.isnan(got[[3, 4], 1]).all()
  if masked:  # a masked row has no mass on either side
    np.testing.assert_array_equal(got[1::4, [1, 3]], 0.0)
  used = np.isfinite(want[:, 1]) & np.isfinite(want[:, 3]) & (want[:, 4] != 0)
  assert used.sum() >= rows - 5 - 3 * masked
  _close(got, want, used, 1e-4)


def test_which_rows_a_program_holds():
  """Rows fit a program up to ``WHOLE_ROW_ELEMENTS`` classes (padded to a power of 2), one
  row a program at 8192 with 16 warps; longer rows take the split kernels; the switch's
  layout can ask for whole rows (tile 0) or for the split kernels."""
  launch = _gpu_rows._launch
  assert launch((4096, 8192), True, whole=True) == ((1, 8192, 1, 1), 16, 1, True)
  assert launch((4096, 1000), True, whole=True) == ((8, 1024, 1, 1), 16, 1, True)
  assert launch((3, 100), True, whole=True) == ((4, 128, 1, 1), 4, 1, True)
  assert launch((4096, 8193), True, whole=True)[3] is False
  assert launch((2048, 131072), True, whole=True)[3] is False
  assert launch((4096, 8192), True)[3] is False  # the one-pass kernel: already one read
  assert launch((4096, 8192), (2, 0, 8, 1), whole=True) == ((2, 8192, 1, 1), 8, 1, True)
  assert launch((4096, 8192), (4, 1024, 4, 3), whole=True)[3] is False


def _loss(name, *, where=None, **params):
  divergence = kd.Divergence(name, **params)
  return lambda z, y: kd.divergence_from_logits(
    z, y, divergence=divergence, temperature=2.0, where=where
  )


@pytest.fixture
def small_tiles(monkeypatch):
  """The default layout with tiles of 32 classes and no minimum of tiles per split, so that
  the small test rows take several splits (and no whole-row kernel: no row fits)."""
  monkeypatch.setattr(_gpu_rows, "TILE", 32)
  monkeypatch.setattr(_gpu_rows, "MIN_TILES", 1)
  monkeypatch.setattr(_gpu_rows, "WHOLE_ROW_ELEMENTS", 16)


@pytest.mark.parametrize(
  "name,params",
  [
    ("forward_kl", {}),
    ("reverse_kl", {}),
    ("symmetric_kl", {}),
    ("jsd", {"beta": 0.5}),
    ("skew_kl", {"alpha": 0.1}),
    ("tvd", {}),
    ("alpha_beta", {"alpha": 0.5, "beta": 0.3}),
  ],
)
def test_public_loss_through_the_kernels(name, params, small_tiles):
  """Per-row values and gradients (student and teacher) of ``divergence_from_logits`` with
  the kernels against the XLA path, on hostile rows and in bfloat16, with a mask of rows."""
  where = jnp.arange(11)[:, None] != 9
  one_pass = name in ("forward_kl", "reverse_kl", "symmetric_kl", "alpha_beta")
  _check_public(_loss(name, where=where, **params), one_pass)


def _check_public(loss, one_pass, masked_row=9, identical=True):
  """``loss`` of hostile ``[11, 150]`` logits (float32, bfloat16): per-row values and both
  gradients with the kernels against the XLA path (``identical``: row 2's sides are equal;
  not with different soft-caps)."""
  z, y = _logits(11, 150, jnp.float32, seed=1)
  total = lambda z, y: jnp.sum(jnp.nan_to_num(loss(z, y), nan=0.0, posinf=0.0))  # noqa: E731
  run = lambda z, y: (loss(z, y), jax.value_and_grad(total, (0, 1))(z, y))  # noqa: E731
  with xla_path():
    want = jax.jit(run)(z, y)
    want16 = jax.jit(run)(z.astype(jnp.bfloat16), y.astype(jnp.bfloat16))
  with gpu_kernel():
    got = jax.jit(run)(z, y)
    got16 = jax.jit(run)(z.astype(jnp.bfloat16), y.astype(jnp.bfloat16))
    text = str(jax.make_jaxpr(loss)(z, y))
  assert ("kldiv_jax_gpu_one_pass_sums" in text) == one_pass
  assert ("kldiv_jax_row_sums" in text) == (not one_pass)
  per_row = np.asarray(got[0])
  assert np.isnan(per_row[[3, 4]]).all() and per_row[5] == 0
  assert (per_row[2] == 0) == identical
  if masked_row is not None:
    assert per_row[masked_row] == 0  # masked by where
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)
  for g, w in zip(jax.tree.leaves(got16), jax.tree.leaves(want16)):
    np.testing.assert_allclose(
      np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-2, atol=1e-3
    )


@pytest.mark.parametrize(
  "name,params",
  [
    ("jsd", {"beta": 0.3}),
    ("skew_kl", {"alpha": 0.1}),
    ("skew_reverse_kl", {"alpha": 0.2}),
    ("tvd", {}),
  ],
)
@pytest.mark.parametrize(
  "temperature,caps,where",
  [(1.0, {}, "rows"), (2.0, {"softcap": 30.0, "target_softcap": 20.0}, "classes")],
  ids=["T1", "T2-softcap-classes"],
)
def test_public_loss_through_the_whole_row_kernel(
  name, params, temperature, caps, where, monkeypatch
):
  """As above through the whole-row kernel (the default where a row fits, here 150 classes):
  JSD, skew KL, skew reverse KL and TVD at the default temperature and at T = 2 with soft-caps,
  a mask of rows or of classes; the kernel traced (not the XLA passes' fallback)."""
  calls = count_calls(monkeypatch, _gpu_rows, "_whole_rows_kernel")
  mask = jnp.arange(11)[:, None] != 9 if where == "rows" else jnp.arange(150)[None, :] % 7 != 3
  divergence = kd.Divergence(name, **params)

  def loss(z, y):
    return kd.divergence_from_logits(
      z, y, divergence=divergence, temperature=temperature, where=mask, **caps
    )

  _check_public(loss, False, masked_row=9 if where == "rows" else None, identical=not caps)
  assert calls  # traced by the CUDA lowering


@pytest.mark.parametrize("whole", [False, True], ids=["split", "whole-rows"])
def test_hessian_and_vmap_through_the_kernels(whole, small_tiles, monkeypatch):
  """A hessian (the statistics differentiated: the XLA passes' derivatives) and ``vmap``
  (a batch of logits stacked into one call) of forward KL and JSD (JSD's sums split over
  columns, or from whole rows)."""
  if whole:
    monkeypatch.setattr(_gpu_rows, "WHOLE_ROW_ELEMENTS", 8192)
  rng = np.random.default_rng(2)
  z = jnp.asarray(rng.standard_normal((3, 70)), jnp.float32)
  y = jnp.asarray(rng.standard_normal((3, 70)), jnp.float32)
  zb, yb = jnp.stack([z, 2 * z]), jnp.stack([y, y + 1])
  programs = []
  for name, params in (("forward_kl", {}), ("jsd", {"beta": 0.3})):
    loss = _loss(name, **params)
    programs.append(jax.jit(jax.hessian(lambda z, loss=loss: jnp.sum(loss(z, y)))))
    programs.append(jax.jit(jax.vmap(jax.grad(lambda z, y, loss=loss: jnp.sum(loss(z, y))))))
  with xla_path():
    want = [programs[0](z), programs[1](zb, yb), programs[2](z), programs[3](zb, yb)]
  with gpu_kernel():
    got = [programs[0](z), programs[1](zb, yb), programs[2](z), programs[3](zb, yb)]
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_the_switch():
  """Off by default; on inside ``gpu_kernels(True)``; a jitted loss traced again for each
  (the switch is part of JAX's cache keys): the kernel's primitive only where on."""
  assert not bool(gpu_kernels_setting())
  z, y = _logits(8, 64, jnp.float32)
  loss = jax.jit(_loss("forward_kl"))
  seen = []
  original = _gpu_one_pass.one_pass_sums

  def spy(*args):
    seen.append(bool(gpu_kernels_setting()))
    return original(*args)

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr("kldiv_jax._engine.one_pass_sums", spy)
    with xla_path():
      off = loss(z, y)
    with gpu_kernel():
      assert bool(gpu_kernels_setting())
      on = loss(z, y)
    with xla_path():
      off_again = loss(z, y)
  assert seen == [True]
  np.testing.assert_array_equal(off, off_again)
  np.testing.assert_allclose(on, off, rtol=2e-5, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize(
  "name,classes,kernels", [("forward_kl", 256, 2), ("jsd", 256, 2), ("jsd", 8200, 3)]
)
def test_the_cuda_program_holds_the_kernels(name, classes, kernels):
  """Lowered for CUDA with the kernels on, the loss and its gradient hold Triton calls (one
  for the KL family's statistics; one for JSD's from whole rows, two where a row does not fit
  a program: statistics, then class sums; and the gradient pass's, :mod:`kldiv_jax._gpu_grad`);
  off, none; masks of single elements keep the XLA passes."""
  z, y = _logits(16, classes, jnp.float32)
  grad = jax.grad(lambda z: jnp.sum(_loss(name)(z, y)))
  assert TRITON_CALL not in cuda_text(grad, z)
  with gpu_kernels(True):
    text = cuda_text(grad, z)
    element = cuda_text(_loss(name, where=jnp.ones((16, classes), bool)), z, y)
  assert text.count(f"@{TRITON_CALL}") == kernels, text.count(TRITON_CALL)
  assert TRITON_CALL not in element


@pytest.mark.parametrize("name", ["forward_kl", "tvd"])
def test_the_public_switch_chooses_the_gpu_kernels(name, monkeypatch):
  """The losses' ``implementation=``: ``"pallas"`` per call, process-wide
  (``set_implementation``) or from ``KLDIV_JAX_IMPLEMENTATION`` puts the Triton kernels in a
  program lowered for CUDA; ``None`` with nothing set (the library's choice: XLA on GPUs) and
  ``"xla"`` keep them out, ``"xla"`` even inside the private context."""
  z, y = _logits(16, 256, jnp.float32)

  def loss(implementation=None):
    return lambda z, y: kd.divergence_from_logits(
      z, y, divergence=name, temperature=2.0, implementation=implementation
    )

  def calls(fn):
    return cuda_text(fn, z, y).count(f"@{TRITON_CALL}")

  kernels = 1  # forward KL's one-pass kernel; TVD's whole-row kernel
  assert calls(loss()) == 0
  assert calls(loss("pallas")) == kernels
  assert calls(loss("xla")) == 0
  with gpu_kernels(True):
    assert calls(loss("xla")) == 0
  previous = kd.set_implementation("pallas")
  try:
    assert calls(loss()) == kernels
    assert calls(loss("xla")) == 0
  finally:
    kd.set_implementation(previous)
  monkeypatch.setenv("KLDIV_JAX_IMPLEMENTATION", "pallas")
  assert calls(loss()) == kernels


def test_the_switch_inside_a_traced_function():
  """Entered inside a jitted function (as a per-call option would), the switch reaches the
  CUDA lowering of the two-pass statistics, which runs after the trace has left it."""
  z, y = _logits(16, 256, jnp.float32)
  loss = _loss("tvd")

  def on(z, y):
    with gpu_kernels(True):
      return loss(z, y)

  assert cuda_text(on, z, y).count(f"@{TRITON_CALL}") == 1
  assert TRITON_CALL not in cuda_text(loss, z, y)


def test_a_layout_for_the_benchmarks_sweeps():
  """A layout in the switch, ``(rows per program, tile, warps, stages)``, reaches the Triton
  calls of both primitives (their launch parameters; tile 0: whole rows), and its results
  are the same."""
  z, y = _logits(16, 256, jnp.float32)
  for name in ("forward_kl", "tvd"):
    with gpu_kernels((2, 64, 8, 2)):
      text = cuda_text(_loss(name), z, y)
    assert "num_warps = 8 : i32" in text and "num_stages = 2 : i32" in text
    assert "num_warps = 4 : i32" not in text
  with gpu_kernels((2, 0, 16, 1)):  # tile 0: whole rows, 2 a program, 16 warps
    text = cuda_text(_loss("tvd"), z, y)
  assert text.count(f"@{TRITON_CALL}") == 1 and "num_warps = 16 : i32" in text
  with xla_path():
    want = jax.jit(_loss("jsd", beta=0.3))(z, y)
  with gpu_kernel(), gpu_kernels((2, 64, 8, 2)):
    got = jax.jit(_loss("jsd", beta=0.3))(z, y)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("whole", [False, True], ids=["split", "whole-rows"])
def test_x64(whole, small_tiles, monkeypatch):
  """Under ``jax_enable_x64`` float32 logits take the kernels (int32 indices beside int64
  Python ints), with the values and gradients of the XLA path; float64 keeps the XLA path.
  JSD's sums split over columns, or from whole rows."""
  if whole:
    monkeypatch.setattr(_gpu_rows, "WHOLE_ROW_ELEMENTS", 8192)
  z, y = _logits(11, 150, jnp.float32, seed=4)
  with enable_x64():
    for name in ("forward_kl", "jsd"):
      loss = _loss(name)
      run = jax.jit(
        lambda z, y, loss=loss: (loss(z, y), jax.grad(lambda z: jnp.nansum(loss(z, y)))(z))
      )
      with xla_path():
        want = run(z, y)
        want64 = run(z.astype(jnp.float64), y.astype(jnp.float64))
      with gpu_kernel():
        got = run(z, y)
        got64 = run(z.astype(jnp.float64), y.astype(jnp.float64))
        assert "kldiv_jax_gpu_one_pass_sums" in str(jax.make_jaxpr(loss)(z, y)) or name == "jsd"
      assert got[0].dtype == jnp.float32 and got64[0].dtype == jnp.float64
      for g, w in zip((*got, *got64), (*want, *want64)):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)
