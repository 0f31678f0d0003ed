"""Parity of ``kl_div``, ``KLDivLoss`` and ``kl_div_pointwise`` with torch.

Two sources of truth, checked by the same code:

- torch itself, live (``test_live_*``, marked ``torch``: skipped cleanly when
  torch is not importable): values, gradients wrt input and target (of
  ``sum(loss * cot)``), second derivatives wrt ``(t, t)`` and ``(x, t)``
  (``jax`` forward-over-reverse against ``torch.autograd.functional.hessian``,
  torch's double backward), warnings, type promotion, legacy arguments, errors.
- golden values torch 2.13 wrote into ``tests/fixtures/torch_kl_div.npz`` with
  ``tests/fixtures/make_torch_fixtures.py`` (``test_fixture_*``, no torch
  needed): the twin of every live test, so that nothing is left unchecked
  without torch; and a live test that the files are still what torch computes.

Half precision: kldiv_jax computes float16/bfloat16 in float32 and rounds the
result to the half dtype; torch computes in the half dtype itself. The
reference for half inputs is therefore torch run in float32 on the same
(half-rounded) inputs, its results rounded to the half dtype, compared with
torch's half-precision tolerance (``_references.TOLERANCES``). The result dtype
is checked against torch run natively in the half dtype. Likewise for mixed
dtypes: torch evaluates ``xlogy(t, t)`` in the target's own dtype before
promoting (so a bfloat16 target costs it bfloat16 precision even where the
result is float32); kldiv_jax promotes first. The value reference there is
torch on inputs cast to the promoted dtype; the dtypes are torch's native ones.

Where kldiv_jax deliberately differs from torch (zero-mass targets, see
``torch-kl-div.md``), the tests assert kldiv_jax's convention *and* that torch
is not finite there, so they notice if torch changes.

Speed: every case runs under one ``jax.jit`` per group of cases (a shape pair:
both ``log_target`` times four reductions). The live and the fixture test of a
group build the same program, so with torch installed the second one hits the
compilation cache.
"""

import contextlib
import functools
import importlib.util
import pathlib
import re
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _references import TOLERANCES

from kldiv_jax import KLDivLoss, kl_div, kl_div_pointwise

_spec = importlib.util.spec_from_file_location(
  "make_torch_fixtures", pathlib.Path(__file__).parent / "fixtures" / "make_torch_fixtures.py"
)
mk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mk)

REDUCTIONS = mk.REDUCTIONS
LEGACY = mk.LEGACY
HALF = mk.HALF
NP_DTYPES = {
  "float16": np.dtype(np.float16),
  "bfloat16": np.dtype(jnp.bfloat16),
  "float32": np.dtype(np.float32),
  "float64": np.dtype(np.float64),
}
TORCH_OWN_EXAMPLE = -3.6624908251428976  # torch's test_kl_div_with_diff_type
DERIVATIVES = ("value", "grad_x", "grad_t")
HESSIANS = ("hess_tt", "hess_xt")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
  """Silences the 'mean' and legacy-argument warnings (checked on their own)."""
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "reduction: 'mean' divides", UserWarning)
    warnings.filterwarnings("ignore", "size_average and reduce args", UserWarning)
    yield


@contextlib.contextmanager
def _record() -> Iterator[list[list[str]]]:
  """Records every warning as a ``[category, message]`` pair."""
  out: list[list[str]] = []
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    yield out
  out.extend([w.category.__name__, str(w.message)] for w in caught)


# -- kldiv_jax's side ------------------------------------------------------------------------


class Spec(NamedTuple):
  """One case's static options (hashable: a static argument of ``jax.jit``)."""

  size_average: bool | None
  reduce: bool | None
  reduction: str
  log_target: bool
  hessian: bool

  @classmethod
  def of(cls, case: dict[str, Any]) -> "Spec":
    return cls(*(case[k] for k in cls._fields))

  @property
  def legacy(self) -> bool:
    return self.size_average is not None or self.reduce is not None


def _vjp(loss, x, t, cot) -> dict[str, jax.Array]:
  """``value`` and the gradients of ``sum(value * cot)`` wrt ``x`` and ``t``."""
  value, pullback = jax.vjp(loss, x, t)
  # For a scalar loss, sum(value * cot) = value * sum(cot).
  ct = cot if value.ndim else jnp.sum(cot)
  grad_x, grad_t = pullback(ct.astype(value.dtype))
  return {"value": value, "grad_x": grad_x, "grad_t": grad_t}


# Small programs, compiled once each: XLA's optimisations cost more time than they save.
@functools.partial(
  jax.jit, static_argnames="specs", compiler_options={"xla_backend_optimization_level": 0}
)
def _evaluate(arrays: Sequence[tuple[jax.Array, ...]], specs: tuple[Spec, ...]) -> list[dict]:
  """kldiv_jax on every case.

  ``kl_div``: value, gradients and, where asked, ``hess_tt``
  (``[t.size, t.size]``) and ``hess_xt`` (``[x.size, t.size]``). Without
  legacy args also the value of ``KLDivLoss`` (the same code path: its
  gradients would only double the compile time) and, for ``'none'``,
  ``kl_div_pointwise``'s value and gradients.
  """
  results = []
  for (x, t, cot), spec in zip(arrays, specs):
    loss = functools.partial(
      kl_div,
      size_average=spec.size_average,
      reduce=spec.reduce,
      reduction=spec.reduction,
      log_target=spec.log_target,
    )
    res = {"kl_div": _vjp(loss, x, t, cot)}
    if spec.hessian:

      def grad_t(x_, t_, loss=loss, cot_=cot):
        return jax.grad(lambda b: jnp.sum(loss(x_, b) * cot_))(t_)

      h_tx, h_tt = jax.jacfwd(grad_t, argnums=(0, 1))(x, t)
      res["kl_div"]["hess_tt"] = h_tt.reshape(t.size, t.size)
      res["kl_div"]["hess_xt"] = h_tx.reshape(t.size, x.size).T
    if not spec.legacy:
      module = KLDivLoss(reduction=spec.reduction, log_target=spec.log_target)
      res["KLDivLoss"] = {"value": module(x, t)}
      if spec.reduction == "none":
        pointwise = functools.partial(kl_div_pointwise, log_target=spec.log_target)
        res["kl_div_pointwise"] = _vjp(pointwise, x, t, cot)
    results.append(res)
  return results


def _ours(
  cases: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]], specs: Sequence[Spec], dtype: str
) -> list[dict[str, dict[str, np.ndarray]]]:
  """``_evaluate`` on NumPy inputs cast to ``dtype``; results in float64 NumPy.

  The JAX dtype of each result is kept under ``"<key>_dtype"``.
  """
  arrays = tuple(tuple(jnp.asarray(a, NP_DTYPES[dtype]) for a in case) for case in cases)
  with _quiet():
    results = _evaluate(arrays, tuple(specs))
  return [
    {
      fn: {
        **{k: np.asarray(v, np.float64) for k, v in res.items()},
        **{f"{k}_dtype": v.dtype for k, v in res.items()},
      }
      for fn, res in case.items()
    }
    for case in results
  ]


def _assert_allclose_strict(actual, desired, rtol: float, atol: float, err_msg: str = "") -> None:
  """``assert_allclose(..., strict=True)`` (NumPy >= 2.0): shapes and dtypes equal, too."""
  actual, desired = np.asarray(actual), np.asarray(desired)
  assert (actual.shape, actual.dtype) == (desired.shape, desired.dtype), err_msg
  np.testing.assert_allclose(actual, desired, rtol=rtol, atol=atol, err_msg=err_msg)


def _assert_close(ours: dict, ref: dict, dtype: str, keys: Sequence[str], what: str) -> None:
  """``ours[k]`` against ``ref[k]`` (rounded to ``dtype`` when half) at ``dtype``'s tolerance."""
  rtol, atol = TOLERANCES[dtype]
  for key in keys:
    expected = np.asarray(ref[key])
    if dtype in HALF:
      expected = expected.astype(NP_DTYPES[dtype])
    _assert_allclose_strict(ours[key], expected.astype(np.float64), rtol, atol, f"{what}: {key}")


def _check_case(ours: dict, ref: dict, spec: Spec, dtype: str, what: str) -> None:
  """Every function ``_evaluate`` ran for the case against torch's ``ref``."""
  keys = DERIVATIVES + (HESSIANS if spec.hessian else ())
  _assert_close(ours["kl_div"], ref, dtype, keys, f"kl_div {what}")
  for fn, res in ours.items():
    keys = [k for k in DERIVATIVES if k in res]
    _assert_close(res, ref, dtype, keys, f"{fn} {what}")
    assert {res[f"{k}_dtype"] for k in keys} == {NP_DTYPES[dtype]}, (fn, what)
  assert ("KLDivLoss" in ours) == (not spec.legacy)
  assert ("kl_div_pointwise" in ours) == (not spec.legacy and spec.reduction == "none")


def _options(spec: Spec) -> dict[str, Any]:
  return {k: getattr(spec, k) for k in ("size_average", "reduce", "reduction", "log_target")}


def _live_group(torch, rng, specs: list[dict], dtype: str, ref_dtype: str) -> None:
  """Draws the group's cases, runs them through torch and kldiv_jax, compares."""
  cases = [mk.case_arrays(rng, s) for s in specs]
  cases = [tuple(a.astype(NP_DTYPES[dtype]).astype(np.float64) for a in c) for c in cases]
  specs_ = [Spec.of(s) for s in specs]
  ours = _ours(cases, specs_, dtype)
  for (x, t, cot), spec, res in zip(cases, specs_, ours):
    ref = mk.torch_kl(x, t, cot, dtype=ref_dtype, hessian=spec.hessian, **_options(spec))
    _check_case(res, ref, spec, dtype, f"{x.shape} vs {t.shape} {_options(spec)}")


# -- the checks, shared by the live tests and their golden twins ----------------------------


def _check_module(rec: dict, x: np.ndarray, t: np.ndarray, what: str) -> None:
  """``KLDivLoss(**options)`` against torch's module record (:func:`mk.module_record`).

  Legacy args become ``reduction`` at construction, as in torch's module.
  """
  opts = {k: rec[k] for k in ("size_average", "reduce", "reduction", "log_target")}
  with _record() as ours_init:
    ours = KLDivLoss(**opts)
  assert ours_init == rec["init_warnings"], what
  assert ours.reduction == rec["resolved"], what
  assert (ours.size_average, ours.reduce, ours.log_target) == (None, None, True)
  with _record() as ours_call:
    value = np.asarray(ours(x, t))
  assert ours_call == rec["call_warnings"], what
  _assert_allclose_strict(value, rec["value"], *TOLERANCES["float64"], what)


def _check_promotion(rec: dict, x: np.ndarray, t: np.ndarray) -> None:
  """Result dtype follows torch's promotion; gradients keep each argument's dtype.

  Values: torch on inputs cast to the promoted dtype (module docstring).
  """
  x_dtype, t_dtype, out_dtype = rec["x_dtype"], rec["t_dtype"], rec["out_dtype"]
  assert (rec["grad_x_dtype"], rec["grad_t_dtype"]) == (x_dtype, t_dtype)
  value, (gx, gt) = jax.value_and_grad(functools.partial(kl_div, reduction="sum"), argnums=(0, 1))(
    jnp.asarray(x, NP_DTYPES[x_dtype]), jnp.asarray(t, NP_DTYPES[t_dtype])
  )
  assert value.dtype == NP_DTYPES[out_dtype]
  assert (gx.dtype, gt.dtype) == (NP_DTYPES[x_dtype], NP_DTYPES[t_dtype])
  np.testing.assert_allclose(np.float64(value), rec["value"], *TOLERANCES[out_dtype])
  for ours, key, dtype in ((gx, "grad_x", x_dtype), (gt, "grad_t", t_dtype)):
    _assert_close({key: np.asarray(ours, np.float64)}, rec, dtype, (key,), f"{x_dtype}+{t_dtype}")


def _check_own_example(rec: dict) -> None:
  """torch's ``test_kl_div_with_diff_type``: every dtype pair gives -3.66249 (atol 1e-3).

  Beyond that atol, the reference is torch on inputs cast to the result dtype
  (torch's own mixed-dtype value carries the target dtype's rounding).
  """
  x_dtype, t_dtype, out_dtype = rec["x_dtype"], rec["t_dtype"], rec["out_dtype"]
  with pytest.warns(UserWarning, match="reduction: 'mean'"):
    ours = kl_div(
      jnp.asarray(mk.OWN_X, NP_DTYPES[x_dtype]), jnp.asarray(mk.OWN_T, NP_DTYPES[t_dtype])
    )
  assert ours.dtype == NP_DTYPES[out_dtype]
  np.testing.assert_allclose(rec["value"], TORCH_OWN_EXAMPLE, rtol=0, atol=1e-3)
  np.testing.assert_allclose(np.float64(ours), TORCH_OWN_EXAMPLE, rtol=0, atol=1e-3)
  ref = {"value": rec["ref_value"]}
  _assert_close({"value": np.float64(ours)}, ref, out_dtype, ("value",), f"{x_dtype}+{t_dtype}")


def _check_errors(records: list[dict]) -> None:
  """Bad calls: torch's exception and ours.

  Shapes that do not broadcast: torch raises RuntimeError, kldiv_jax ValueError
  (naming both shapes, at trace time; a deliberate difference). An invalid
  reduction: ValueError from both, ours naming the value.
  """
  assert [r["what"] for r in records] == ["shapes", *["reduction"] * len(mk.BAD_REDUCTIONS)]
  for rec in records:
    x, t = jnp.zeros(rec["x_shape"]), jnp.zeros(rec["t_shape"])
    if rec["what"] == "shapes":
      assert rec["error"] == "RuntimeError", rec
      with pytest.raises(ValueError, match=r"\(3, 5\).*\(5, 3\)"):
        kl_div(x, t, reduction=rec["reduction"])
    else:
      assert rec["error"] == "ValueError", rec
      assert rec["message"] == f"{rec['reduction']} is not a valid value for reduction", rec
      with pytest.raises(ValueError, match=re.escape(repr(rec["reduction"]))):
        kl_div(x, t, reduction=rec["reduction"])


# (log_target, point) -> torch's non-finite results at the zero-mass entry (mk.ZERO_MASS).
# kldiv_jax gives value 0 and zero first and second derivatives there.
TORCH_NONFINITE = {
  (False, 0): ("grad_t", "hess_tt"),  # x = -1, t = 0
  (False, 1): ("value", "grad_t", "hess_tt"),  # x = -inf, t = 0
  (True, 0): ("value", "grad_t", "hess_tt"),  # x = -1, t = -inf
  (True, 1): ("value", "grad_t", "hess_tt"),  # x = -inf, t = -inf
}


def _check_differences(cases: list, specs: list[dict], refs: list[dict]) -> None:
  """Zero-mass targets: our convention (0, zero derivatives), where torch is NaN/inf.

  Each case pairs the zero-mass entry with an interior one, where we still
  equal torch (value, gradients, second derivatives); torch's value at the
  interior entry alone is its ``'none'`` value there.
  """
  ours_all = _ours(cases, [Spec.of(s) for s in specs], "float64")
  alone = {
    (s["log_target"], s["point"]): ref["value"][1]
    for s, ref in zip(specs, refs)
    if s["reduction"] == "none"
  }
  assert len(alone) == len({(s["log_target"], s["point"]) for s in specs})
  for (x, t, _), spec, ref, res in zip(cases, specs, refs, ours_all):
    log_target, reduction = spec["log_target"], spec["reduction"]
    what = f"x={x}, t={t}, {reduction}"
    res = res["kl_div"]
    for key in DERIVATIVES + HESSIANS:
      assert np.all(np.isfinite(res[key])), (key, what)
    for key in TORCH_NONFINITE[log_target, spec["point"]]:
      assert not np.isfinite(ref[key].flat[0]), f"torch is now finite: {key}={ref[key]}, {what}"
    # Our convention at the zero-mass entry (index 0).
    assert res["grad_x"][0] == res["grad_t"][0] == 0.0, what
    np.testing.assert_array_equal(res["hess_tt"][0], 0.0, err_msg=what)
    np.testing.assert_array_equal(res["hess_tt"][:, 0], 0.0, err_msg=what)
    # The mixed partial d2/dxdt stays torch's (-s with probability targets,
    # where d/dx = -t; exp(t) = 0 with log targets), keeping the Hessian
    # symmetric although d/dt is pinned to 0 at zero mass.
    mixed = 0.0 if log_target else ref["hess_xt"][:, 0]
    np.testing.assert_array_equal(res["hess_xt"][:, 0], mixed, err_msg=what)
    # torch's values at the interior entry (index 1).
    interior = {k: ref[k][1:] for k in ("grad_x", "grad_t")} | {"hess": ref["hess_tt"][1:, 1:]}
    mine = {k: res[k][1:] for k in ("grad_x", "grad_t")} | {"hess": res["hess_tt"][1:, 1:]}
    _assert_close(mine, interior, "float64", ("grad_x", "grad_t", "hess"), what)
    one = alone[log_target, spec["point"]]
    expected = {"none": np.array([0.0, one]), "sum": one, "batchmean": one / 2}[reduction]
    _assert_close(res, {"value": expected}, "float64", ("value",), what)


# -- live parity: the shape matrix -----------------------------------------------------------


@pytest.mark.torch
@pytest.mark.parametrize("shapes", mk.SHAPE_PAIRS, ids=str)
def test_live_float64(x64, torch, rng, shapes):
  """0-d, 1-D, 2-D, 4-D, empty and broadcast shapes; 4 reductions; both log_target."""
  _live_group(torch, rng, mk.group_specs(*shapes, "float64"), "float64", "float64")


@pytest.mark.torch
@pytest.mark.parametrize("shapes", mk.DTYPE_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", ["float32", *HALF])
def test_live_dtypes(torch, rng, dtype, shapes):
  # Half inputs: torch in float32 on the half-rounded inputs, rounded (module docstring).
  specs = mk.group_specs(*shapes, dtype)
  _live_group(torch, rng, specs, dtype, specs[0]["ref_dtype"])
  x, t, cot = mk.sample(rng, *shapes, False)
  assert mk.torch_kl(x, t, cot, dtype=dtype, reduction="sum")["out_dtype"] == dtype


@pytest.mark.torch
def test_live_nonfinite_where_torch_agrees(x64, torch, rng):
  """-inf input with a positive target gives +inf (gradient too); NaN stays NaN."""
  _live_group(torch, rng, mk.edge_specs(), "float64", "float64")


# -- live parity: legacy arguments and warnings ----------------------------------------------


@pytest.mark.torch
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("reduce", LEGACY)
@pytest.mark.parametrize("size_average", LEGACY)
def test_live_legacy_args(x64, torch, rng, size_average, reduce, reduction):
  """Eager ``kl_div``: value and warnings (category and text) equal torch's.

  ``'batchmean'`` still divides by ``input.shape[0]`` (3, not the 2 of the
  target) after the legacy args.
  """
  import torch.nn.functional as F

  x, t, _ = mk.sample(rng, (3, 2), (2,), False)
  opts = dict(size_average=size_average, reduce=reduce, reduction=reduction)
  with _record() as theirs:
    expected = F.kl_div(torch.tensor(x), torch.tensor(t), **opts).numpy()
  with _record() as ours:
    value = np.asarray(kl_div(x, t, **opts))
  assert ours == theirs
  assert len(theirs) == int(reduction == "mean" or size_average is not None or reduce is not None)
  _assert_allclose_strict(value, expected, *TOLERANCES["float64"])


@pytest.mark.torch
@pytest.mark.parametrize(
  "options", mk.module_options(), ids=lambda o: "{size_average}-{reduce}-{reduction}".format(**o)
)
def test_live_module_legacy(x64, torch, rng, options):
  x, t, _ = mk.sample(rng, (3, 2), (3, 2), True)
  rec = mk.module_record(x, t, **options)
  _check_module({**options, **rec}, x, t, str(options))


@pytest.mark.torch
def test_live_module_legacy_drops_batchmean(torch):
  with _record():
    theirs = torch.nn.KLDivLoss(size_average=False, reduction="batchmean")
    ours = KLDivLoss(size_average=False, reduction="batchmean")
  assert ours.reduction == theirs.reduction == "sum"


@pytest.mark.torch
def test_live_mean_warning(torch):
  """Default 'mean' warns torch's UserWarning, word for word; the others don't warn."""
  import torch.nn.functional as F

  x, t = jnp.zeros((2, 3)), jnp.full((2, 3), 0.5)
  with pytest.warns(UserWarning) as theirs:
    F.kl_div(torch.zeros(2, 3), torch.full((2, 3), 0.5))
  with pytest.warns(UserWarning) as ours:
    kl_div(x, t)
  with pytest.warns(UserWarning) as ours_module:
    KLDivLoss()(x, t)
  assert len(theirs) == len(ours) == len(ours_module) == 1
  assert str(ours[0].message) == str(ours_module[0].message) == str(theirs[0].message)
  assert "'batchmean' divides only by the batch size" in str(ours[0].message)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for reduction in ("none", "sum", "batchmean"):
      kl_div(x, t, reduction=reduction)
      F.kl_div(torch.zeros(2, 3), torch.full((2, 3), 0.5), reduction=reduction)


@pytest.mark.torch
def test_live_bad_options_raise_like_torch(torch):
  _check_errors(mk.error_records())


# -- live parity: type promotion -------------------------------------------------------------


@pytest.mark.torch
@pytest.mark.parametrize(("x_dtype", "t_dtype"), mk.PROMOTIONS)
def test_live_mixed_dtypes(x64, torch, rng, x_dtype, t_dtype):
  x, t = mk.promotion_inputs(rng, x_dtype, t_dtype)
  rec = mk.promotion_record(x, t, x_dtype, t_dtype)
  _check_promotion({"x_dtype": x_dtype, "t_dtype": t_dtype, **rec}, x, t)


@pytest.mark.torch
@pytest.mark.parametrize("t_dtype", mk.OWN_DTYPES)
@pytest.mark.parametrize("x_dtype", mk.OWN_DTYPES)
def test_live_torch_own_example(x64, torch, x_dtype, t_dtype):
  rec = mk.own_example_record(x_dtype, t_dtype)
  _check_own_example({"x_dtype": x_dtype, "t_dtype": t_dtype, **rec})


# -- live: where torch is not finite ---------------------------------------------------------


@pytest.mark.torch
@pytest.mark.parametrize("log_target", [False, True])
def test_live_deliberate_differences(x64, torch, log_target):
  specs = [s for s in mk.difference_specs() if s["log_target"] == log_target]
  cases = [mk.difference_arrays(s) for s in specs]
  refs = [
    mk.torch_kl(x, t, cot, hessian=True, **_options(Spec.of(s)))
    for (x, t, cot), s in zip(cases, specs)
  ]
  _check_differences(cases, specs, refs)


# -- golden fixtures (no torch needed) -------------------------------------------------------

META, ARRAYS = mk.load()
GROUPS: dict[str, list[dict]] = {}
for _case in META["cases"]:
  GROUPS.setdefault(_case["group"], []).append(_case)
DIFFERENCES = GROUPS.pop("differences")


def _case_arrays(case: dict, keys: Sequence[str]) -> tuple[np.ndarray, ...]:
  return tuple(ARRAYS[f"{case['id']}.{k}"] for k in keys)


@pytest.mark.parametrize("group", list(GROUPS))
def test_fixture(request, group):
  """kldiv_jax against torch's stored values, gradients, second derivatives and result dtype."""
  cases = GROUPS[group]
  dtype = cases[0]["dtype"]
  if dtype == "float64":
    request.getfixturevalue("x64")
  arrays = [_case_arrays(c, ("x", "t", "cot")) for c in cases]
  for c, (x, t, _) in zip(cases, arrays):
    assert (list(x.shape), list(t.shape)) == (c["x_shape"], c["t_shape"]), c["id"]
  specs = [Spec.of(c) for c in cases]
  ours = _ours(arrays, specs, dtype)
  for case, spec, res in zip(cases, specs, ours):
    ref = {
      k: ARRAYS[f"{case['id']}.{k}"]
      for k in DERIVATIVES + HESSIANS
      if f"{case['id']}.{k}" in ARRAYS
    }
    _check_case(res, ref, spec, dtype, f"{case['id']} {_options(spec)}")
    assert res["kl_div"]["value_dtype"] == NP_DTYPES[case["out_dtype"]], case["id"]


@pytest.mark.parametrize("group", ["float64 (3,) vs (2, 3)", "legacy", "legacy (3, 2) vs (2,)"])
def test_fixture_warnings(x64, group):
  """kl_div (and KLDivLoss's call) emit the warnings torch emitted (text and category)."""
  for case in GROUPS[group]:
    x, t = _case_arrays(case, ("x", "t"))
    spec = Spec.of(case)
    with _record() as warned:
      jax.eval_shape(functools.partial(kl_div, **_options(spec)), x, t)
    assert warned == case["warnings"], case["id"]
    if not spec.legacy:
      with _record() as warned:
        jax.eval_shape(KLDivLoss(reduction=spec.reduction, log_target=spec.log_target), x, t)
      assert warned == case["warnings"], case["id"]
  if group == "float64 (3,) vs (2, 3)":  # 'mean' warns, the others don't
    for case in GROUPS[group]:
      if case["reduction"] == "mean":
        ((category, message),) = case["warnings"]
        assert category == "UserWarning"
        assert "'batchmean' divides only by the batch size" in message
      else:
        assert case["warnings"] == []


def test_fixture_modules(x64):
  assert len(META["modules"]) == len(mk.module_options())
  for rec in META["modules"]:
    x, t, value = _case_arrays(rec, ("x", "t", "value"))
    _check_module({**rec, "value": value}, x, t, rec["id"])
  drops = [r for r in META["modules"] if r["size_average"] is False and r["reduce"] is None]
  assert {r["reduction"]: r["resolved"] for r in drops}["batchmean"] == "sum"


@pytest.mark.parametrize("rec", META["promotions"], ids=lambda r: f"{r['x_dtype']}+{r['t_dtype']}")
def test_fixture_promotions(x64, rec):
  x, t, *values = _case_arrays(rec, ("x", "t", "value", "grad_x", "grad_t"))
  _check_promotion({**rec, **dict(zip(DERIVATIVES, values))}, x, t)


def test_fixture_own_example(x64):
  assert len(META["own_example"]) == len(mk.OWN_DTYPES) ** 2
  for rec in META["own_example"]:
    _check_own_example(rec)


def test_fixture_errors():
  _check_errors(META["errors"])


def test_fixture_deliberate_differences(x64):
  cases = [_case_arrays(c, ("x", "t", "cot")) for c in DIFFERENCES]
  refs = [{k: ARRAYS[f"{c['id']}.{k}"] for k in DERIVATIVES + HESSIANS} for c in DIFFERENCES]
  _check_differences(cases, DIFFERENCES, refs)


def test_fixture_files_small_and_complete():
  npz, js = mk.NPZ_PATH.stat().st_size, mk.JSON_PATH.stat().st_size
  assert npz + js < 400_000, (npz, js)
  ids = [c["id"] for c in META["cases"]]
  assert len(set(ids)) == len(ids) > 200
  expected = {f"{c['id']}.{k}" for c in META["cases"] for k in mk.ARRAY_KEYS[:6]}
  expected |= {f"{c['id']}.{k}" for c in META["cases"] if c["hessian"] for k in HESSIANS}
  expected |= {f"{r['id']}.{k}" for r in META["modules"] for k in ("x", "t", "value")}
  expected |= {f"{r['id']}.{k}" for r in META["promotions"] for k in ("x", "t", *DERIVATIVES)}
  assert set(ARRAYS) == expected
  assert sum(c["hessian"] for c in META["cases"]) >= 32
  assert {c["dtype"] for c in META["cases"]} == set(NP_DTYPES)


@pytest.mark.torch
def test_fixture_file_up_to_date(torch):
  """Regenerating with the installed torch gives the stored records (within tolerance)."""
  records, arrays = mk.make()
  mk.pack(records, arrays)  # adds each record's layout
  assert records == {k: v for k, v in META.items() if k not in ("torch_version", "seed")}
  assert set(arrays) == set(ARRAYS)
  dtypes = {c["id"]: c["dtype"] for c in META["cases"]}
  for name in arrays:
    rtol, atol = TOLERANCES[dtypes.get(name.split(".")[0], "float64")]
    _assert_allclose_strict(arrays[name], ARRAYS[name], rtol, atol, name)
