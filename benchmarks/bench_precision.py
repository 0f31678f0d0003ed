"""Precision benchmark: values and gradients of every divergence on bf16 logits against float64.

The contract measured and its derivation (data, the bounds ``eps_f32 * S`` on the value and
``eps * kappa`` on the gradient, the ``step`` case) are on the Precision docs page
(``docs/precision.md``). The references are float64 NumPy from the same bf16 values
(``tests/_references.py``); each case is measured on the bf16 inputs and on the same values
cast to float32, values and gradients from one jitted ``jax.vjp``. Also: identical logits at
``V = 248320``, ``distillation_loss``, ``fused_distillation_loss``, ``kl_div_from_logits``,
``generalized_jsd``, ``kl_div_from_topk`` at ``k = V``, the straightforward bf16 forward KL and
the fused losses' ``logits_dtype`` (bf16 chunk logits or float32) on Liger Kernel's fused-linear
JSD bf16 test and on ordinary logits.

  python benchmarks/bench_precision.py            # V = 131072 (about 3 minutes on 2 cores)
  python benchmarks/bench_precision.py --quick    # V = 16384, 4 rows: a smoke test
"""

import argparse
import contextlib
import json
import math
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _harness import describe_machine, machine_info, parser, print_table, save, write_json
from _references import (
  np_divergence_terms,
  np_divergence_value_and_grads,
  np_log_softmax,
  np_topk_log_probs,
  platform_branch,
  tpu_kernel,
)
from bench_divergences import NAMES, per_token

import kldiv_jax as kd
from kldiv_jax._class_sums import Needs
from kldiv_jax._whole_rows import takes_whole_rows

EPS32 = float(np.finfo(np.float32).eps)  # 2**-23
U_BF16 = 2.0**-8  # bf16's unit roundoff: round-to-nearest error bound, relative
VOCAB, QUICK_VOCAB, EASYDEL_VOCAB = 131072, 16384, 248320
# The divergences and their parameters (alpha-beta has no defaults).
SPECS = {n: kd.Divergence(n) for n in NAMES} | {
  "alpha_beta": kd.Divergence("alpha_beta", alpha=0.5, beta=0.5)
}


# ------------------------------------------------------------------ float64 errors


def gradient_condition(z, y, temperature: float, grad) -> float:
  """``(||p log p|| + ||q log q||) / (T ||grad||)``: how far the gradient sits below the
  rounding of the probabilities it is made of.

  A float32 log-probability carries an absolute error of about ``eps |log p|``, so
  ``p`` and ``q`` an error of ``eps p |log p|``; the gradient, a difference of such
  terms over ``T``, is then accurate to about ``eps`` times this ratio, relatively.
  It grows without bound as ``q -> p`` (and the gradient -> 0).
  """
  lq = np_log_softmax(np.asarray(z, np.float64) / temperature)
  lp = np_log_softmax(np.asarray(y, np.float64) / temperature)
  size = np.linalg.norm(np.exp(lp) * lp) + np.linalg.norm(np.exp(lq) * lq)
  return float(size / (temperature * np.linalg.norm(grad)))


def grad_errors(got, want) -> dict[str, float]:
  """Norm-wise and elementwise relative errors (0 where the reference is 0 and so is got)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  diff = got - want
  norm, peak = np.linalg.norm(want), np.max(np.abs(want))
  return {
    "rel_norm": float(np.linalg.norm(diff) / norm) if norm else float(np.linalg.norm(diff)),
    "rel_max": float(np.max(np.abs(diff)) / peak) if peak else float(np.max(np.abs(diff))),
  }


def as64(x) -> np.ndarray:
  return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


# ------------------------------------------------------------------ data


def make_logits(rows: int, vocab: int, std: float, seed: int):
  """``(base, noise)`` in float64: the logits before bf16 rounding and the perturbation."""
  rng = np.random.default_rng(seed)
  return rng.normal(size=(rows, vocab)) * std, rng.normal(size=(rows, vocab))


STEP = "step"  # the closest non-identical pair: one class per row one bf16 step apart


def pair(base, noise, delta: float | str):
  """bf16 ``(student, teacher)``: ``bf16(base + delta * noise)`` and ``bf16(base)``.

  ``delta = STEP``: the student is the teacher with one class per row (picked at
  random, so almost surely one of low probability) moved one bf16 step away from
  zero: the true divergence is far below float32 rounding.
  """
  teacher = jnp.asarray(base, jnp.bfloat16)
  if delta == 0:
    return teacher, teacher
  if delta == STEP:
    bits = np.asarray(teacher).view(np.uint16).copy()
    cls = np.random.default_rng(len(base)).integers(0, bits.shape[-1], size=bits.shape[0])
    bits[np.arange(bits.shape[0]), cls] += 1
    return jnp.asarray(bits.view(teacher.dtype)), teacher
  return jnp.asarray(base + float(delta) * noise, jnp.bfloat16), teacher


def fmt_delta(delta: float | str) -> str:
  return delta if isinstance(delta, str) else f"{delta:g}"


# ------------------------------------------------------------------ measurements


def value_and_grads(fn: Callable[..., Any]) -> Callable[..., Any]:
  """``jit`` of ``(values, gradients of their sum wrt every argument)``, as a training step
  computes them: one program, the value from the same program as the gradients."""

  def both(*args):
    value, pullback = jax.vjp(fn, *args)
    return value, pullback(jnp.ones_like(value))

  return jax.jit(both)


def measure(vg, inputs, ref_value, ref_grads, entropy, grad_names) -> dict[str, Any]:
  """Errors of ``vg`` (from :func:`value_and_grads`) on bf16 ``inputs`` and on the same
  values in float32, against the float64 ``ref_value`` and ``ref_grads``.

  ``entropy`` is ``H(p) + H(q)`` per value (``T^2`` times it for a ``T^2``-scaled
  loss), for the value's error in units of ``eps_f32 * S``.
  """
  vocab = inputs[0].shape[-1] if len(inputs) == 2 else inputs[1].shape[-1]
  v_bf16, g_bf16 = vg(*inputs)
  v_f32, g_f32 = vg(*(x.astype(jnp.float32) for x in inputs))
  vb, vf, ref = as64(v_bf16), as64(v_f32), np.asarray(ref_value, np.float64)
  identical = all(np.array_equal(as64(inputs[0]), as64(x)) for x in inputs[-1:])
  err = np.abs(vf - ref)
  record: dict[str, Any] = {
    "identical": identical,
    "ref_min": float(np.min(ref)),
    "ref_max": float(np.max(ref)),
    "min_value_bf16": float(np.min(vb)),
    "min_value_f32": float(np.min(vf)),
    "bf16_is_f32_rounded": bool(
      np.array_equal(np.asarray(v_bf16), np.asarray(v_f32.astype(jnp.bfloat16)))
    ),
    "exact_zero": identical and not np.any(vf) and not np.any(vb),
    "zero_gradients": identical and not any(np.any(as64(g)) for g in (*g_bf16, *g_f32)),
    "value_abs_err": float(np.max(err)),
    "value_rel_err": 0.0 if identical else float(np.max(err / ref)),
    "value_err_over_eps_s": float(np.max(err / (EPS32 * (entropy + math.log2(vocab))))),
    "value_abs_err_bf16": float(np.max(np.abs(vb - ref))),
  }
  for name, gb, gf, gref in zip(grad_names, g_bf16, g_f32, ref_grads):
    if gref is not None:
      record[f"grad_{name}_bf16"] = None if identical else grad_errors(gb, gref)
      record[f"grad_{name}_f32"] = None if identical else grad_errors(gf, gref)
  return record


def sweep(fn, base, noise, deltas, temperatures, step: bool = True):
  """``(temperature, delta, student, teacher, vg)`` per temperature and delta (0, ``deltas``
  and, with ``step``, :data:`STEP`): :func:`pair`'s inputs and :func:`value_and_grads` of
  ``fn(..., temperature=temperature)``."""
  for temperature in temperatures:
    vg = value_and_grads(partial(fn, temperature=temperature))
    for delta in (0.0, *deltas, STEP)[: None if step else -1]:
      yield temperature, delta, *pair(base, noise, delta), vg


def reference(name: str, params, s, t, temperature: float):
  """The float64 value, gradients and entropies of divergence ``name`` at bf16 ``s``, ``t``."""
  return np_divergence_value_and_grads(name, dict(params), as64(s), as64(t), temperature)


def case(function: str, name: str, params, temperature: float, delta, s, t) -> dict[str, Any]:
  return {"function": function, "divergence": name, "params": dict(params)} | {
    "temperature": temperature,
    "delta": delta,
    "classes_differing": float(np.mean(as64(s) != as64(t))),
  }


SIDES = ("student", "teacher")


def divergence_records(base, noise, deltas, temperatures, log) -> list[dict[str, Any]]:
  """Every divergence of ``divergence_from_logits``, per row, gradients wrt both sides."""
  records = []
  for name, spec in SPECS.items():
    start = time.perf_counter()
    fn = partial(kd.divergence_from_logits, divergence=spec)
    for temperature, delta, s, t, vg in sweep(fn, base, noise, deltas, temperatures):
      v, gz, gy, hp, hq = reference(name, spec.params, s, t, temperature)
      record = case("divergence_from_logits", name, spec.params, temperature, delta, s, t)
      record |= measure(vg, (s, t), v, (gz, gy), hp + hq, SIDES)
      if not record["identical"]:
        for side, grad in zip(SIDES, (gz, gy)):
          cond = gradient_condition(as64(s), as64(t), temperature, grad)
          error = record[f"grad_{side}_f32"]["rel_norm"]
          record[f"grad_{side}_condition"] = cond
          record[f"grad_{side}_f32_over_eps_cond"] = error / (EPS32 * cond)
          record[f"grad_{side}_norm_ref"] = float(np.linalg.norm(grad))
      records.append(record)
    log(f"  {name}: {time.perf_counter() - start:.1f} s")
  return records


def distillation_records(base, noise, deltas, temperatures) -> list[dict[str, Any]]:
  """``distillation_loss``, forward KL, no labels: ``T^2`` times the mean of ``D`` over rows."""
  records, rows = [], base.shape[0]
  cases = sweep(kd.distillation_loss, base, noise, deltas, temperatures)
  for temperature, delta, s, t, vg in cases:
    t2 = temperature**2
    v, gz, gy, hp, hq = reference("forward_kl", {}, s, t, temperature)
    ref_grads = (gz * t2 / rows, gy * t2 / rows)
    record = case("distillation_loss", "forward_kl", {}, temperature, delta, s, t)
    records.append(
      record | measure(vg, (s, t), t2 * np.mean(v), ref_grads, t2 * np.max(hp + hq), SIDES)
    )
  return records


def fused_records(rows, vocab, hidden, std, deltas, temperatures, seed) -> list[dict[str, Any]]:
  """``fused_distillation_loss`` (forward KL): bf16 hidden states and one bf16 head for both sides.

  The teacher's hidden states are ``bf16(h)``, the student's ``bf16(h + delta *
  noise)``; ``h ~ N(0, 1)``, the head ``W ~ N(0, std^2 / H)`` so that the logits
  have about ``std``'s spread. The reference is float64 from the same bf16
  values: logits ``h W``, value ``T^2 mean D``, gradients ``T^2 / rows ((q - p) /
  T) W^T`` wrt the hidden states and ``h^T`` times the same wrt the head.
  """
  rng = np.random.default_rng(seed + 1)
  h = rng.normal(size=(rows, hidden))
  noise = rng.normal(size=(rows, hidden))
  w = jnp.asarray(rng.normal(size=(hidden, vocab)) * std / math.sqrt(hidden), jnp.bfloat16)
  w64 = as64(w)

  def fused(hs, w, ht, temperature):
    return kd.fused_distillation_loss(hs, w, ht, w, temperature=temperature)

  records = []
  for temperature, delta, hs, ht, vg in sweep(fused, h, noise, deltas, temperatures, step=False):
    t2, hs64 = temperature**2, as64(hs)
    v, gz, _, hp, hq = np_divergence_value_and_grads(
      "forward_kl", {}, hs64 @ w64, as64(ht) @ w64, temperature
    )
    dz = gz * t2 / rows
    ref_grads, sides = (dz @ w64.T, hs64.T @ dz, None), ("hidden", "weight", "")
    record = {"function": "fused_distillation_loss", "divergence": "forward_kl", "params": {}}
    record |= {"hidden": hidden, "temperature": temperature, "delta": delta}
    records.append(
      record | measure(vg, (hs, w, ht), t2 * np.mean(v), ref_grads, t2 * np.max(hp + hq), sides)
    )
  return records


def logits_dtype_records(seed: int, quick: bool) -> list[dict[str, Any]]:
  """The fused losses' ``logits_dtype`` on bf16 inputs: the default (bf16 chunk logits and
  gradient) and ``jnp.float32``, against float64 from the same bf16 values.

  Two setups: Liger Kernel's fused-linear JSD bf16 test (``test_fused_linear_jsd.py``: inputs
  and heads drawn from ``U[0, 1)``, the student's hidden size 512 and the teacher's 1024,
  V = 4096, so logits near 128 and 256 where bf16's step is 1 and 2), and ordinary logits
  (``N(0, 1)`` hidden states, heads ``N(0, 4^2 / H)``, H = 512 for both sides). Per setup:
  ``fused_distillation_loss`` (JSD, beta 0.5, the mean over tokens) and
  ``fused_token_log_probs`` (the sum of the sampled tokens' log-probabilities; the engine of
  ``fused_policy_loss`` too), errors of the value and of the gradients wrt the student's
  hidden states and head: norm-wise, and the share of entries off by more than 5%.
  """
  rows, hidden, vocab = (64, 512, 2048) if quick else (256, 512, 4096)
  rng = np.random.default_rng(seed + 2)
  bf16 = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
  setups = {
    "Liger JSD test (U[0, 1), logits ~128)": lambda shape, scale: rng.random(shape),
    "ordinary (N(0, 1) hidden, logit std 4)": lambda shape, scale: rng.normal(size=shape) * scale,
  }
  jsd = {"beta": 0.5}

  def distill(h, w, th, tw, logits_dtype):
    return kd.fused_distillation_loss(h, w, th, tw, divergence="jsd", logits_dtype=logits_dtype)

  def tokens(h, w, ids, logits_dtype):
    lp = kd.fused_token_log_probs(h, w, ids, logits_dtype=logits_dtype)
    return jnp.sum(lp.astype(jnp.float32))

  def off(got, want):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    return float(np.mean(np.abs(got - want) > 0.05 * np.abs(want)))

  records = []
  for setup, draw in setups.items():
    h = bf16(draw((rows, hidden), 1.0))
    w = bf16(draw((hidden, vocab), 4 / math.sqrt(hidden)))
    th = bf16(draw((rows, 2 * hidden), 1.0))
    tw = bf16(draw((2 * hidden, vocab), 4 / math.sqrt(2 * hidden)))
    ids = jnp.asarray(rng.integers(0, vocab, size=rows))
    h64, w64 = as64(h), as64(w)
    z = h64 @ w64
    v, gz, _, _, _ = np_divergence_value_and_grads("jsd", jsd, z, as64(th) @ as64(tw), 1.0)
    dz = gz / rows
    lq = np_log_softmax(z)
    hit = np.zeros_like(lq)
    hit[np.arange(rows), np.asarray(ids)] = 1.0
    # (loss, its other arguments, float64 value, gradients wrt h and w)
    cases = {
      "fused_distillation_loss (JSD)": (distill, (th, tw), np.mean(v), (dz @ w64.T, h64.T @ dz)),
      "fused_token_log_probs": (
        tokens, (ids,), np.sum(lq[np.arange(rows), np.asarray(ids)]),
        ((hit - np.exp(lq)) @ w64.T, h64.T @ (hit - np.exp(lq))),
      ),
    }  # fmt: skip
    for function, (fn, args, want, want_grads) in cases.items():
      for logits_dtype in (None, "float32"):
        vg = jax.jit(jax.value_and_grad(partial(fn, logits_dtype=logits_dtype), (0, 1)))
        value, grads = vg(h, w, *args)
        record = {"setup": setup, "function": function, "logits_dtype": logits_dtype or "default"}
        record |= {"rows": rows, "hidden": hidden, "vocab": vocab, "logit_mean": float(z.mean())}
        record["value_rel_err"] = float(abs(as64(value) - want) / abs(want))
        for side, g, r in zip(("hidden", "weight"), grads, want_grads):
          record[f"grad_{side}"] = grad_errors(as64(g), r)["rel_norm"]
          record[f"grad_{side}_off_5pct"] = off(g, r)
        records.append(record)
  return records


def print_logits_dtype(records: list[dict[str, Any]]) -> None:
  print("\nThe fused losses' logits_dtype on bf16 inputs (float64 reference from the same values;")
  print("gradient errors norm-wise, and the share of entries off by more than 5%):")
  columns = [("setup", "40"), ("function", "30"), ("logits", "8"), ("value", ">8.1e")]
  columns += [("d hidden", ">8.1e"), ("> 5%", ">6.1%"), ("d weight", ">8.1e"), ("> 5%", ">6.1%")]
  keys = ("value_rel_err", "grad_hidden", "grad_hidden_off_5pct", "grad_weight")
  rows = [
    [r["setup"], r["function"], r["logits_dtype"], *(r[k] for k in keys), r["grad_weight_off_5pct"]]
    for r in records
  ]
  print_table(columns, rows)


def naive_forward_kl(s, t, temperature=1.0):
  """Forward KL as often written: ``log_softmax`` of both sides and the sum, in the inputs' dtype."""
  lq = jax.nn.log_softmax(s / temperature, axis=-1)
  lp = jax.nn.log_softmax(t / temperature, axis=-1)
  return jnp.sum(jnp.exp(lp) * (lp - lq), axis=-1)


def topk_full(s, t, temperature):
  """``kl_div_from_topk`` with ``k = V``: the teacher's float32 log-softmax of ``t`` (as a
  distillation dataset stores it), every class, in descending order."""
  t = jax.lax.stop_gradient(t.astype(jnp.float32))
  order = jnp.argsort(-t, axis=-1)
  log_probs = jnp.take_along_axis(jax.nn.log_softmax(t, axis=-1), order, axis=-1)
  return kd.kl_div_from_topk(s, order, log_probs, temperature=temperature)


# The entry points of :func:`identical_checks`, each ``f(s, t, temperature=T)``.
ENTRY_POINTS = {
  f"divergence_from_logits[{name}]": partial(kd.divergence_from_logits, divergence=spec)
  for name, spec in SPECS.items()
} | {
  "kl_div_from_logits": kd.kl_div_from_logits,
  "generalized_jsd": kd.generalized_jsd,
  "distillation_loss": kd.distillation_loss,
  "kl_div_from_topk[k=V]": topk_full,
  "straightforward forward KL": naive_forward_kl,
}


def identical_checks(rows, vocab, std, seed, names) -> list[dict[str, Any]]:
  """Identical logits (bf16 and float32, T = 1 and 2) through the entry points ``names``."""
  base = np.random.default_rng(seed + 2).normal(size=(rows, vocab)) * std
  out = []
  for dtype in (jnp.bfloat16, jnp.float32):
    x = jnp.asarray(base, dtype)
    for temperature in (1.0, 2.0):
      for name in names:
        value, grads = value_and_grads(partial(ENTRY_POINTS[name], temperature=temperature))(x, x)
        out.append(
          {"function": name, "vocab": vocab, "dtype": jnp.dtype(dtype).name}
          | {"temperature": temperature, "max_abs_value": float(np.max(np.abs(as64(value))))}
          | {"min_value": float(np.min(as64(value)))}
          | {"max_abs_grad": float(max(np.max(np.abs(as64(g))) for g in grads))}
        )
  return out


def straightforward_records(base, noise, deltas, temperatures) -> list[dict[str, Any]]:
  """For contrast: :func:`naive_forward_kl` on the bf16 logits (computed in bf16), jitted."""
  out = []
  for temperature, delta, s, t, vg in sweep(naive_forward_kl, base, noise, deltas, temperatures):
    v_ref, gz_ref, *_ = reference("forward_kl", {}, s, t, temperature)
    value, (gz, _) = vg(s, t)
    out.append(
      {"function": "straightforward bf16 forward KL", "temperature": temperature, "delta": delta}
      | {"min_value": float(np.min(as64(value)))}
      | {"max_abs_value_err": float(np.max(np.abs(as64(value) - v_ref)))}
      | {"grad_student": grad_errors(gz, gz_ref) if delta else None}
      | {"max_abs_grad": float(np.max(np.abs(as64(gz))))}
    )
  return out


# ------------------------------------------------------------------ the vocabulary sweep

SWEEP_VOCABS = (2**13, 2**16, 2**17, 2**18, 2**20)
QUICK_SWEEP_VOCABS = (2**13, 2**17)
SWEEP_SCALES = (1.0, 3.0, 10.0)
SWEEP_ROWS = 2  # rows per logit scale: one program holds every scale's rows
FUSED_HIDDEN = 16
TOPK = 256
# The formulas of the whole-row TPU kernel (the others have a one-pass form off CPU).
WHOLE_ROWS = ("jsd", "skew_kl", "skew_reverse_kl", "tvd")


def half_ulp(dtype) -> float:
  """Half a unit in the last place at 1 of ``dtype``: the rounding of a result to it."""
  return float(jnp.finfo(dtype).eps) / 2


def rel_value(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(got - want) / np.abs(want)))


def rel_norm(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def sweep_logits(vocab: int, dtype, seed: int):
  """Student and teacher logits ``scale * N(0, 1)``, :data:`SWEEP_ROWS` rows per scale of
  :data:`SWEEP_SCALES`, rounded to ``dtype``; and the same values in float64."""
  rng = np.random.default_rng(seed + vocab)
  scale = np.repeat(SWEEP_SCALES, SWEEP_ROWS)[:, None]
  s, t = (jnp.asarray(scale * rng.normal(size=(len(scale), vocab)), dtype) for _ in range(2))
  return s, t, as64(s), as64(t)


def per_row_vg(fn):
  """jit of ``(fn(*args), gradients of sum(fn) wrt every argument)``, outputs in float64."""
  vg = value_and_grads(fn)

  def run(*args):
    value, grads = vg(*args)
    return as64(value), [as64(g) for g in grads]

  return run


def groups(rows: int) -> list[slice]:
  """The rows of each scale of :data:`SWEEP_SCALES`."""
  return [slice(i * rows, (i + 1) * rows) for i in range(len(SWEEP_SCALES))]


def sweep_errors(got, want, rows: int = SWEEP_ROWS) -> list[dict[str, float]]:
  """Per scale: the value's largest relative error over its rows, and each gradient's
  norm-wise relative error over them (``got``, ``want``: ``(values, [gradients])``)."""
  out = []
  for g in groups(rows):
    grads = [rel_norm(a[g], b[g]) for a, b in zip(got[1], want[1]) if b is not None]
    out.append({"value": rel_value(got[0][g], want[0][g]), "grad": max(grads), "grads": grads})
  return out


def straightforward_rows(name, params, dtype):
  """The straightforward formula (``log_softmax``, :func:`per_token`, XLA's sum) in float32 on
  the ``dtype`` values, its outputs rounded to ``dtype`` as the library's are."""

  def fn(s, t):
    lq = jax.nn.log_softmax(s.astype(jnp.float32), axis=-1)
    lp = jax.nn.log_softmax(t.astype(jnp.float32), axis=-1)
    return per_token(name, params, lq, lp)

  def rounded(s, t):
    value, pullback = jax.vjp(fn, s.astype(jnp.float32), t.astype(jnp.float32))
    grads = pullback(jnp.ones_like(value))
    return value.astype(dtype), tuple(g.astype(dtype) for g in grads)

  run = jax.jit(rounded)
  return lambda s, t: (lambda v, g: (as64(v), [as64(x) for x in g]))(*run(s, t))


def divergence_paths(name: str) -> dict[str, Any]:
  """The engine's paths that compute divergence ``name`` on CPU: the CPU row blocks, the
  accelerator code (its TPU/default branch, and XLA:GPU's where it differs), the whole-row
  TPU kernel in Pallas' interpreter."""
  paths = {"CPU rows": contextlib.nullcontext, "accel (TPU branch)": platform_branch}
  if name in WHOLE_ROWS:
    paths["accel (GPU branch)"] = partial(platform_branch, "cuda")
    paths["TPU kernel (interpreted)"] = tpu_kernel
  return paths


def everything(path: str) -> bool:
  return True


def engine_records(name, spec, vocab, dtype, seed, wanted=everything) -> list[dict[str, Any]]:
  """``divergence_from_logits`` on every path of :func:`divergence_paths` (those ``wanted``
  takes) against float64 and the straightforward formula."""
  s, t, s64, t64 = sweep_logits(vocab, dtype, seed)
  v, gz, gy, _, _ = np_divergence_value_and_grads(name, dict(spec.params), s64, t64, 1.0)
  want = (v, [gz, gy])
  base = sweep_errors(straightforward_rows(name, dict(spec.params), dtype)(s, t), want)
  lq, lp = np_log_softmax(s64), np_log_softmax(t64)
  f, a, b = np_divergence_terms(name, dict(spec.params), lp, lq)
  kappas = pullback_kappas(lq, lp, [(gz, b, np.exp(lq)), (gy, a, np.exp(lp))])
  kappa_values = value_kappas(f)
  records = []
  for path, context in divergence_paths(name).items():
    if not wanted(path):
      continue
    fn = partial(kd.divergence_from_logits, divergence=spec)
    with context():
      if path.startswith("TPU kernel") and not kernel_takes(spec, s, t):
        continue
      got = per_row_vg(fn)(s, t)
    errors = sweep_errors(got, want)
    records += sweep_records(name, path, vocab, dtype, errors, base, kappas, kappa_values)
  return records


def kernel_takes(spec, s, t) -> bool:
  """Whether the whole-row TPU kernel takes these logits (else the XLA passes run)."""
  needs = Needs(a=True, b=True)
  static = tuple(float(p) for p in dict(spec.params).values())
  kernel_spec = (spec.name, static, needs, (None, None), 0)
  return takes_whole_rows(kernel_spec, s, t, jnp.float32(1.0), ())


def floors(dtype, kappa: float | list[float], kappa_value: float = 1.0) -> dict[str, Any]:
  """Errors below which the comparison is rounding against rounding: two float32 ulps, or
  half an ulp of the output dtype (its rounding of the result), times the value's condition
  ``kappa_value`` (the sum of the terms' magnitudes over the value's: a value that cancels)
  for the value; for the gradient also ``eps * kappa``, what float32 probabilities allow
  (:func:`gradient_condition`, ``docs/precision.md``). ``kappa`` a list: one per gradient
  (:func:`pullback_kappas`), each gradient against its own floor (``"grads"``)."""
  value = max(2 * EPS32 * max(kappa_value, 1.0), half_ulp(dtype))
  if isinstance(kappa, list):
    grads = [max(value, EPS32 * k) for k in kappa]
    return {"value": value, "grad": max(grads), "grads": grads}
  return {"value": value, "grad": max(value, EPS32 * kappa)}


def passes(record: dict[str, Any]) -> bool:
  """Whether the library's errors are within twice the target's reference
  (:func:`sweep_ratio`)."""
  return all(sweep_ratio(record, k) <= 2 for k in ("value", "grad"))


def value_kappas(f, rows: int = SWEEP_ROWS) -> list[float]:
  """Per scale: the largest ``sum |f| / |sum f|`` over the rows of the float64 terms ``f``."""
  ratio = np.sum(np.abs(f), -1) / np.abs(np.sum(f, -1))
  return [float(np.max(ratio[g])) for g in groups(rows)]


def sweep_records(
  name, path, vocab, dtype, errors, base, kappas, kappa_values=None
) -> list[dict[str, Any]]:
  """One record per scale: the library's and the straightforward formula's errors, and
  whether the library's are within twice the straightforward formula's (or twice
  :func:`floors` where that is larger)."""
  out = []
  kappa_values = kappa_values or [1.0] * len(SWEEP_SCALES)
  for scale, ours, theirs, kappa, kv in zip(SWEEP_SCALES, errors, base, kappas, kappa_values):
    record = {"divergence": name, "path": path, "vocab": vocab, "scale": scale}
    record |= {"dtype": jnp.dtype(dtype).name, "ours": ours, "straightforward": theirs}
    record |= {"kappa": kappa, "kappa_value": kv, "floors": floors(dtype, kappa, kv)}
    record["pass"] = passes(record)
    out.append(record)
  return out


def sweep_kappas(lq, lp, grad, rows: int = SWEEP_ROWS, pullback=None) -> list[float]:
  """Per scale: :func:`gradient_condition`'s ``kappa`` of the rows (float64 log-probabilities
  ``lq``, ``lp`` (or ``None``), the reference gradient ``grad``; ``T = 1``).

  ``pullback``: ``(w, prob)``, the operands of the softmax's pullback ``grad = w - prob sum w``
  (``w = b = q df/dq`` and ``prob = q`` for the student, ``a`` and ``p`` for the teacher): the
  numerator then adds ``||w|| + ||prob|| sum |w|``, the rounding of that difference's operands
  (:func:`pullback_kappas`)."""
  out = []
  for g in groups(rows):
    size = np.linalg.norm(np.exp(lq[g]) * lq[g])
    if lp is not None:
      size += np.linalg.norm(np.exp(lp[g]) * lp[g])
    if pullback is not None:
      w, prob = pullback[0][g], pullback[1][g]
      size += np.linalg.norm(w) + np.linalg.norm(prob * np.sum(np.abs(w), -1, keepdims=True))
    norm = np.linalg.norm(grad[g])
    out.append(float(size / norm) if norm else 1.0)  # no gradient: no relief
  return out


def pullback_kappas(lq, lp, sides, rows: int = SWEEP_ROWS) -> list[list[float]]:
  """Per scale, per gradient: :func:`sweep_kappas` with the pullback's operands, ``sides`` a
  list of ``(grad, w, prob)``.

  The gradient of ``sum f`` wrt the student's logits is ``g = b - q sum b`` (the teacher's:
  ``a - p sum a``): where the divergence saturates (JSD, TVD, the skew KLs between rows
  whose masses barely overlap, as at logit scale 10), ``g`` is far smaller than ``b`` and
  ``q sum b``, and each of those, rounded to ``eps`` of its size before the subtraction,
  leaves ``eps (||b|| + ||q|| sum |b|)`` in ``g``, which the probabilities' own rounding
  (``||p log p||``, ``||q log q||``) does not count (``docs/precision.md``)."""
  per_side = [sweep_kappas(lq, lp, grad, rows, (w, prob)) for grad, w, prob in sides]
  return [list(k) for k in zip(*per_side)]


def fused_sweep_records(name, spec, vocab, seed) -> list[dict[str, Any]]:
  """``fused_distillation_loss`` (float32 hidden states and heads, ``H =`` :data:`FUSED_HIDDEN`)
  per scale: the mean over the scale's rows, gradients wrt the student's hidden states and
  head, against float64 and the straightforward formula on the materialised logits."""
  rng = np.random.default_rng(seed + vocab + 1)
  hs, ht = (rng.normal(size=(SWEEP_ROWS, FUSED_HIDDEN)) for _ in range(2))
  unit = [rng.normal(size=(FUSED_HIDDEN, vocab)) / math.sqrt(FUSED_HIDDEN) for _ in range(2)]
  params = dict(spec.params)

  def fused(hs, w, ht, wt):
    return kd.fused_distillation_loss(hs, w, ht, wt, divergence=spec)

  def plain(hs, w, ht, wt):
    hp = jax.lax.Precision.HIGHEST
    lq = jax.nn.log_softmax(jnp.matmul(hs, w, precision=hp), axis=-1)
    lp = jax.nn.log_softmax(jnp.matmul(ht, wt, precision=hp), axis=-1)
    return jnp.mean(per_token(name, params, lq, lp))

  ours_vg, plain_vg = (jax.jit(jax.value_and_grad(f, argnums=(0, 1))) for f in (fused, plain))
  ours, theirs, kappas, kappa_values = [], [], [], []
  for scale in SWEEP_SCALES:
    args = [jnp.asarray(x, jnp.float32) for x in (hs, unit[0] * scale, ht, unit[1] * scale)]
    h64, w64, th64, tw64 = (as64(x) for x in args)
    v, gz, _, _, _ = np_divergence_value_and_grads(name, params, h64 @ w64, th64 @ tw64, 1.0)
    dz = gz / SWEEP_ROWS
    want = (np.mean(v), [dz @ w64.T, h64.T @ dz])
    lq, lp = np_log_softmax(h64 @ w64), np_log_softmax(th64 @ tw64)
    f, _, b = np_divergence_terms(name, params, lp, lq)
    # The scale's rows are the first group; the student's logits' gradient's condition.
    kappas.append(sweep_kappas(lq, lp, gz, pullback=(b, np.exp(lq)))[0])
    kappa_values.append(float(np.sum(np.abs(f)) / abs(np.sum(f))))  # the mean's condition
    for vg, out in ((ours_vg, ours), (plain_vg, theirs)):
      value, grads = vg(*args)
      errs = [rel_norm(as64(g), w) for g, w in zip(grads, want[1])]
      out.append({"value": rel_value(as64(value), want[0]), "grad": max(errs)})
  return sweep_records(name, "fused head", vocab, jnp.float32, ours, theirs, kappas, kappa_values)


def np_topk_bucket(name, params, z64, ids, lp64):
  """float64 ``(value, grad wrt z, terms, w)`` of a top-k teacher with the tail as a bucket
  (``T = 1``): the divergence over the ``k + 1`` classes (:func:`np_divergence_terms`), the
  gradient ``w - s sum w`` with ``w_v = s_v b_j / q_j``, ``s = softmax(z)``, ``j`` the class
  ``v`` falls in."""
  log_q, log_p = np_topk_log_probs(z64, ids, lp64, 1.0, "bucket")
  f, _, b = np_divergence_terms(name, params, log_p, log_q)
  soft = np.exp(np_log_softmax(z64))
  ratio = np.broadcast_to(b[:, -1:] / np.exp(log_q[:, -1:]), z64.shape).copy()
  np.put_along_axis(ratio, ids, b[:, :-1] / np.exp(log_q[:, :-1]), axis=-1)
  return np.sum(f, -1), soft * (ratio - np.sum(b, -1, keepdims=True)), f, soft * ratio


def topk_sweep_records(name, spec, vocab, dtype, seed, wanted=everything) -> list[dict[str, Any]]:
  """``divergence_from_topk`` (``tail="bucket"``, ``k`` up to :data:`TOPK`: the teacher's top
  float32 log-probabilities) on the CPU path and the accelerator code, against float64 and
  the straightforward formula (``log_softmax`` of the student, its top-k and its tail as a
  log-sum-exp of the classes outside, the teacher's tail as ``log1p(-sum p)``)."""
  s, _, s64, t64 = sweep_logits(vocab, dtype, seed)
  order = np.argsort(-t64, axis=-1)
  sorted_lp = np.take_along_axis(np_log_softmax(t64), order, -1)
  # The top classes that leave at least 1e-3 of every row's mass to the tail (a teacher tail
  # below float32's resolution of the stored log-probabilities is another question).
  held = np.sum(np.cumsum(np.exp(sorted_lp), -1) <= 1 - 1e-3, -1)
  k = int(np.clip(np.min(held), 1, TOPK))
  ids, lp = order[:, :k], jnp.asarray(sorted_lp[:, :k], jnp.float32)
  ids = jnp.asarray(ids, jnp.int32)
  params = dict(spec.params)
  v, gz, f, w = np_topk_bucket(name, params, s64, np.asarray(ids), as64(lp))
  want = (v, [gz])

  def plain(s):
    lq = jax.nn.log_softmax(s.astype(jnp.float32), axis=-1)
    outside = jnp.ones(s.shape, bool).at[jnp.arange(s.shape[0])[:, None], ids].set(False)
    tail = jax.nn.logsumexp(jnp.where(outside, lq, -jnp.inf), axis=-1, keepdims=True)
    lq_k = jnp.concatenate([jnp.take_along_axis(lq, ids, -1), tail], -1)
    p_tail = -jnp.expm1(jax.nn.logsumexp(lp, axis=-1, keepdims=True))
    lp_k = jnp.concatenate([lp, jnp.log(p_tail)], -1)
    return per_token(name, params, lq_k, lp_k).astype(dtype)

  def ours(s):
    return kd.divergence_from_topk(s, ids, lp, divergence=spec, tail="bucket")

  base = sweep_errors(per_row_vg(plain)(s), want)
  lq = np_log_softmax(s64)
  kappas = pullback_kappas(lq, np_log_softmax(t64), [(gz, w, np.exp(lq))])
  kappa_values = value_kappas(f)
  records = []
  for path, context in (("top-k, CPU", contextlib.nullcontext), ("top-k, accel", platform_branch)):
    if not wanted(path):
      continue
    with context():
      got = per_row_vg(ours)(s)
    errors = sweep_errors(got, want)
    records += sweep_records(name, path, vocab, dtype, errors, base, kappas, kappa_values)
  return records


TOKEN_CASES = ("token log-prob", "entropy")


def token_sweep_records(
  vocab, dtype, seed, wanted=everything, names=TOKEN_CASES
) -> list[dict[str, Any]]:
  """``token_log_probs`` with the entropy (the CPU path and the accelerator code) against
  float64 and ``log_softmax``: the sampled token's log-probability, and the entropy, each
  with its gradient wrt the logits."""
  s, _, s64, _ = sweep_logits(vocab, dtype, seed)
  ids = jnp.asarray(np.random.default_rng(seed).integers(0, vocab, s.shape[0]), jnp.int32)
  lq = np_log_softmax(s64)
  q = np.exp(lq)
  entropy = -np.sum(q * lq, -1)
  onehot = np.zeros_like(q)
  np.put_along_axis(onehot, np.asarray(ids)[:, None], 1.0, -1)
  picked = np.take_along_axis(lq, np.asarray(ids)[:, None], -1)[:, 0]
  want = {
    "token log-prob": (picked, [onehot - q]),
    "entropy": (entropy, [-q * (lq + entropy[:, None])]),
  }
  pullback = {"token log-prob": onehot, "entropy": -q * lq}  # gradient = w - q sum w

  def plain(which):
    def fn(s):
      lq = jax.nn.log_softmax(s.astype(jnp.float32), axis=-1)
      if which == "entropy":
        return (-jnp.sum(jnp.exp(lq) * lq, -1)).astype(dtype)
      return jnp.take_along_axis(lq, ids[:, None], -1)[:, 0].astype(dtype)

    return fn

  def ours(which):
    def fn(s):
      log_probs, entropy = kd.token_log_probs(s, ids, return_entropy=True)
      return entropy if which == "entropy" else log_probs

    return fn

  records = []
  for which, ref in want.items():
    if which not in names:
      continue
    base = sweep_errors(per_row_vg(plain(which))(s), ref)
    kappas = pullback_kappas(lq, None, [(ref[1][0], pullback[which], q)])
    for path, context in (("CPU rows", contextlib.nullcontext), ("accel", platform_branch)):
      if not wanted(path):
        continue
      with context():
        got = per_row_vg(ours(which))(s)
      records += sweep_records(which, path, vocab, dtype, sweep_errors(got, ref), base, kappas)
  return records


def vocab_sweep(
  args: argparse.Namespace,
  log: Callable[[str], None] = print,
  partial_out: Callable[[dict[str, Any]], Any] | None = None,
) -> dict[str, Any]:
  """Every divergence, path, vocabulary size, logit scale and dtype: errors against float64,
  the library's and the straightforward formula's."""
  vocabs = QUICK_SWEEP_VOCABS if args.quick else SWEEP_VOCABS
  if args.vocabs:
    vocabs = tuple(int(v) for v in args.vocabs.split(","))
  names = args.divergences.split(",") if args.divergences else [*SPECS, *TOKEN_CASES]
  unknown = set(names) - {*SPECS, *TOKEN_CASES}
  if unknown:
    raise SystemExit(
      f"--divergences: unknown {sorted(unknown)}; expected from {[*SPECS, *TOKEN_CASES]}"
    )
  paths = args.paths.split(",") if args.paths else None
  wanted = lambda path: paths is None or path.startswith(tuple(paths))  # noqa: E731
  dtypes = [jnp.dtype(d) for d in (args.dtypes or "float32,bfloat16").split(",")]
  records, start = [], time.perf_counter()
  for vocab in vocabs:
    for dtype in dtypes:
      for name, spec in SPECS.items():
        if name not in names:
          continue
        records += engine_records(name, spec, vocab, dtype, args.seed, wanted)
        if wanted("top-k, CPU") or wanted("top-k, accel"):
          records += topk_sweep_records(name, spec, vocab, dtype, args.seed, wanted)
        if dtype == jnp.float32 and wanted("fused head"):
          records += fused_sweep_records(name, spec, vocab, args.seed)
      if any(n in names for n in TOKEN_CASES):
        records += token_sweep_records(vocab, dtype, args.seed, wanted, names)
      log(f"  V = {vocab}, {jnp.dtype(dtype).name}: {time.perf_counter() - start:.0f} s")
      if partial_out is not None:  # what is done so far, should the run be cut short
        partial_out(sweep_result(vocabs, records, args.seed, start))
  return sweep_result(vocabs, records, args.seed, start)


def sweep_result(vocabs, records, seed, start) -> dict[str, Any]:
  settings = dict(vocabs=list(vocabs), scales=list(SWEEP_SCALES), rows=SWEEP_ROWS)
  settings |= dict(hidden=FUSED_HIDDEN, topk=TOPK, seed=seed)
  settings |= dict(seconds=time.perf_counter() - start)
  result = {"section": "precision_sweep", "machine": machine_info(), "settings": settings}
  return result | {"records": list(records)}


def sweep_ratio(record: dict[str, Any], key: str) -> float:
  """The library's error over the straightforward formula's (or :func:`floors`, where
  larger): the target is at most 2."""
  if key == "grad" and all("grads" in record[k] for k in ("ours", "straightforward", "floors")):
    # One floor per gradient (pullback_kappas): each gradient against its own.
    sides = zip(
      record["ours"]["grads"], record["straightforward"]["grads"], record["floors"]["grads"]
    )
    return max(_ratio(ours, theirs, floor) for ours, theirs, floor in sides)
  return _ratio(record["ours"][key], record["straightforward"][key], record["floors"][key])


def _ratio(ours: float, theirs: float, floor: float) -> float:
  theirs = theirs if np.isfinite(theirs) else math.inf  # the straightforward formula's NaN
  return ours / max(theirs, floor) if np.isfinite(ours) else math.inf


def print_sweep(result: dict[str, Any], every_case: bool = False) -> None:
  s = result["settings"]
  print(describe_machine(result["machine"]))
  print(
    f"{s['rows']} rows per logit scale {s['scales']} of scale * N(0, 1), T = 1, float32 and "
    "bf16 logits, jitted value and gradients; errors against float64 NumPy from the same "
    "values: the value's largest relative error over the rows, the gradient's norm-wise "
    "relative error (the worst of its arguments). Target: at most 2x the straightforward "
    "float32 formula's (log_softmax, the divergence, XLA's sum; outputs rounded to the "
    "inputs' dtype), or 2x the floor where that is larger (two float32 ulps or half a bf16 "
    "ulp, times the value's condition; eps * kappa for the gradient: floors())."
  )
  if every_case:
    columns = [("divergence", "16"), ("path", "24"), ("V", ">7"), ("scale", ">5g")]
    columns += [("dtype", "8"), ("value ours", ">10.1e"), ("value sf", ">9.1e")]
    columns += [("grad ours", ">9.1e"), ("grad sf", ">8.1e"), ("", "4")]
    rows = []
    for r in result["records"]:
      o, t = r["ours"], r["straightforward"]
      head = [r["divergence"], r["path"], r["vocab"], r["scale"], r["dtype"]]
      verdict = "PASS" if r["pass"] else "FAIL"
      rows.append([*head, o["value"], t["value"], o["grad"], t["grad"], verdict])
    print_table(columns, rows)
  vocabs = s["vocabs"]
  print(
    "\nWorst ratio, ours / straightforward (value / gradient), over the scales and dtypes, "
    "per V; FAIL where a case exceeds 2:"
  )
  for r in result["records"]:
    r["pass"] = passes(r)
  cells: dict[tuple[str, str], dict[int, list[dict[str, Any]]]] = {}
  for r in result["records"]:
    cells.setdefault((r["divergence"], r["path"]), {}).setdefault(r["vocab"], []).append(r)
  columns = [("divergence", "16"), ("path", "24")] + [
    (f"V=2^{v.bit_length() - 1}", ">11") for v in vocabs
  ]
  columns.append(("", "4"))
  rows = []
  for (name, path), per_vocab in cells.items():
    row = [name, path]
    for v in vocabs:
      rs = per_vocab.get(v, [])
      if not rs:
        row.append("-")
        continue
      value = max(sweep_ratio(r, "value") for r in rs)
      grad = max(sweep_ratio(r, "grad") for r in rs)
      row.append(f"{value:.1f} / {grad:.1f}")
    row.append("PASS" if all(r["pass"] for rs in per_vocab.values() for r in rs) else "FAIL")
    rows.append(row)
  print_table(columns, rows)
  failed = [r for r in result["records"] if not r["pass"]]
  print(f"\n{len(result['records']) - len(failed)} of {len(result['records'])} cases PASS")
  for r in failed:
    o, t = r["ours"], r["straightforward"]
    print(
      f"  FAIL {r['divergence']} / {r['path']} V={r['vocab']} scale={r['scale']:g} {r['dtype']}: "
      f"value {o['value']:.1e} vs {t['value']:.1e}, gradient {o['grad']:.1e} vs {t['grad']:.1e}"
    )


# ------------------------------------------------------------------ report


def summary(records: list[dict[str, Any]], grad_keys: Sequence[str]) -> list[dict[str, Any]]:
  """Per function and divergence: the worst case over deltas and temperatures."""
  rows: dict[tuple[str, str], dict[str, Any]] = {}
  zeros = ("value_abs_err", "value_rel_err", "value_err_over_eps_s", *grad_keys)
  zeros += tuple(k + "_max" for k in grad_keys)
  for r in records:
    first = {"function": r["function"], "divergence": r["divergence"]}
    first |= {"identical_exact_zero": True, "min_value": math.inf} | dict.fromkeys(zeros, 0.0)
    row = rows.setdefault((r["function"], r["divergence"]), first)
    if r["identical"]:
      row["identical_exact_zero"] &= bool(r["exact_zero"] and r["zero_gradients"])
      continue
    row["min_value"] = min(row["min_value"], r["min_value_bf16"], r["min_value_f32"])
    for k in ("value_abs_err", "value_err_over_eps_s"):
      row[k] = max(row[k], r[k])
    if r["delta"] != STEP:  # a true value of ~1e-11: its relative error means nothing
      row["value_rel_err"] = max(row["value_rel_err"], r["value_rel_err"])
    for side in ("student", "teacher"):
      ratio = r.get(f"grad_{side}_f32_over_eps_cond")
      if ratio is not None and r["delta"] != STEP:
        row["grad_f32_over_eps_cond"] = max(row.get("grad_f32_over_eps_cond", 0.0), ratio)
    for k in grad_keys:
      if r["delta"] == STEP:  # ill-conditioned: reported apart from the bound
        row[k + "_step"] = max(row.get(k + "_step", 0.0), r[k]["rel_norm"])
      else:
        row[k] = max(row[k], r[k]["rel_norm"])
        row[k + "_max"] = max(row[k + "_max"], r[k]["rel_max"])
  return list(rows.values())


def print_report(result: dict[str, Any]) -> None:
  s = result["settings"]
  print(describe_machine(result["machine"]))
  print(
    f"bf16 logits [{s['rows']}, {s['vocab']}], std {s['std']}, student = bf16(base + delta * "
    f"noise), delta in {s['deltas']}, T in {s['temperatures']}, jitted; float64 NumPy reference "
    "from the same bf16 values"
  )
  print("\nPer case (value errors: float32 arithmetic; gradient: ||g - g_ref|| / ||g_ref||):")
  e8 = [(h, ">8.1e") for h in ("dz bf16", "dz f32", "dy bf16", "dy f32", "cond")]
  columns = [("divergence", "16"), ("T", ">3g"), ("delta", ">6"), ("differ", ">6.1%")]
  columns += [("D_ref", ">9.2e"), ("min D", ">9.2e"), ("abs err", ">8.1e"), ("err/eps S", ">9.2f")]
  rows = []
  for r in (r for r in result["records"] if r["function"] == "divergence_from_logits"):
    if r["identical"]:
      verdict = "exact 0" if r["exact_zero"] and r["zero_gradients"] else "NOT 0"
      rows.append([r["divergence"], r["temperature"], "0", "0", f"identical: {verdict}"])
      continue
    g = [r[f"grad_{k}_{p}"]["rel_norm"] for k in ("student", "teacher") for p in ("bf16", "f32")]
    head = [r["divergence"], r["temperature"], fmt_delta(r["delta"]), r["classes_differing"]]
    keys = ("ref_min", "min_value_f32", "value_abs_err", "value_err_over_eps_s")
    cond = [r["grad_student_condition"], r["grad_student_f32_over_eps_cond"]]
    rows.append([*head, *(r[k] for k in keys), *g, *cond])
  print_table([*columns, *e8, ("dz/eps c", ">8.3f")], rows)
  print("\nWorst case per divergence (over the deltas and temperatures; 'step' apart):")
  columns = [("function / divergence", "30"), ("ident.", ">6"), ("min D", ">8.1e")]
  columns += [("abs err", ">8.1e"), ("err/eps S", ">9.2f"), ("rel err", ">8.1e")]
  e8 = [(h, ">8.1e") for h in ("dz bf16", "max el", "dz f32", "dy bf16", "dy f32")]
  rows = []
  for row in result["summary"]:
    fused = row["function"] == "fused_distillation_loss"
    label = row["function"] + ("" if fused else f" / {row['divergence']}")
    side = ("hidden", "weight") if fused else ("student", "teacher")
    grads = [f"grad_{x}_{p}" for x in side for p in ("bf16", "f32")]
    keys = ("min_value", "value_abs_err", "value_err_over_eps_s", "value_rel_err")
    ident = "yes" if row["identical_exact_zero"] else "NO"
    gs = [row[grads[0]], row[grads[0] + "_max"], *(row[k] for k in grads[1:])]
    tail = [row.get("grad_f32_over_eps_cond"), row.get(grads[1] + "_step")]
    label = label.replace("divergence_from_logits / ", "")
    rows.append([label, ident, *(row[k] for k in keys), *gs, *tail])
  print_table([*columns, *e8, ("g/eps k", ">8.2f"), ("step dz", ">8.1e")], rows)
  print(
    "  (fused_distillation_loss: dz = gradient wrt the hidden states, dy = wrt the head; g/eps k: "
    "the float32 gradient error over eps * kappa; step dz: the float32 error at 'step')"
  )
  print("\nIdentical logits, jitted (max |value| and max |gradient| over rows):")
  for r in result["identical"]:
    print(
      f"  V={r['vocab']:6} {r['dtype']:8} T={r['temperature']:g} {r['function']:42} "
      f"value {r['max_abs_value']:.3g}  gradient {r['max_abs_grad']:.3g}"
    )
  print("\nFor contrast, the straightforward forward KL in bf16 (log_softmax + sum, jitted):")
  for r in result["straightforward"]:
    g = r["grad_student"]
    grad = f"gradient error {g['rel_norm']:.1%}" if g else f"max |grad| {r['max_abs_grad']:.3g}"
    print(
      f"  T={r['temperature']:g} delta={fmt_delta(r['delta'])}: min value {r['min_value']:+.4f}, "
      f"value error {r['max_abs_value_err']:.2e}, {grad}"
    )
  print_logits_dtype(result.get("logits_dtype", []))
  checks = result["checks"]
  print("\nChecks:")
  for name, ok in checks.items():
    print(f"  {'PASS' if ok else 'FAIL'}  {name}")


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
  vocab = args.vocab or (QUICK_VOCAB if args.quick else VOCAB)
  rows = args.rows or (4 if args.quick else 8)
  deltas = [float(d) for d in args.deltas.split(",")]
  temperatures = [float(t) for t in args.temperatures.split(",")]
  base, noise = make_logits(rows, vocab, args.std, args.seed)
  start = time.perf_counter()
  log("divergences:")
  records = divergence_records(base, noise, deltas, temperatures, log)
  log("distillation_loss, fused_distillation_loss:")
  records += distillation_records(base, noise, deltas, temperatures)
  fused = fused_records(rows, vocab, args.hidden, args.std, deltas, temperatures, args.seed)
  log("identical logits:")
  # divergence_from_logits at V is in the records (delta = 0); the other entry points here.
  names = ["kl_div_from_logits", "generalized_jsd", "distillation_loss", "kl_div_from_topk[k=V]"]
  identical = identical_checks(rows, vocab, args.std, args.seed, names)
  if not args.quick:  # EasyDeL's vocabulary: every entry point, and the straightforward code
    every = [f"divergence_from_logits[{n}]" for n in SPECS] + names
    every.append("straightforward forward KL")
    identical += identical_checks(rows, EASYDEL_VOCAB, args.std, args.seed, every)
  naive = straightforward_records(base, noise, deltas, temperatures)
  log("the fused losses' logits_dtype:")
  logits_dtype = logits_dtype_records(args.seed, args.quick)
  grads = ("grad_student_bf16", "grad_student_f32", "grad_teacher_bf16", "grad_teacher_f32")
  fused_grads = ("grad_hidden_bf16", "grad_hidden_f32", "grad_weight_bf16", "grad_weight_f32")
  table = summary(records, grads) + summary(fused, fused_grads)
  measured = [r for r in records + fused if not r["identical"]]
  exact = [r for r in identical if not r["function"].startswith(("kl_div_from_topk", "straight"))]
  checks = {
    "identical logits give exactly 0 and zero gradients (every divergence, loss and the fused "
    "head, bf16 and float32, T = 1 and 2, every V)": all(r["identical_exact_zero"] for r in table)
    and all(r["max_abs_value"] == 0 and r["max_abs_grad"] == 0 for r in exact),
    "no value is negative": all(min(r["min_value_bf16"], r["min_value_f32"]) >= 0 for r in measured)
    and all(r["min_value"] >= 0 for r in identical if "straight" not in r["function"]),
    "bf16 values are the float32 values rounded": all(r["bf16_is_f32_rounded"] for r in records),
    "logits_dtype=float32: the fused losses' bf16 gradients within 2**-8 of float64, norm-wise, "
    "on Liger's JSD test and ordinary logits": all(
      r[k] <= U_BF16
      for r in logits_dtype
      if r["logits_dtype"] == "float32"
      for k in ("grad_hidden", "grad_weight")
    ),
    "bf16 gradients are the float32 ones rounded (norm-wise error <= 2**-8 (1 + e) + e, e the "
    "float32 error)": all(
      r[k + "_bf16"]["rel_norm"]
      <= U_BF16 * (1 + r[k + "_f32"]["rel_norm"]) + r[k + "_f32"]["rel_norm"]
      for r in measured
      for k in ("grad_student", "grad_teacher", "grad_hidden", "grad_weight")
      if r.get(k + "_bf16")
    ),
  }
  settings = dict(rows=rows, vocab=vocab, std=args.std, deltas=deltas)
  settings |= dict(temperatures=temperatures, hidden=args.hidden, seed=args.seed)
  settings |= dict(eps_f32=EPS32, u_bf16=U_BF16, seconds=time.perf_counter() - start)
  result = {"section": "precision", "machine": machine_info(), "settings": settings}
  result |= {"records": records + fused, "summary": table, "identical": identical}
  return result | {"straightforward": naive, "logits_dtype": logits_dtype, "checks": checks}


def main(argv: Sequence[str] | None = None) -> int:
  p = parser(__doc__, quick=f"V = {QUICK_VOCAB}, 4 rows", repeats="ignored (nothing is timed)")
  p.add_argument("--vocab", type=int, default=None, help=f"classes (default {VOCAB})")
  p.add_argument("--rows", type=int, default=None, help="rows (default 8)")
  p.add_argument("--std", type=float, default=4.0, help="standard deviation of the logits")
  p.add_argument("--deltas", default="1e-3,1e-2,1e-1", help="student perturbations")
  p.add_argument("--temperatures", default="1,2")
  p.add_argument("--hidden", type=int, default=256, help="H of the fused head")
  p.add_argument(
    "--sweep",
    action="store_true",
    help="the vocabulary sweep instead: every divergence and path, V = 2**13 to 2**20 "
    "(--quick: 2**13 and 2**17), logit scales 1, 3, 10, float32 and bf16",
  )
  p.add_argument("--every-case", action="store_true", help="--sweep: print every case")
  p.add_argument("--vocabs", default=None, help="--sweep: the vocabulary sizes (comma-separated)")
  p.add_argument("--report", default=None, help="--sweep: print the sweep saved in this JSON")
  p.add_argument(
    "--divergences",
    default=None,
    help="--sweep: only these (comma-separated: the divergences, 'token log-prob', 'entropy')",
  )
  p.add_argument(
    "--paths",
    default=None,
    help="--sweep: only the paths whose name starts with one of these (comma-separated: "
    "'CPU rows', 'accel' (the accelerator code: 'accel (TPU', 'accel (GPU'), 'TPU kernel', "
    "'top-k' ('top-k, CPU', 'top-k, accel'), 'fused head')",
  )
  p.add_argument("--dtypes", default=None, help="--sweep: float32,bfloat16 (the default) or one")
  args = p.parse_args(argv)
  if args.sweep and args.report:
    print_sweep(json.loads(Path(args.report).read_text()), args.every_case)
    return 0
  if args.sweep:
    swept = vocab_sweep(args, partial_out=lambda r: write_json(Path(args.out) / "partial.json", r))
    print_sweep(swept, args.every_case)
    save(swept, args.out, f" ({swept['settings']['seconds']:.0f} s)")
    return 0 if all(r["pass"] for r in swept["records"]) else 1
  result = run(args)
  print_report(result)
  save(result, args.out, f" ({result['settings']['seconds']:.0f} s)")
  return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
  raise SystemExit(main())
