"""References that several test modules compare against (test modules never import each other).

Everything here is independent of kldiv_jax: the authors' code ported to float64 NumPy
(DistiLLM, TRL, ABKD, verl; each formula once: one ``ref_<name>`` per divergence, the
other references built on them), closed forms, and the same formulas in torch. The
``torch_*`` functions import torch when called; a test that calls them carries the
``torch`` marker and skips without torch (``conftest.py``), and each has a float64 twin
here that runs everywhere. ``benchmarks/bench_precision.py`` imports its references from
here too.

Logits references take ``z`` (student) and ``y`` (teacher) of shape ``[..., classes]``,
with ``q = softmax(z / T)`` and ``p = softmax(y / T)``.
"""

import contextlib
import decimal
import functools
import importlib.metadata
import os
import re
from pathlib import Path

import jax
import numpy as np
from jax.experimental.compilation_cache import compilation_cache

INF = np.inf

# torch's tolerances per dtype (rtol, atol).
TOLERANCES = {
  "float64": (1e-7, 1e-7),
  "float32": (1.3e-6, 1e-5),
  "float16": (1e-3, 1e-5),
  "bfloat16": (1.6e-2, 1e-5),
}

# The 64-bit context manager: jax.enable_x64 is jax >= 0.8; jax 0.7 has only
# jax.experimental's (deprecated since 0.8). Remove the fallback when the floor reaches 0.8.
if hasattr(jax, "enable_x64"):
  enable_x64 = jax.enable_x64
else:
  import jax.experimental

  enable_x64 = jax.experimental.enable_x64


def _sub_jaxprs(eqn):
  for v in eqn.params.values():
    for x in v if isinstance(v, (tuple, list)) else (v,):
      x = getattr(x, "jaxpr", x)
      if hasattr(x, "eqns"):
        yield x


def all_eqns(jaxpr) -> list:
  """Every equation of ``jaxpr`` and of the jaxprs inside its equations (loops, conds, calls)."""
  eqns = []
  for e in jaxpr.eqns:
    eqns.append(e)
    for sub in _sub_jaxprs(e):
      eqns.extend(all_eqns(sub))
  return eqns


def matmuls_and_casts(jaxpr, dtype) -> tuple[list, list]:
  """Of ``jaxpr`` and the jaxprs inside it: its ``dot_general`` equations and the shapes of
  the values it converts to ``dtype`` (a fused loss's chunk logits in their low dtype)."""
  eqns = all_eqns(jaxpr)
  dots = [e for e in eqns if e.primitive.name == "dot_general"]
  casts = [
    e.outvars[0].aval.shape
    for e in eqns
    if e.primitive.name == "convert_element_type" and e.params["new_dtype"] == dtype
  ]
  return dots, casts


def rounded_matmul_outputs(jaxpr, dtype) -> int:
  """How many ``dot_general`` results ``jaxpr`` (and the jaxprs inside it) converts to ``dtype``:
  a fused loss's chunk logits rounded to the inputs' dtype."""
  eqns = all_eqns(jaxpr)
  outs = {id(e.outvars[0]) for e in eqns if e.primitive.name == "dot_general"}
  return sum(
    e.primitive.name == "convert_element_type"
    and e.params["new_dtype"] == dtype
    and id(e.invars[0]) in outs
    for e in eqns
  )


def dot_generals(jaxpr) -> int:
  """The ``dot_general``s one platform runs in ``jaxpr``: a loop body counted once, and of
  a ``cond`` (``lax.platform_dependent``'s per-platform branches) its largest branch."""
  n = 0
  for e in jaxpr.eqns:
    if e.primitive.name == "dot_general":
      n += 1
    elif e.primitive.name == "cond":
      n += max(dot_generals(b) for b in _sub_jaxprs(e))
    else:
      n += sum(dot_generals(s) for s in _sub_jaxprs(e))
  return n


def loop_dot_generals(jaxpr) -> tuple[int, list[int]]:
  """``(dot_generals outside loops, [dot_generals in each outermost loop])``, as
  :func:`dot_generals` counts them."""
  outside, loops = 0, []

  def walk(j):
    nonlocal outside
    for e in j.eqns:
      if e.primitive.name == "dot_general":
        outside += 1
      elif e.primitive.name in ("scan", "while"):
        loops.append(sum(dot_generals(s) for s in _sub_jaxprs(e)))
      elif e.primitive.name == "cond":
        outside += max(dot_generals(b) for b in _sub_jaxprs(e))
      else:
        for s in _sub_jaxprs(e):
          walk(s)

  walk(jaxpr)
  return outside, loops


def vocab_sharded_and_whole(loss, mesh, h, w, b):
  """``value_and_grad`` (with aux) of ``loss(h, w, b, axis_name)`` wrt ``(h, w, b)``: with
  the head's vocabulary split over ``mesh``'s ``"vocab"`` axis in ``jax.shard_map``, and on
  one device; ``(sharded, whole)``, for the vocabulary-parallel tests of the fused losses."""
  from jax.sharding import PartitionSpec as P

  sharded = jax.shard_map(
    lambda h, w, b: loss(h, w, b, "vocab"),
    mesh=mesh,
    in_specs=(P(), P(None, "vocab"), P("vocab")),
    out_specs=(P(), P()),
  )
  grads = lambda fn: jax.jit(jax.value_and_grad(fn, (0, 1, 2), has_aux=True))(h, w, b)  # noqa: E731
  return grads(sharded), grads(lambda h, w, b: loss(h, w, b, None))


def docs_snippet(page: str, heading: str) -> str:
  """The first Python block of a section of a docs page (the guides' snippets must run)."""
  text = (Path(__file__).resolve().parent.parent / "docs" / page).read_text()
  return re.search(r"```python\n(.*?)```", text.split(heading, 1)[1], re.S).group(1)


# ------------------------------------------------------ float64 NumPy: the divergences
#
# One reference per divergence, ported from its authors' code, and each formula written
# once: ``ref_<name>(student, teacher, temperature, ..., xp=np)`` gives the per-token
# divergence (summed over the last axis) of ``softmax(teacher / T)`` (``p``) from
# ``softmax(student / T)`` (``q``), written as the authors write the per-token part of
# their loss (before their masked mean over tokens). ``xp`` is ``numpy`` (float64 values)
# or ``jax.numpy`` (autodiff, under ``jax.enable_x64``). The closed-form gradients
# (:func:`np_divergence_value_and_grads`) and the top-k, distillation and TRL references
# below are built on them.
#
# * DistiLLM, ``jongwooko/distillm``, ``distillm/losses.py`` (commit 17c0f98):
#   ``forward_kl``, ``reverse_kl``, ``symmetric_kl``, ``skewed_forward_kl``,
#   ``skewed_reverse_kl``, ``tv_distance``. Its ``forward_kl`` and
#   ``skewed_forward_kl`` are cross-entropies, ``-sum p log q`` and ``-sum p log
#   m``: they differ from the KL divergences by the teacher's entropy, a constant
#   for the student. The references add it back (``+ sum p log p``) to give
#   ``KL(p || q)`` and ``KL(p || m)``. (torchtune's ``ForwardKLLoss`` is the same
#   port of DistiLLM.)
# * TRL, ``huggingface/trl``, ``trl/trainer/gkd_trainer.py``,
#   ``GKDTrainer.generalized_jsd_loss`` (``beta`` 0 and 1 are forward and reverse
#   KL).
# * Liger Kernel, ``linkedin/Liger-Kernel``, ``src/liger_kernel/ops/tvd.py``:
#   ``0.5 * |p - q|`` (as DistiLLM's ``tv_distance``).
# * ABKD, ``ghwang-s/abkd``, ``distillation_llm/distillm/losses.py``, ``ab_div``:
#   the general branch. Its limit branches (``alpha`` or ``beta`` = 0, ``alpha +
#   beta = 0``) are scaled by ``1/alpha`` where Cichocki et al. (2011, Eq. 4-5)
#   have ``1/alpha**2``, so they are not the limits of its general branch;
#   :func:`ref_alpha_beta` uses the paper's closed forms, and
#   :func:`ab_decimal` evaluates the general branch in 80-digit decimal
#   arithmetic next to a limit, as an independent check of them.
#
# DistiLLM, TRL and ABKD drop every class where either logit is infinite
# (``inf_mask``). The forward and reverse KL and TRL's JSD here instead add 0 for a class
# without mass on the side that weights it (``0 log 0 = 0``), so they also take ``-inf``
# logits, with the library's conventions (``+inf`` where that side has mass the other
# lacks); the other divergences are meant for finite logits (the tests express "no mass"
# as a very negative finite logit when comparing).


def np_log_softmax(x, axis=-1, xp=np):
  """float64 log-softmax (``xp=jax.numpy``: in the input's dtype, for autodiff); a row of
  -inf stays -inf."""
  x = np.asarray(x, np.float64) if xp is np else xp.asarray(x)
  m = xp.max(xp.where(xp.isfinite(x), x, -INF), axis=axis, keepdims=True)
  m = xp.where(xp.isfinite(m), m, 0.0)
  with np.errstate(divide="ignore"):
    return x - m - xp.log(xp.sum(xp.exp(x - m), axis=axis, keepdims=True))


def _weighted(prob, x, xp):
  """``prob * x`` per class, 0 where ``prob`` has no mass."""
  with np.errstate(invalid="ignore"):
    return xp.where(prob > 0, prob * x, 0.0)


def _logs(student, teacher, temperature, xp):
  lq = np_log_softmax(xp.asarray(student) / temperature, xp=xp)
  lp = np_log_softmax(xp.asarray(teacher) / temperature, xp=xp)
  return lq, lp, xp.exp(lq), xp.exp(lp)


def ref_forward_kl(student, teacher, temperature=1.0, xp=np):
  # DistiLLM forward_kl: -sum(teacher_probs * student_logprobs), plus the teacher's entropy term.
  lq, lp, _, p = _logs(student, teacher, temperature, xp)
  return -xp.sum(_weighted(p, lq, xp), axis=-1) + xp.sum(_weighted(p, lp, xp), axis=-1)


def ref_reverse_kl(student, teacher, temperature=1.0, xp=np):
  # DistiLLM reverse_kl: -(sum(student_probs * teacher_logprobs) - sum(student_probs * student_logprobs)).
  lq, lp, q, _ = _logs(student, teacher, temperature, xp)
  return -(xp.sum(_weighted(q, lp, xp), axis=-1) - xp.sum(_weighted(q, lq, xp), axis=-1))


def ref_symmetric_kl(student, teacher, temperature=1.0, lam=0.5, xp=np):
  # DistiLLM symmetric_kl: (1 - lam) * forward_kl + lam * reverse_kl.
  fwd = ref_forward_kl(student, teacher, temperature, xp)
  rev = ref_reverse_kl(student, teacher, temperature, xp)
  return (1 - lam) * fwd + lam * rev


def ref_skew_kl(student, teacher, temperature=1.0, alpha=0.1, xp=np):
  # DistiLLM skewed_forward_kl (lam = alpha): mixed = lam p + (1 - lam) q; -sum(p log mixed),
  # plus the teacher's entropy term.
  _, lp, q, p = _logs(student, teacher, temperature, xp)
  mixed = alpha * p + (1 - alpha) * q
  return -xp.sum(p * xp.log(mixed), axis=-1) + xp.sum(p * lp, axis=-1)


def ref_skew_reverse_kl(student, teacher, temperature=1.0, alpha=0.1, xp=np):
  # DistiLLM skewed_reverse_kl: mixed = (1 - lam) p + lam q; -(sum(q log mixed) - sum(q log q)).
  lq, _, q, p = _logs(student, teacher, temperature, xp)
  mixed = (1 - alpha) * p + alpha * q
  return -(xp.sum(q * xp.log(mixed), axis=-1) - xp.sum(q * lq, axis=-1))


def ref_tvd(student, teacher, temperature=1.0, xp=np):
  # DistiLLM tv_distance / Liger's _tv_distance_kernel: 0.5 * sum |p - q|.
  _, _, q, p = _logs(student, teacher, temperature, xp)
  return 0.5 * xp.sum(xp.abs(p - q), axis=-1)


def _trl_jsd_terms(s, t, beta, xp):
  """TRL's ``generalized_jsd_loss`` per class, before its reduction, from the student's and
  the teacher's log-probabilities ``s``, ``t``."""
  with np.errstate(invalid="ignore"):
    if beta == 0:  # F.kl_div(student_log_probs, teacher_log_probs, log_target=True)
      return _weighted(xp.exp(t), t - s, xp)
    if beta == 1:  # F.kl_div(teacher_log_probs, student_log_probs, log_target=True)
      return _weighted(xp.exp(s), s - t, xp)
    # mixture_log_probs = logsumexp(stack([s + log1p(-beta), t + log(beta)]))
    mixture = xp.logaddexp(s + xp.log1p(-beta), t + xp.log(beta))
    kl_teacher = _weighted(xp.exp(t), t - mixture, xp)
    kl_student = _weighted(xp.exp(s), s - mixture, xp)
    return beta * kl_teacher + (1 - beta) * kl_student


def ref_jsd(student, teacher, temperature=1.0, beta=0.5, xp=np):
  """TRL's generalized_jsd_loss (reduction='none', summed over the vocabulary)."""
  s, t, _, _ = _logs(student, teacher, temperature, xp)
  return xp.sum(_trl_jsd_terms(s, t, beta, xp), axis=-1)


def ref_alpha_beta(student, teacher, temperature=1.0, alpha=0.5, beta=0.5, xp=np):
  """ABKD's ab_div, general branch; Cichocki et al.'s closed forms at the limits."""
  _, _, q, p = _logs(student, teacher, temperature, xp)
  a, b = alpha, beta
  if a == 0 and b == 0:
    terms = 0.5 * (xp.log(p) - xp.log(q)) ** 2
  elif a == 0:
    terms = (q**b * xp.log(q**b / p**b) - q**b + p**b) / b**2
  elif b == 0:
    terms = (p**a * xp.log(p**a / q**a) - p**a + q**a) / a**2
  elif a + b == 0:
    terms = (xp.log(q**a / p**a) + (q**a / p**a) ** -1 - 1) / a**2
  else:
    terms = -(p**a * q**b - a / (a + b) * p ** (a + b) - b / (a + b) * q ** (a + b)) / (a * b)
  return xp.sum(terms, axis=-1)


REFERENCES = {
  "forward_kl": ref_forward_kl,
  "reverse_kl": ref_reverse_kl,
  "jsd": ref_jsd,
  "symmetric_kl": ref_symmetric_kl,
  "skew_kl": ref_skew_kl,
  "skew_reverse_kl": ref_skew_reverse_kl,
  "tvd": ref_tvd,
  "alpha_beta": ref_alpha_beta,
}


def np_divergence_terms(name: str, params: dict[str, float], lp: np.ndarray, lq: np.ndarray):
  """``(f, a, b)`` per class in float64: the term, ``p df/dp`` and ``q df/dq``.

  ``p`` is the teacher's distribution, ``q`` the student's; finite logits, so
  every probability is positive.
  """
  p, q = np.exp(lp), np.exp(lq)
  if name == "forward_kl":
    f = p * (lp - lq)
    return f, f + p, -p
  if name == "reverse_kl":
    f = q * (lq - lp)
    return f, -q, f + q
  if name == "symmetric_kl":
    lam = params["lam"]
    fwd, rev = (
      np_divergence_terms("forward_kl", {}, lp, lq),
      np_divergence_terms("reverse_kl", {}, lp, lq),
    )
    return tuple((1 - lam) * x + lam * y for x, y in zip(fwd, rev))
  if name == "jsd":  # m = beta p + (1 - beta) q; df/dp = beta log(p/m), df/dq = (1-beta) log(q/m)
    beta = params["beta"]
    lm = np.logaddexp(lp + np.log(beta), lq + np.log1p(-beta))
    a, b = beta * p * (lp - lm), (1 - beta) * q * (lq - lm)
    return a + b, a, b
  if name == "skew_kl":  # f = p log(p/m), m = alpha p + (1 - alpha) q
    alpha = params["alpha"]
    lm = np.logaddexp(lp + np.log(alpha), lq + np.log1p(-alpha))
    f = p * (lp - lm)
    pq_m = (1 - alpha) * p * np.exp(lq - lm)  # (1 - alpha) p q / m
    return f, f + pq_m, -pq_m
  if name == "skew_reverse_kl":  # f = q log(q/m), m = (1 - alpha) p + alpha q
    alpha = params["alpha"]
    lm = np.logaddexp(lp + np.log1p(-alpha), lq + np.log(alpha))
    f = q * (lq - lm)
    pq_m = (1 - alpha) * q * np.exp(lp - lm)
    return f, -pq_m, f + pq_m
  if name == "tvd":  # the subgradient sign(0) = 0 where p = q
    sign = np.sign(p - q)
    return 0.5 * np.abs(p - q), 0.5 * p * sign, -0.5 * q * sign
  if name == "alpha_beta":  # -(p^a q^b - a/(a+b) p^(a+b) - b/(a+b) q^(a+b)) / (a b)
    al, be = params["alpha"], params["beta"]
    pq = np.exp(al * lp + be * lq)
    pp, qq = np.exp((al + be) * lp), np.exp((al + be) * lq)
    f = -(pq - al / (al + be) * pp - be / (al + be) * qq) / (al * be)
    return f, -(pq - pp) / be, -(pq - qq) / al
  raise ValueError(name)


def np_divergence_value_and_grads(name: str, params: dict[str, float], z, y, temperature: float):
  """Float64 ``(value [rows], grad wrt z, grad wrt y, H(p) [rows], H(q) [rows])`` of the
  divergence ``name`` (:func:`np_divergence_terms`), gradients in closed form: ``dD/dz = (b -
  q sum b) / T`` with ``b = q df/dq`` per class, ``dD/dy`` likewise with ``a = p df/dp``
  (``benchmarks/bench_precision.py`` measures against it)."""
  lq = np_log_softmax(np.asarray(z, np.float64) / temperature)
  lp = np_log_softmax(np.asarray(y, np.float64) / temperature)
  p, q = np.exp(lp), np.exp(lq)
  f, a, b = np_divergence_terms(name, params, lp, lq)
  gz = (b - q * np.sum(b, -1, keepdims=True)) / temperature
  gy = (a - p * np.sum(a, -1, keepdims=True)) / temperature
  return np.sum(f, -1), gz, gy, -np.sum(p * lp, -1), -np.sum(q * lq, -1)


def _trl_divergence(direction, beta):
  """``(name, params)`` of a KL ``direction`` or, with ``beta``, of TRL's generalized JSD
  (``beta`` 0 and 1 are TRL's endpoints, forward and reverse KL)."""
  if beta is None or beta in (0, 1):
    forward = direction == "forward" if beta is None else beta == 0
    return ("forward_kl" if forward else "reverse_kl"), {}
  return "jsd", {"beta": beta}


def np_logits_value_and_grads(z, y, weights, temperature=1.0, *, direction="forward", beta=None):
  """``(divergence, grad_z, grad_y)`` of ``sum(weights * divergence)``: the forward or reverse
  KL (``direction``) or, with ``beta``, TRL's generalized JSD; the value from the authors'
  formula (:data:`REFERENCES`), the gradients in closed form
  (:func:`np_divergence_value_and_grads`). ``weights`` has the rows' shape."""
  name, params = _trl_divergence(direction, beta)
  _, gz, gy, _, _ = np_divergence_value_and_grads(name, params, z, y, temperature)
  w = np.asarray(weights, np.float64)[..., None]
  return REFERENCES[name](z, y, temperature, **params), w * gz, w * gy


def np_topk_log_probs(z, ids, lp, temperature=1.0, tail="renormalize", floor=0.0):
  """float64 ``(log_q, log_p)`` ``[rows, k + 1]`` of a top-k teacher (distinct ids ``[rows,
  k]``, log-probabilities ``lp``, all with mass) and a student's logits ``z``: the ``k``
  classes and the tail, both tails from log-sum-exps (the student's over the logits outside
  the top-k, the teacher's as ``log1p(-sum p)``), never from ``1 - sum q`` in the working
  precision; ``-inf`` for an empty tail. ``tail="bucket"``: the teacher as stored and the
  temperature on the student only; ``"renormalize"``: the teacher's softmax of ``lp / T``
  over the top-k and no tail. ``floor`` (bucket): both tails as TRL's ``add_tail_bucket``
  (``trl/experimental/sdpo/loss_utils.py``) computes them, the top-k's log-mass clamped at
  ``-floor`` before ``log(-expm1(.))``."""
  z = np.asarray(z, np.float64) / temperature
  ids, lp = np.asarray(ids), np.asarray(lp, np.float64)
  lse = np.logaddexp.reduce(z, axis=-1, keepdims=True)
  outside = np.ones(z.shape, bool)
  np.put_along_axis(outside, ids, False, axis=-1)
  with np.errstate(divide="ignore"):
    tail_lse = np.logaddexp.reduce(np.where(outside, z, -np.inf), axis=-1, keepdims=True)
    log_q = np.concatenate([np.take_along_axis(z, ids, -1), tail_lse], -1) - lse
    if tail == "bucket" and floor > 0:  # TRL's add_tail_bucket on both sides

      def add_tail_bucket(log_probs):
        log_s = np.minimum(np.logaddexp.reduce(log_probs, axis=-1, keepdims=True), -floor)
        return np.concatenate([log_probs, np.log(-np.expm1(log_s))], -1)

      log_q, log_p = add_tail_bucket(log_q[:, :-1]), add_tail_bucket(lp)
    elif tail == "bucket":
      p_tail = -np.expm1(np.logaddexp.reduce(lp, axis=-1, keepdims=True))
      log_p = np.concatenate([lp, np.log(p_tail)], -1)
    else:
      log_p = np.concatenate(
        [np_log_softmax(lp / temperature), np.full_like(tail_lse, -np.inf)], -1
      )
  return log_q, log_p


def np_topk_divergence(name, params, z, ids, lp, temperature=1.0, tail="renormalize", floor=0.0):
  """float64 per-row divergence of :func:`np_topk_log_probs`' classes from the authors'
  formula (:data:`REFERENCES`); ``+inf`` where the student has mass the teacher lacks and the
  divergence charges it (a class without mass enters as a log-probability of ``-1e300``)."""
  log_q, log_p = np_topk_log_probs(z, ids, lp, temperature, tail, floor)
  out = REFERENCES[name](np.maximum(log_q, -1e300), np.maximum(log_p, -1e300), 1.0, **params)
  return np.where(np.abs(out) > 1e200, np.inf, out)


def ab_decimal(student, teacher, temperature, alpha, beta, digits=80):
  """ABKD's general ``ab_div`` branch in ``digits``-digit decimal arithmetic, per row.

  ``alpha``, ``beta`` may be ``decimal.Decimal`` (e.g. ``1e-20`` off a limit,
  where float64 would cancel to nothing). Slow: for a few short rows.
  """
  with decimal.localcontext() as ctx:
    ctx.prec = digits
    a, b = decimal.Decimal(alpha), decimal.Decimal(beta)
    out = []
    for z, y in zip(np.atleast_2d(student), np.atleast_2d(teacher)):
      lq = _decimal_log_softmax(z, temperature)
      lp = _decimal_log_softmax(y, temperature)
      total = decimal.Decimal(0)
      for u, v in zip(lq, lp):
        term = (a * v + b * u).exp() - a / (a + b) * ((a + b) * v).exp()
        term -= b / (a + b) * ((a + b) * u).exp()
        total += -term / (a * b)
      out.append(total)
    return out


def _decimal_log_softmax(x, temperature):
  t = decimal.Decimal(temperature)
  xs = [decimal.Decimal(float(v)) / t for v in x]
  m = max(xs)
  log_sum = sum((v - m).exp() for v in xs).ln()
  return [v - m - log_sum for v in xs]


# ------------------------------------------------------------------ float64 NumPy: other losses


def np_pointwise(x, t, log_target=False):
  """torch's ``kl_div`` terms, 0 at zero mass (``t = 0``, or ``-inf`` with log targets)."""
  x, t = np.broadcast_arrays(np.asarray(x, np.float64), np.asarray(t, np.float64))
  with np.errstate(all="ignore"):
    if log_target:
      return np.where((t == -INF) & (x < INF), 0.0, np.exp(t) * (t - x))
    return np.where((t == 0) & (x < INF), 0.0, t * (np.log(t) - x))


def np_distillation(
  s, t, labels, *, temperature, alpha, divergence, beta=0.5, scale=True, valid=None
):
  """Hinton's distillation loss and its gradients wrt ``s`` and ``t`` (float64).

  As PyTorch training code writes it (:func:`torch_distillation`): the
  divergence at temperature ``T`` (times ``T**2`` with ``scale``), mixed with
  the cross entropy at temperature 1 (``ignore_index = -100``) as
  ``alpha div + (1 - alpha) ce``, averaged over the valid tokens.
  """
  s, t = np.asarray(s, np.float64), np.asarray(t, np.float64)
  t2 = temperature**2 if scale else 1.0
  rows = np.broadcast_shapes(s.shape, t.shape)[:-1]
  valid = np.ones(rows, bool) if valid is None else np.asarray(valid, bool)
  if labels is not None:
    labels = np.asarray(labels)
    valid = valid & (labels != -100)
  count = max(int(valid.sum()), 1)
  w = valid / count
  div_weight = t2 if labels is None else alpha * t2
  div, gs, gt = np_logits_value_and_grads(
    s, t, w * div_weight, temperature,
    direction="reverse" if divergence == "reverse_kl" else "forward",
    beta=beta if divergence == "jsd" else None,
  )  # fmt: skip
  if labels is None:
    per_token = div * t2
  else:
    safe = np.where(valid, labels, 0)
    log_q1 = np_log_softmax(s)
    ce = -np.take_along_axis(log_q1, safe[..., None], -1)[..., 0]
    per_token = alpha * div * t2 + (1 - alpha) * ce
    one_hot = np.eye(s.shape[-1])[safe]
    gs = gs + (w * (1 - alpha))[..., None] * (np.exp(log_q1) - one_hot)
  value = np.sum(np.where(valid, per_token, 0.0)) / count
  return value, gs, gt


def np_gaussian_kl(mean, log_var, prior_mean=0.0, prior_log_var=0.0, axis=-1):
  """``KL(N(mean, e^log_var) || N(prior_mean, e^prior_log_var))``, summed over ``axis``.

  The textbook closed form ``log(s0 / s) + (s^2 + (m - m0)^2) / (2 s0^2) - 1/2``.
  """
  m, lv, m0, lv0 = (np.asarray(a, np.float64) for a in (mean, log_var, prior_mean, prior_log_var))
  terms = 0.5 * (lv0 - lv) + (np.exp(lv) + (m - m0) ** 2) / (2 * np.exp(lv0)) - 0.5
  return terms.sum(axis)


def np_trl_generalized_jsd_loss(
  student_logits,
  teacher_logits,
  labels=None,
  beta=0.5,
  temperature=1.0,
  reduction="batchmean",
  num_items_in_batch=None,
):
  """TRL's ``GKDTrainer.generalized_jsd_loss``, every reduction, in float64.

  Ported from huggingface/trl, ``trl/experimental/gkd/gkd_trainer.py`` at main
  f2cd577 (1.10.0.dev0, 2026-07-24; the same function as v1.7.0 to v1.9.0): the
  elementwise ``F.kl_div`` terms ``[..., V]``, the tokens whose label is -100
  dropped (``jsd[mask]``), then ``num_items_in_batch`` (``sum / n``) or
  ``reduction``: ``'batchmean'`` is ``sum / max(valid tokens, 1)`` with
  labels and ``sum / shape[0]`` without (TRL >= 0.24; up to 0.23, ``sum / (B
  S)``), ``'sum'``, ``'mean'`` (over every element, classes included), or
  ``'none'`` (the elementwise terms). No ``T**2`` factor.
  """
  s = np_log_softmax(np.asarray(student_logits, np.float64) / temperature)
  t = np_log_softmax(np.asarray(teacher_logits, np.float64) / temperature)
  jsd = _trl_jsd_terms(s, t, beta, np)
  if labels is not None:
    mask = np.asarray(labels) != -100
    jsd = jsd[mask]
  if num_items_in_batch is not None:
    return jsd.sum() / num_items_in_batch
  if reduction == "batchmean":
    denom = max(int(mask.sum()), 1) if labels is not None else max(jsd.shape[0], 1)
    return jsd.sum() / denom
  if reduction == "sum":
    return jsd.sum()
  if reduction == "mean":
    return jsd.mean()
  return jsd


def np_torch_batchmean_distillation(student_logits, teacher_logits, temperature):
  """torch's distillation recipe in float64: ``F.kl_div(F.log_softmax(s / T, -1),
  F.softmax(t / T, -1), reduction="batchmean") * T**2``, the sum over every token / ``shape[0]``."""
  kl = ref_forward_kl(student_logits, teacher_logits, temperature)
  return kl.sum() / np.shape(student_logits)[0] * temperature**2


# verl's kl_penalty (verl-project/verl, verl/trainer/ppo/core_algos.py: kl_penalty and
# kl_penalty_forward, identical at tag v0.9.0 (483b8a0) and main 1dda039 of 2026-08-22,
# 0.10.0.dev; no v0.9.1 tag was stored). Its modes and verl's "k1"/"k2"/"k3" aliases.
VERL_KL_PENALTIES = ("kl", "abs", "mse", "low_var_kl", "k1", "k2", "k3")


def np_verl_kl_penalty(logprob, ref_logprob, kl_penalty):
  """verl's ``kl_penalty(logprob, ref_logprob, kl_penalty)`` in float64, and its gradient.

  Returns ``(value, grad)``, ``grad`` the derivative wrt ``logprob`` (wrt
  ``ref_logprob`` it is ``-grad``), by hand with torch's autograd conventions:
  ``clamp`` passes the gradient where ``min <= x <= max`` (bounds included),
  ``abs`` has gradient ``sign`` (0 at 0). A ``+`` suffix is stripped for the
  forward score, and the gradient is then that of ``0.5 (logprob - ref)**2``.
  """
  logprob, ref = np.broadcast_arrays(
    np.asarray(logprob, np.float64), np.asarray(ref_logprob, np.float64)
  )
  base = kl_penalty[:-1] if kl_penalty.endswith("+") else kl_penalty
  delta = logprob - ref
  with np.errstate(all="ignore"):
    if base in ("kl", "k1"):
      value, grad = delta, np.ones_like(delta)
    elif base == "abs":
      value, grad = np.abs(delta), np.sign(delta)
    elif base in ("mse", "k2"):
      value, grad = 0.5 * np.square(delta), delta
    elif base in ("low_var_kl", "k3"):
      kl = ref - logprob
      inner = (kl >= -20) & (kl <= 20)
      kl = np.clip(kl, -20, 20)
      ratio = np.exp(kl)
      kld = ratio - kl - 1
      outer = (kld >= -10) & (kld <= 10)
      value = np.clip(kld, -10, 10)
      grad = np.where(inner & outer, -(ratio - 1), 0.0)  # d kl / d logprob = -1
    else:
      raise NotImplementedError(kl_penalty)
    if kl_penalty.endswith("+") and kl_penalty not in ("mse", "k2"):
      backward = 0.5 * np.square(delta)
      value, grad = backward - backward + value, delta
  return value, grad


# ------------------------------------------------------------------ torch (live)


def torch_kl_from_logits(z, y, temperature, direction):
  """Hinton's distillation KL in torch: ``log_softmax`` + ``F.kl_div(log_target=True)``."""
  import torch.nn.functional as F

  lq = F.log_softmax(z / temperature, dim=-1)
  lp = F.log_softmax(y / temperature, dim=-1)
  if direction == "forward":
    return F.kl_div(lq, lp, reduction="none", log_target=True).sum(-1)
  return F.kl_div(lp, lq, reduction="none", log_target=True).sum(-1)


def torch_trl_gjsd(student, teacher, beta, temperature):
  """TRL's ``generalized_jsd_loss`` (torch), per token."""
  import torch
  import torch.nn.functional as F

  s = F.log_softmax(student / temperature, dim=-1)
  t = F.log_softmax(teacher / temperature, dim=-1)
  if beta == 0:
    jsd = F.kl_div(s, t, reduction="none", log_target=True)
  elif beta == 1:
    jsd = F.kl_div(t, s, reduction="none", log_target=True)
  else:
    b = torch.tensor(beta, dtype=s.dtype)
    mixture = torch.logsumexp(torch.stack([s + torch.log1p(-b), t + torch.log(b)]), dim=0)
    kl_t = F.kl_div(mixture, t, reduction="none", log_target=True)
    kl_s = F.kl_div(mixture, s, reduction="none", log_target=True)
    jsd = b * kl_t + (1 - b) * kl_s
  return jsd.sum(-1)


def torch_logits_value_and_grads(z, y, weights, temperature=1.0, *, direction="forward", beta=None):
  """:func:`np_logits_value_and_grads` by torch autograd: ``(value, grad_z, grad_y)``."""
  import torch

  zt = torch.tensor(z, dtype=torch.float64, requires_grad=True)
  yt = torch.tensor(y, dtype=torch.float64, requires_grad=True)
  if beta is None:
    out = torch_kl_from_logits(zt, yt, temperature, direction)
  else:
    out = torch_trl_gjsd(zt, yt, beta, temperature)
  (out * torch.tensor(weights, dtype=torch.float64)).sum().backward()
  return out.detach().numpy(), zt.grad.numpy(), yt.grad.numpy()


def torch_distillation(
  s, t, labels, *, temperature, alpha, divergence, beta=0.5, scale=True, valid=None
):
  """:func:`np_distillation` as PyTorch training code writes it, by torch autograd."""
  import torch
  import torch.nn.functional as F

  st = torch.tensor(s, dtype=torch.float64, requires_grad=True)
  tt = torch.tensor(t, dtype=torch.float64, requires_grad=True)
  if divergence == "jsd":
    div = torch_trl_gjsd(st, tt, beta, temperature)
  else:
    direction = "forward" if divergence == "forward_kl" else "reverse"
    div = torch_kl_from_logits(st, tt, temperature, direction)
  if scale:
    div = div * temperature**2
  valid = torch.ones(div.shape, dtype=torch.bool) if valid is None else torch.tensor(valid)
  if labels is None:
    per_token = div
  else:
    lt = torch.tensor(np.asarray(labels), dtype=torch.int64)
    ce = F.cross_entropy(
      st.reshape(-1, st.shape[-1]), lt.reshape(-1), ignore_index=-100, reduction="none"
    ).reshape(lt.shape)
    per_token = alpha * div + (1 - alpha) * ce
    valid = valid & (lt != -100)
  out = per_token[valid].sum() / valid.sum().clamp_min(1)
  out.backward()
  return out.item(), st.grad.numpy(), tt.grad.numpy()


def torch_gaussian_kl(mean, log_var, prior_mean=0.0, prior_log_var=0.0, axis=-1):
  """``torch.distributions``' closed form, summed over ``axis``."""
  import torch

  t = [torch.tensor(np.asarray(a, np.float64)) for a in (mean, log_var, prior_mean, prior_log_var)]
  q = torch.distributions.Normal(t[0], torch.exp(0.5 * t[1]))
  p = torch.distributions.Normal(t[2], torch.exp(0.5 * t[3]))
  return torch.distributions.kl_divergence(q, p).sum(axis).numpy()


def torch_trl_generalized_jsd_loss(
  student_logits,
  teacher_logits,
  labels=None,
  beta=0.5,
  temperature=1.0,
  reduction="batchmean",
  num_items_in_batch=None,
):
  """:func:`np_trl_generalized_jsd_loss` as TRL writes it, in torch float64 (trl not imported)."""
  import torch
  import torch.nn.functional as F

  student_logits = torch.tensor(np.asarray(student_logits, np.float64)) / temperature
  teacher_logits = torch.tensor(np.asarray(teacher_logits, np.float64)) / temperature
  student_log_probs = F.log_softmax(student_logits, dim=-1)
  teacher_log_probs = F.log_softmax(teacher_logits, dim=-1)
  if beta == 0:
    jsd = F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True)
  elif beta == 1:
    jsd = F.kl_div(teacher_log_probs, student_log_probs, reduction="none", log_target=True)
  else:
    beta = torch.tensor(beta, dtype=student_log_probs.dtype)
    mixture_log_probs = torch.logsumexp(
      torch.stack([student_log_probs + torch.log1p(-beta), teacher_log_probs + torch.log(beta)]),
      dim=0,
    )
    kl_teacher = F.kl_div(mixture_log_probs, teacher_log_probs, reduction="none", log_target=True)
    kl_student = F.kl_div(mixture_log_probs, student_log_probs, reduction="none", log_target=True)
    jsd = beta * kl_teacher + (1 - beta) * kl_student
  if labels is not None:
    mask = torch.tensor(np.asarray(labels)) != -100
    jsd = jsd[mask]
  if num_items_in_batch is not None:
    return (jsd.sum() / num_items_in_batch).numpy()
  if reduction == "batchmean":
    denom = mask.sum().clamp_min(1) if labels is not None else max(jsd.size(0), 1)
    return (jsd.sum() / denom).numpy()
  if reduction == "sum":
    return jsd.sum().numpy()
  if reduction == "mean":
    return jsd.mean().numpy()
  return jsd.numpy()


def torch_batchmean_distillation(student_logits, teacher_logits, temperature):
  """:func:`np_torch_batchmean_distillation` in torch (float64)."""
  import torch
  import torch.nn.functional as F

  s = torch.tensor(np.asarray(student_logits, np.float64))
  t = torch.tensor(np.asarray(teacher_logits, np.float64))
  kl = F.kl_div(
    F.log_softmax(s / temperature, dim=-1),
    F.softmax(t / temperature, dim=-1),
    reduction="batchmean",
  )
  return (kl * temperature**2).numpy()


def torch_verl_kl_penalty(logprob, ref_logprob, kl_penalty):
  """:func:`np_verl_kl_penalty` by torch autograd: verl's code as written, float64."""
  import torch

  lp = torch.tensor(np.asarray(logprob, np.float64), requires_grad=True)
  ref = torch.tensor(np.asarray(ref_logprob, np.float64), requires_grad=True)
  base = kl_penalty[:-1] if kl_penalty.endswith("+") else kl_penalty
  if base in ("kl", "k1"):
    forward = lp - ref
  elif base == "abs":
    forward = (lp - ref).abs()
  elif base in ("mse", "k2"):
    forward = 0.5 * (lp - ref).square()
  elif base in ("low_var_kl", "k3"):
    kl = torch.clamp(ref - lp, min=-20, max=20)
    forward = torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
  else:
    raise NotImplementedError(kl_penalty)
  out = forward
  if kl_penalty.endswith("+") and kl_penalty not in ("mse", "k2"):
    backward = 0.5 * (lp - ref).square()
    out = backward - backward.detach() + forward.detach()
  out.sum().backward()
  return out.detach().numpy(), lp.grad.numpy()


# Each reference by source: the ``source`` fixture (conftest.py) picks one.
LOGITS = {"numpy": np_logits_value_and_grads, "torch": torch_logits_value_and_grads}
DISTILLATION = {"numpy": np_distillation, "torch": torch_distillation}
GAUSSIAN_KL = {"numpy": np_gaussian_kl, "torch": torch_gaussian_kl}
VERL_KL = {"numpy": np_verl_kl_penalty, "torch": torch_verl_kl_penalty}
TRL_JSD_LOSS = {"numpy": np_trl_generalized_jsd_loss, "torch": torch_trl_generalized_jsd_loss}
TORCH_BATCHMEAN = {"numpy": np_torch_batchmean_distillation, "torch": torch_batchmean_distillation}


# Compilations counted by one listener registered for the whole session: jax.monitoring has
# no way to unregister a listener before jax 0.8 (the floor is 0.7.0). The event times JAX's
# whole compile step, so an executable loaded from the persistent compilation cache
# (conftest.py) counts too: the program was traced and lowered again.
_COMPILE_COUNTERS: list[list[str]] = []
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _on_event_duration(event: str, duration: float, **kwargs) -> None:
  if event == _COMPILE_EVENT:
    for counter in _COMPILE_COUNTERS:
      counter.append(event)


jax.monitoring.register_event_duration_secs_listener(_on_event_duration)


@contextlib.contextmanager
def count_compiles():
  """A list that collects one entry per XLA compilation made inside the ``with`` block."""
  compiles: list[str] = []
  _COMPILE_COUNTERS.append(compiles)
  try:
    yield compiles
  finally:
    _COMPILE_COUNTERS.remove(compiles)


# XLA:CPU flags of every test process (conftest.py adds them to XLA_FLAGS), to compile
# faster: no LLVM optimisation, XLA's former loop emitters instead of its MLIR fusion
# emitters, and no folding of the constants that tests' closures embed (XLA folds them
# with its slow HLO evaluator). The library's program is the same; only its machine code
# differs. At jax 0.10.2 they take a third off the suite's CPU time. jaxlib 0.11 has no loop
# emitters left, and aborts the process on the flag that chose them (an unknown XLA flag).
_JAXLIB = tuple(int(x) for x in importlib.metadata.version("jaxlib").split(".")[:2])
_LOOP_EMITTERS = _JAXLIB < (0, 11)
XLA_TEST_FLAGS = (
  "--xla_backend_optimization_level=0",
  *(("--xla_cpu_use_fusion_emitters=false",) if _LOOP_EMITTERS else ()),
  "--xla_disable_hlo_passes=constant_folding",
)


def add_xla_test_flags():
  """Adds :data:`XLA_TEST_FLAGS` to ``XLA_FLAGS`` (before JAX starts its CPU backend, which
  reads them once; subprocesses inherit them)."""
  flags = f"{os.environ.get('XLA_FLAGS', '')} {' '.join(XLA_TEST_FLAGS)}"
  os.environ["XLA_FLAGS"] = flags.strip()


# ``jax.jit(..., compiler_options=DEFAULT_CODEGEN)``: the program compiled as XLA compiles it
# by default, for a test of bit-level numerics (summation order and vector width follow the
# emitters).
DEFAULT_CODEGEN = {
  "xla_backend_optimization_level": 3,
  **({"xla_cpu_use_fusion_emitters": True} if _LOOP_EMITTERS else {}),
  "xla_disable_hlo_passes": "",
}


@contextlib.contextmanager
def fresh_compilations():
  """Inside the block, every compilation is made by XLA: none is loaded from the session's
  persistent compilation cache (conftest.py)."""
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()  # JAX decides once whether the cache is used
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.reset_cache()


# The trace-context value of each replaced ``lax.platform_dependent`` (:func:`platform_branch`).
_BRANCH_TRACES = {
  "default": 1_000_001,
  "cuda": 1_000_002,
  "tpu kernel": 1_000_003,
  "cpu": 1_000_004,
}


@contextlib.contextmanager
def platform_branch(platform: str = "default"):
  """Inside the block every ``lax.platform_dependent`` takes the branch of ``platform``
  (``"default"``: the non-CPU one, TPU's; ``"cuda"``: XLA:GPU's where a call has one): the
  GPU/TPU code run on CPU. ``"cpu"``: the CPU branch alone, traced without the others (a
  jaxpr of one platform's program).

  The kernels are ``jax.jit`` functions whose traces JAX caches by the trace context. Inside
  the block that context holds a value of its own, so no trace made for one branch serves
  another, and the caches need no clearing (which made every later test trace afresh):
  ``jax_pgle_profiling_runs``, which nothing reads while profile-guided latency estimation
  (a GPU option) is off. The class sums are traced as for CPU (``_sums.cpu_sums``): XLA:CPU
  runs the accelerator code here, and sums long rows precisely only as a tree.
  """
  from kldiv_jax._sums import cpu_sums

  def branch(*args, default, **per_platform):
    return (default if platform == "default" else per_platform.get(platform, default))(*args)

  saved, runs = jax.lax.platform_dependent, jax.config.jax_pgle_profiling_runs
  assert not jax.config.jax_enable_pgle
  jax.config.update("jax_pgle_profiling_runs", _BRANCH_TRACES[platform])
  jax.lax.platform_dependent = branch
  try:
    with cpu_sums():
      yield platform
  finally:
    jax.lax.platform_dependent = saved
    jax.config.update("jax_pgle_profiling_runs", runs)


# ----------------------------------------------------------------- sharded vs unsharded

COLLECTIVE_RE = re.compile(
  r"=\s*(\(?[a-z0-9]+\[[^=]*?)\s+(all-gather|all-reduce|all-to-all|collective-permute|"
  r"reduce-scatter|all-gather-start|all-reduce-start|collective-broadcast)\("
)


def compare_finite(got, ref, atol=1e-6, rtol=1e-5):
  """(max error over finite entries in units of ``atol + rtol |ref|``, whether the
  non-finite entries match)."""
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  finite = np.isfinite(ref)
  match = bool(np.array_equal(np.isfinite(got), finite)) and bool(
    np.array_equal(got[~finite], ref[~finite], equal_nan=True)
  )
  if not finite.any():
    return 0.0, match
  err = np.abs(got[finite] - ref[finite]) / (atol + rtol * np.abs(ref[finite]))
  return float(np.nanmax(np.where(np.isnan(err), np.inf, err))), match


def collectives(hlo_text):
  """``[op, result shape]`` of every collective in a compiled program's HLO text."""
  return [[m.group(2), m.group(1).strip()] for m in COLLECTIVE_RE.finditer(hlo_text)]


# ----------------------------------------------------------------- optimised HLO, read

_HLO_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+) \(.*\{\s*$")
_HLO_INSTR = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+) = (.*)$")


def _hlo_instruction(rest):
  """``(opcode, operand names, called computation, number, size)`` of an instruction's text
  after ``=``; the number: a parameter's, or a ``get-tuple-element``'s index; the size: its
  element count (``None`` for a tuple)."""
  m = re.search(r" ([a-z][a-z0-9\-]*)\(", rest)
  if m is None:
    return None, [], None, None, None
  depth, i = 1, m.end()
  while depth and i < len(rest):
    depth += {"(": 1, ")": -1}.get(rest[i], 0)
    i += 1
  args, attrs = rest[m.end() : i - 1], rest[i:]
  calls = re.search(r"calls=%([\w.\-]+)", attrs)
  index = re.search(r"index=(\d+)", attrs)
  number = int(args) if m.group(1) == "parameter" else index and int(index.group(1))
  dims = re.fullmatch(r"\s*[a-z0-9]+\[([\d,]*)\](?:\{[^}]*\})?\s*", rest[: m.start()])
  size = dims and int(np.prod([int(d) for d in dims.group(1).split(",") if d]))
  return m.group(1), re.findall(r"%([\w.\-]+)", args), calls and calls.group(1), number, size


def hlo_graph(hlo_text):
  """``({computation: {instruction: (opcode, operands, called, number, size)}},
  {computation: its root})`` of an optimised module's text (``compiled.as_text()``)."""
  comps, roots, cur = {}, {}, None
  for line in hlo_text.splitlines():
    header = _HLO_HEADER.match(line)
    if header:
      cur = header.group(1)
      comps[cur] = {}
      continue
    m = _HLO_INSTR.match(line)
    if m and cur is not None:
      comps[cur][m.group(2)] = _hlo_instruction(m.group(3))
      if m.group(1):
        roots[cur] = m.group(2)
  return comps, roots


def shared_exponentials(hlo_text):
  """The exponentials of an optimised module that feed two operands of its reduces (one
  variadic reduce, or sibling reduces), each an operand's size: ``[(computation, name)]``.

  Followed through fusions (their roots, the tuple elements read), their parameters (the
  operands of the fusions calling them) and the other instructions' operands, not through
  an earlier reduce (its outputs are reduced values). XLA:GPU does not fuse an expensive
  producer read twice into a reduction, and writes it out: a temporary of the operands' size.
  """
  comps, roots = hlo_graph(hlo_text)
  callers: dict[str, list] = {}
  for cname, comp in comps.items():
    for op, args, called, _, _ in comp.values():
      if op == "fusion" and called:
        callers.setdefault(called, []).append((cname, args))

  def exps(cname, name, seen, out, element=None):
    key = (cname, name, element)
    if key in seen or name not in comps.get(cname, {}):
      return out
    seen.add(key)
    op, args, called, number, size = comps[cname][name]
    if op == "exponential":
      out.add((cname, name, size))
    if op == "reduce":  # reduced values (a two-stage row reduction's partials), not the exp
      return out
    if op == "parameter":
      for caller, operands in callers.get(cname, []):
        if number < len(operands):
          exps(caller, operands[number], seen, out)
    elif op == "get-tuple-element":
      exps(cname, args[0], seen, out, number)
    elif op == "tuple" and element is not None:
      exps(cname, args[element], seen, out)
    elif op == "fusion" and called:
      exps(called, roots[called], seen, out, element)
    else:
      for a in args:
        exps(cname, a, seen, out)
    return out

  readers: dict[tuple[str, str], int] = {}
  for cname, comp in comps.items():
    for op, args, _, _, _ in comp.values():
      if op != "reduce":
        continue
      for a in args[: len(args) // 2]:  # the operands, then their initial values
        size = comp[a][4] if a in comp else None
        for c, e, s in exps(cname, a, set(), set()):
          if s == size:
            readers[(c, e)] = readers.get((c, e), 0) + 1
  return sorted(e for e, k in readers.items() if k > 1)


def lm_inputs(rows, vocab, hidden, k, *, seed, scale):
  """Seeded float32 inputs of every language-model loss: ``s``/``t`` logits ``[rows, vocab]``
  (scale ``scale``), ``labels``, the teacher's top-``k`` ``idx``/``topk_lp``, and hidden
  states ``h``/``th`` ``[rows, hidden]`` with heads ``w``/``tw`` ``[hidden, vocab]``; ``rng``
  for more."""
  rng = np.random.default_rng(seed)
  f32 = lambda *shape, scale=1.0: (scale * rng.normal(size=shape)).astype(np.float32)  # noqa: E731
  s, t = f32(rows, vocab, scale=scale), f32(rows, vocab, scale=scale)
  t_log = np.asarray(jax.nn.log_softmax(t))
  idx = np.argsort(-t, axis=-1)[:, :k].astype(np.int32)
  out = {"s": s, "t": t, "log_p": t_log, "idx": idx}
  out["topk_lp"] = np.take_along_axis(t_log, idx, axis=-1)
  out["labels"] = rng.integers(0, vocab, size=rows).astype(np.int32)
  out.update(h=f32(rows, hidden), w=f32(hidden, vocab), th=f32(rows, hidden))
  out["tw"] = f32(hidden, vocab, scale=2.0)
  return out, rng


# ---------------------------------------------------------------------------
# Policy losses: verl's and TRL's code ported line by line to float64 NumPy.
# verl: volcengine/verl @ b178a3cd56f5 (0.8.0.dev, 2026-01-29),
#   verl/trainer/ppo/core_algos.py (agg_loss, compute_policy_loss_vanilla, _gspo,
#   _sapo, _gpg, _geo_mean, _cispo; kl_penalty_forward is np_verl_kl_penalty, above)
#   and rollout_corr_helper.py (compute_rollout_correction_weights);
#   compute_policy_loss_dppo_tv/_kl from the
#   registry of later verl (0.9 line), as indexed. Checked against verl-project/verl
#   release/v0.9.0 @ 88512193628b (0.9.0, 2026-08-20; no 0.9.1 was stored): the
#   surrogates above, kl_penalty_forward and the TIS weights are unchanged there;
#   agg_loss gained "token-sum" and its "seq-mean-token-sum-norm" became
#   "seq-mean-token-sum" / loss_scale_factor (verl #5366), ported below.
# TRL: huggingface/trl @ f2cd57710ae3 (1.10.0.dev0), trl/trainer/grpo_trainer.py
#   (GRPOTrainer._compute_loss; the vLLM importance-sampling ratio in
#   _generate_and_score_completions).
# ``.detach()`` is ported as an extra argument (``*_sg``, defaulting to the live
# value) so that finite differences in the live argument give autograd's gradient.
# ---------------------------------------------------------------------------


def _masked_mean(x, mask):
  return (x * mask).sum() / mask.sum()  # verl_F.masked_mean


def verl_agg_loss(loss_mat, mask, mode, global_batch_size=None, batch_num_tokens=None, scale=None):
  if mode == "token-mean":
    n = mask.sum() if batch_num_tokens is None else batch_num_tokens
    return (loss_mat * mask).sum() / n
  if mode == "seq-mean-token-mean":
    count = mask.sum(-1)
    seq = (loss_mat * mask).sum(-1) / (count + 1e-8)
    seq_mask = (count > 0).astype(float)
    n = seq_mask.sum() if global_batch_size is None else global_batch_size
    return (seq * seq_mask).sum() / n
  if mode == "token-sum":
    return (loss_mat * mask).sum()
  if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
    seq = (loss_mat * mask).sum(-1)
    seq_mask = (mask.sum(-1) > 0).astype(float)
    n = seq_mask.sum() if global_batch_size is None else global_batch_size
    loss = (seq * seq_mask).sum() / n
    if mode == "seq-mean-token-sum-norm":
      loss = loss / (mask.shape[-1] if scale is None else scale)
    return loss
  raise ValueError(mode)


def verl_policy_loss(
  name, old, logp, adv, mask, mode="token-mean", *, clip_low=0.2, clip_high=0.2, clip_c=3.0,
  taus=(1.0, 1.05), rollout_w=None, logp_sg=None, dro_beta=None,
):  # fmt: skip
  """``(loss, clipfrac, ppo_kl, clipfrac_lower)`` of verl's ``compute_policy_loss_<name>``."""
  sg = logp if logp_sg is None else logp_sg
  nakl = logp - old
  frac_lower = 0.0
  if name == "vanilla":
    nakl = np.clip(nakl, -20.0, 20.0)
    ratio = np.exp(nakl)
    l1 = -adv * ratio
    l2 = -adv * np.clip(ratio, 1 - clip_low, 1 + clip_high)
    c1 = np.maximum(l1, l2)
    frac = _masked_mean((l2 > l1).astype(float), mask)
    l3 = -adv * clip_c
    c2 = np.minimum(l3, c1)
    frac_lower = _masked_mean((c1 > l3) * (adv < 0).astype(float), mask)
    losses = np.where(adv < 0, c2, c1)
  elif name == "gspo":
    n = np.clip(mask.sum(-1), 1, None)
    seq = (nakl * mask).sum(-1) / n
    seq_sg = ((sg - old) * mask).sum(-1) / n
    log_s = np.minimum(logp - sg + seq_sg[:, None], 10.0)
    s = np.exp(log_s)
    l1, l2 = -adv * s, -adv * np.clip(s, 1 - clip_low, 1 + clip_high)
    losses = np.maximum(l1, l2)
    frac = _masked_mean((l2 > l1).astype(float), mask)
    mode = "seq-mean-token-mean"
    del seq
  elif name == "sapo":
    ratio = np.exp(np.clip(nakl, -20.0, 20.0))
    tau = np.where(adv > 0, taus[0], taus[1])
    losses = -(1 / (1 + np.exp(-tau * (ratio - 1.0))) * (4.0 / tau)) * adv
    frac, mode = 0.0, "seq-mean-token-mean"
  elif name == "gpg":
    losses, frac = -logp * adv, 0.0
  elif name == "dro":  # verl 0.9 (release/v0.9.0): compute_policy_loss_dro
    losses, frac = -(logp * adv - 0.5 * dro_beta * (logp - old) ** 2), 0.0
  elif name == "cispo":
    ratio = np.exp(np.clip(nakl, -20.0, 20.0))
    ratio_sg = np.exp(np.clip(sg - old, -20.0, 20.0))
    clipped_sg = np.clip(ratio_sg, 1 - clip_low, 1 + clip_high)
    losses = -clipped_sg * adv * logp
    frac = _masked_mean((ratio != np.clip(ratio, 1 - clip_low, 1 + clip_high)).astype(float), mask)
  elif name in ("dppo_tv", "dppo_kl"):
    ratio_sg = np.exp(np.clip(sg - old, -20.0, 20.0))
    trunc = np.minimum(ratio_sg, clip_c)
    p, p_old = np.exp(sg), np.exp(old)
    if name == "dppo_tv":
      pos, neg = (p - p_old) <= clip_high, (p - p_old) >= -clip_low
    else:
      bkl = p_old * (old - sg) + (1 - p_old) * np.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
      pos, neg = (bkl <= clip_high) | (p <= p_old), (bkl <= clip_low) | (p >= p_old)
    valid = np.where(adv > 0, pos, neg).astype(float)
    losses = -adv * trunc * logp * valid
    frac = _masked_mean(1.0 - valid, mask)
    frac_lower = _masked_mean((ratio_sg > clip_c) * valid, mask)
  elif name == "geo_mean":
    sgn = np.sign(adv)
    clamp = np.clip(nakl, -clip_low, clip_high)
    kmin = sgn * np.minimum(sgn * nakl, sgn * clamp)
    msum = mask.sum(-1)
    ratio = np.exp((kmin * mask).sum(-1) / (msum + 1e-8))
    advantage = (adv * mask).sum(-1) / (msum + 1e-8)
    loss = np.mean(-advantage * ratio)
    clipped = nakl != clamp
    frac = _masked_mean((clipped * (adv > 0)).astype(float), mask)
    frac_lower = _masked_mean((clipped * (adv < 0)).astype(float), mask)
    return loss, frac, _masked_mean(-nakl, mask), frac_lower
  else:
    raise ValueError(name)
  if rollout_w is not None:
    losses = losses * rollout_w
  ppo_kl = _masked_mean(-np.clip(nakl, -20.0, 20.0) if name not in ("gspo", "dro") else -nakl, mask)
  return verl_agg_loss(losses, mask, mode), frac, ppo_kl, frac_lower


def verl_rollout_is_weights(old, rollout, mask, level, threshold):
  """verl's ``compute_rollout_correction_weights`` (no batch normalisation): a float
  ``threshold`` is TIS (clamped above), a ``"lower_upper"`` string IcePop (verl 0.9: weights
  outside ``[lower, upper]`` zeroed, the others kept)."""
  log_ratio = old - rollout
  if level == "token":
    w = np.exp(np.clip(log_ratio, -20.0, 20.0))
  else:
    s = (log_ratio * mask).sum(-1, keepdims=True)
    w = np.broadcast_to(np.exp(np.clip(s, -20.0, 20.0)), log_ratio.shape)
  w = w * mask
  if isinstance(threshold, str):
    lower, upper = (float(x) for x in threshold.split("_", 1))
    return np.where((w >= lower) & (w <= upper), w, 0.0)
  return np.minimum(w, threshold)


def trl_vllm_is_ratio(old, sampling, mask, mode, clip_min=None, clip_max=3.0):
  """TRL's ``importance_sampling_ratio`` (``vllm_importance_sampling_mode``), ``(B, T)`` or ``(B, 1)``."""
  diff = (old - sampling) * mask
  if mode.startswith("sequence"):
    diff = diff.sum(-1, keepdims=True)
  r = np.exp(diff)
  if mode.endswith("truncate"):
    return np.clip(r, clip_min, clip_max)
  lo = -np.inf if clip_min is None else clip_min
  hi = np.inf if clip_max is None else clip_max
  return np.where((r < lo) | (r > hi), 0.0, r)


def trl_grpo_loss(
  loss_type, logp, old, adv, mask, *, eps_low=0.2, eps_high=0.2, delta=None, level="token",
  beta=0.0, ref=None, bias_kl=False, is_ratio=None, max_completion_length=None,
  num_items_in_batch=None, temps=(1.0, 1.05), logp_sg=None,
):  # fmt: skip
  """TRL's ``GRPOTrainer._compute_loss`` (one process, no accumulation); ``adv`` is ``(B, 1)``."""
  sg = logp if logp_sg is None else logp_sg
  log_ratio = logp - old
  if level == "token":
    lw, lw_sg = log_ratio, sg - old
  else:
    n = np.clip(mask.sum(-1), 1.0, None)
    lw = ((log_ratio * mask).sum(-1) / n)[:, None]
    lw_sg = (((sg - old) * mask).sum(-1) / n)[:, None]
  coef_1 = np.exp(lw)
  if beta != 0.0:
    kl = np.exp(ref - logp) - (ref - logp) - 1
    if bias_kl:
      kl = kl * coef_1
  if loss_type == "cispo":
    per_token = -np.minimum(np.exp(lw_sg), eps_high) * adv * logp
  elif loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
    coef_2 = np.clip(coef_1, 1 - eps_low, 1 + eps_high)
    c1 = coef_1 if delta is None else np.minimum(coef_1, delta)
    per_token = -np.minimum(c1 * adv, coef_2 * adv)
  elif loss_type == "sapo":
    t = np.where(adv > 0, temps[0], temps[1])
    per_token = -(1 / (1 + np.exp(-t * (coef_1 - 1))) * 4 / t) * adv
  else:
    raise ValueError(loss_type)
  if is_ratio is not None:
    per_token = per_token * is_ratio
  if beta != 0.0:
    per_token = per_token + beta * kl
  if loss_type in ("grpo", "sapo"):
    return ((per_token * mask).sum(-1) / np.clip(mask.sum(-1), 1.0, None)).mean()
  if loss_type == "bnpo":
    return (per_token * mask).sum() / max(mask.sum(), 1.0)
  if loss_type == "dr_grpo":
    return (per_token * mask).sum() / (per_token.shape[0] * max_completion_length)
  if loss_type in ("cispo", "dapo"):
    return (per_token * mask).sum() / max(num_items_in_batch, 1.0)
  return (per_token * mask.sum(1, keepdims=True)).mean()  # luspo


def central_difference(f, x, eps=1e-6):
  """The gradient of the scalar ``f`` at ``x`` by central differences (float64)."""
  x = np.asarray(x, np.float64)
  g = np.zeros_like(x)
  for i in np.ndindex(x.shape):
    e = np.zeros_like(x)
    e[i] = eps
    g[i] = (f(x + e) - f(x - e)) / (2 * eps)
  return g


def torch_policy_loss_and_grad(peer, name, logp, old, adv, mask, **kw):
  """verl's or TRL's policy loss in torch float64, line by line from their code: ``(loss, d loss /
  d log_probs)`` by autograd (``.detach()`` as they write it).

  verl (``peer="verl"``, ``name`` in vanilla, gspo, cispo; ``kw``: clip_low, clip_high, clip_c,
  mode): ``compute_policy_loss_<name>`` and ``agg_loss``, volcengine/verl
  verl/trainer/ppo/core_algos.py. TRL (``peer="trl"``, ``name`` a ``loss_type`` in grpo, dapo,
  cispo; ``kw``: eps_low, eps_high, beta, ref, bias_kl, num_items_in_batch): the loss part of
  ``GRPOTrainer._compute_loss``, huggingface/trl trl/trainer/grpo_trainer.py; ``adv`` is
  ``(B, 1)`` there, as TRL's ``advantages.unsqueeze(1)``.
  """
  import torch

  def t(a):
    return torch.tensor(np.asarray(a), dtype=torch.float64)

  log_prob = t(logp).requires_grad_(True)
  old_log_prob, advantages, response_mask = t(old), t(adv), t(mask)
  if peer == "verl":
    loss = _torch_verl(torch, name, old_log_prob, log_prob, advantages, response_mask, **kw)
  else:
    loss = _torch_trl(torch, name, log_prob, old_log_prob, advantages, response_mask, **kw)
  loss.backward()
  return loss.item(), log_prob.grad.numpy()


def _torch_verl(torch, name, old_log_prob, log_prob, advantages, response_mask, *, mode="token-mean",
                clip_low=0.2, clip_high=0.2, clip_c=3.0):  # fmt: skip
  negative_approx_kl = log_prob - old_log_prob
  if name == "vanilla":
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
  elif name == "gspo":
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = (
      log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    )
    log_seq_importance_ratio = torch.clamp(log_seq_importance_ratio, max=10.0)
    seq_importance_ratio = torch.exp(log_seq_importance_ratio)
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - clip_low, 1 + clip_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    mode = "seq-mean-token-mean"  # verl's GSPO aggregates so whatever the mode
  elif name == "cispo":
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    clipped_ratio = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    pg_losses = -clipped_ratio.detach() * advantages * log_prob
  else:
    raise ValueError(name)
  # agg_loss (one data-parallel rank, no global batch info)
  if mode == "token-mean":
    return (pg_losses * response_mask).sum() / response_mask.sum()
  if mode == "seq-mean-token-mean":
    seq_mask = torch.sum(response_mask, dim=-1)
    seq_losses = torch.sum(pg_losses * response_mask, dim=-1) / (seq_mask + 1e-8)
    seq_mask = (seq_mask > 0).float()  # float64 * float32 promotes to float64, as in verl
    return (seq_losses * seq_mask).sum() / seq_mask.sum()
  seq_losses = torch.sum(pg_losses * response_mask, dim=-1)  # seq-mean-token-sum(-norm)
  seq_mask = (torch.sum(response_mask, dim=-1) > 0).float()
  loss = (seq_losses * seq_mask).sum() / seq_mask.sum()
  return loss / response_mask.shape[-1] if mode == "seq-mean-token-sum-norm" else loss


def _torch_trl(torch, loss_type, per_token_logps, old_per_token_logps, advantages, completion_mask,
               *, eps_low=0.2, eps_high=0.2, beta=0.0, ref=None, bias_kl=False,
               num_items_in_batch=None):  # fmt: skip
  log_ratio = per_token_logps - old_per_token_logps
  coef_1 = torch.exp(log_ratio)  # importance_sampling_level="token"
  if beta != 0.0:
    ref_per_token_logps = torch.tensor(ref, dtype=torch.float64)
    per_token_kl = (
      torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
    )
    if bias_kl:  # use_bias_correction_kl
      per_token_kl = per_token_kl * coef_1
  if loss_type == "cispo":
    clamped_ratios = torch.clamp(coef_1, max=eps_high).detach()
    per_token_loss = -clamped_ratios * advantages * per_token_logps
  else:  # grpo, bnpo, dr_grpo, dapo
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
  if beta != 0.0:
    per_token_loss = per_token_loss + beta * per_token_kl
  if loss_type == "grpo":
    return (
      (per_token_loss * completion_mask).sum(-1) / completion_mask.sum(-1).clamp(min=1.0)
    ).mean()
  return (per_token_loss * completion_mask).sum() / num_items_in_batch  # dapo, cispo (1 process)


@contextlib.contextmanager
def tpu_kernel():
  """Inside the block, on CPU, the TPU path of the whole-row statistics: every
  ``lax.platform_dependent`` takes its default (TPU) branch and the row-sums primitive is
  lowered as for TPU, its Pallas kernel run by Pallas' interpreter."""
  from jax.interpreters import mlir

  from kldiv_jax import _whole_rows

  interpreted = functools.partial(_whole_rows.tpu_lowering, interpret=True)
  with platform_branch("default"):
    jax.config.update("jax_pgle_profiling_runs", _BRANCH_TRACES["tpu kernel"])
    mlir.register_lowering(_whole_rows.ROW_SUMS, interpreted, platform="cpu")
    try:
      yield
    finally:
      mlir.register_lowering(_whole_rows.ROW_SUMS, _whole_rows.XLA_LOWERING, platform="cpu")


def hostile_logits(rows, classes, seed=0):
  """Two float32 ``[rows, classes]`` NumPy logits (``3 N(0, 1)``) with hostile rows, for the
  kernels' tests: ``-inf`` classes (row 0), a row without teacher mass (1), identical rows
  (2), a NaN (3), a ``+inf`` (4), a row without any mass (5)."""
  rng = np.random.default_rng(seed)
  z = (3 * rng.standard_normal((rows, classes))).astype(np.float32)
  y = (3 * rng.standard_normal((rows, classes))).astype(np.float32)
  z[0, :5] = -np.inf
  y[1] = -np.inf
  y[2] = z[2]
  z[3, 7] = np.nan
  z[4, 2] = np.inf
  z[5] = y[5] = -np.inf
  return z, y


def check_bf16_grads_digits(grads, want, *, rounded: bool):
  """bf16 gradients against float64 ``want``: with ``rounded`` (bf16 chunk logits) more than
  half the entries are over 5% off; without, every entry is within bf16's own rounding
  (``2**-8`` relative, plus ``1e-3`` of the largest)."""
  for g, r in zip(grads, want, strict=True):
    assert str(g.dtype) == "bfloat16", g.dtype
    err = np.abs(np.asarray(g, np.float64) - r)
    if rounded:
      assert np.mean(err > 0.05 * np.abs(r)) > 0.5
    else:
      np.testing.assert_array_less(err, 2**-8 * np.abs(r) + 1e-3 * np.abs(r).max())


# ---------------------------------------------------------------- ULD and GOLD (TRL 1.16.0)


def np_softmax(x, temperature=1.0):
  """float64 softmax over the last axis (a row of -inf: zeros)."""
  return np.exp(np_log_softmax(np.asarray(x, np.float64) / temperature))


def np_uld_rows(p, q):
  """ULD per row, from TRL 1.16.0's ``ULDLoss._compute_distillation_loss`` (plain path):
  each side's probabilities sorted in descending order, the shorter zero-padded, the L1."""
  p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
  v = max(p.shape[-1], q.shape[-1])
  ps = -np.sort(-p, axis=-1)
  qs = -np.sort(-q, axis=-1)
  ps = np.concatenate([ps, np.zeros((*ps.shape[:-1], v - ps.shape[-1]))], axis=-1)
  qs = np.concatenate([qs, np.zeros((*qs.shape[:-1], v - qs.shape[-1]))], axis=-1)
  return np.abs(ps - qs).sum(-1)


def np_uld_topk_rows(p, q, k):
  """The top-``k`` form of ULD per row (``kldiv_jax.uld_loss_from_topk``'s docstring):
  ``sum_{i<=k} |a_i - b_i| + |A - B|`` of each side's probabilities sorted in descending
  order and zero-padded, ``A``, ``B`` the masses past rank ``k``."""
  p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
  v = max(p.shape[-1], q.shape[-1], k)
  pad = lambda x: np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, v - x.shape[-1])])  # noqa: E731
  a, b = pad(-np.sort(-p, axis=-1)), pad(-np.sort(-q, axis=-1))
  tails = a[..., k:].sum(-1) - b[..., k:].sum(-1)
  return np.abs(a[..., :k] - b[..., :k]).sum(-1) + np.abs(tails)


def np_uld_topk_logit_grad(z, y, k, ts=1.0, tt=1.0):
  """``d D_k / d z`` per row of the student's logits ``z [n, Vs]`` against a teacher's ``y
  [n, Vt]``, from the closed form (docs/cross-tokenizer.md): ``(S - c p) / T_s``, ``S`` the
  ``k`` entries ``a_i g_i`` at the student's top ids (NumPy's stable sort: at a tie the
  lower id first), ``g_i = sign(a_i - b_i) - sign(A - B)``, ``c = sum_i a_i g_i``. For
  ``k < Vs`` (a tail that is not clamped)."""
  p, q = np_softmax(z, ts), np_softmax(y, tt)
  top = np.argsort(-p, axis=-1, kind="stable")[:, :k]
  a = np.take_along_axis(p, top, -1)
  b = -np.sort(-q, axis=-1)[:, :k]
  b = np.pad(b, ((0, 0), (0, k - b.shape[-1])))
  g = np.sign(a - b) - np.sign((1 - a.sum(-1)) - (1 - b.sum(-1)))[:, None]
  s = np.zeros_like(p)
  np.put_along_axis(s, top, a * g, -1)
  return (s - (a * g).sum(-1, keepdims=True) * p) / ts


def np_merge_spans(probs, tokens, groups, strategy):
  """TRL 1.16.0's ``ULDLoss._merge_probabilities_with_alignment_groups`` on one sequence:
  ``probs [T, V]``, ``tokens [T]``, groups as lists of positions; ``[G, V]``."""
  out = np.zeros((len(groups), probs.shape[-1]))
  for i, group in enumerate(groups):
    if not group:
      continue
    base, scalars = (group[-1], group[:-1]) if strategy == "bayesian" else (group[0], group[1:])
    factor = 1.0
    for j in scalars:
      factor *= max(probs[j, tokens[j]], 1e-8)
    out[i] = probs[base] * factor
  return out


def np_gold_rows(q, p, student_ids, teacher_ids, beta, weights=None):
  """TRL 1.16.0's ``ULDLoss._compute_hybrid_uld_loss`` per row: TRL's generalised JSD
  (``logits_are_probs=True``: logs of the probabilities floored at 1e-8) on the matched
  entries, ULD on the others (0 unless both sides have some), fixed or adaptive weights."""
  q, p = np.asarray(q, np.float64), np.asarray(p, np.float64)
  vs, vt = q.shape[-1], p.shape[-1]
  qm, pm = q[..., student_ids], p[..., teacher_ids]
  matched = _trl_jsd_terms(np.log(np.maximum(qm, 1e-8)), np.log(np.maximum(pm, 1e-8)), beta, np)
  matched = matched.sum(-1)
  s_rest = np.setdiff1d(np.arange(vs), student_ids)
  t_rest = np.setdiff1d(np.arange(vt), teacher_ids)
  unmatched = np.zeros(matched.shape)
  if len(s_rest) and len(t_rest):
    unmatched = np_uld_rows(p[..., t_rest], q[..., s_rest])
  if weights is None:
    w = len(teacher_ids) / max(1, vt)
    weights = (w, 1.0 - w)
  return weights[0] * matched + weights[1] * unmatched


# verl 0.9.1's clip_cov and kl_cov (verl/trainer/ppo/core_algos.py:
# compute_policy_loss_clip_cov, compute_policy_loss_kl_cov), and rollout_corr_helper's
# rejection sampling (compute_rollout_rejection_mask) and batch normalisation
# (compute_rollout_correction_weights), read from the installed 0.9.1 and ported to float64.
def verl_cov_losses(name, old, logp, adv, mask, *, ratio, clip_low=0.2, clip_high=0.2,
                    bounds=(1.0, 5.0), coef=0.1, order=None):  # fmt: skip
  """``(per-token losses, selected)`` of verl's ``clip_cov`` or ``kl_cov`` (``order``: the
  flat indices in the order ``torch.randperm`` would give the candidates; None: row-major).
  The selection is a function of the point, returned to hold it fixed when differentiating
  (verl's has no gradient)."""
  m = mask > 0
  r = np.exp(logp - old)
  cov = (adv - adv[m].mean()) * (logp - logp[m].mean())
  selected = np.zeros(m.shape, bool)
  if name == "kl_cov":
    k = max(1, int(m.sum() * ratio))
    flat = np.flatnonzero(m)
    top = flat[np.argsort(-cov.reshape(-1)[flat], kind="stable")[:k]]
    selected.reshape(-1)[top] = True
    return selected, lambda x: -adv * np.exp(x - old) + selected * coef * np.abs(x - old)
  l1, l2 = -adv * r, -adv * np.clip(r, 1 - clip_low, 1 + clip_high)
  candidates = m & ~(l2 > l1) & (cov > bounds[0]) & (cov < bounds[1])
  flat = np.flatnonzero(candidates)
  if order is not None:
    flat = np.array([i for i in order if candidates.reshape(-1)[i]], int)
  selected.reshape(-1)[flat[: max(int(ratio * m.sum()), 1)]] = True

  def losses(x):
    rx = np.exp(x - old)
    return np.maximum(-adv * rx, -adv * np.clip(rx, 1 - clip_low, 1 + clip_high)) * ~selected

  return selected, losses


def verl_rejection_keep(old, rollout, mask, modes):
  """verl's rejected ``response_mask`` (``compute_rollout_rejection_mask``): ``modes`` maps
  verl's option names to ``(lower, upper)`` (k1: bounds on the ratio) or ``upper``."""
  m = mask > 0
  lr = np.clip(old - rollout, -20.0, 20.0)
  stats = {"k1": -lr, "k2": 0.5 * lr**2, "k3": np.exp(lr) - 1.0 - lr}
  keep = np.ones(m.shape, bool)
  n = m.sum(-1)
  for option, bound in modes.items():
    s = stats[option[-2:]]
    if option.startswith("seq_sum"):
      s = np.repeat((s * m).sum(-1, keepdims=True), m.shape[-1], -1)
    elif option.startswith("seq_mean"):
      s = np.repeat(((s * m).sum(-1) / (n + 1e-8))[:, None], m.shape[-1], -1)
    elif option.startswith("seq_max"):
      top = np.where(m, s, -np.inf).max(-1)
      s = np.repeat(np.where(top == -np.inf, 0.0, top)[:, None], m.shape[-1], -1)
    if option.endswith("k1"):
      low, high = bound
      keep &= (s >= np.log(low)) & (s <= np.log(high))
    else:
      keep &= s <= bound
  return m & keep


def verl_batch_normalize(w, mask, level):
  """verl's ``rollout_is_batch_normalize``: weights over their token or sequence mean."""
  m = mask > 0
  if level == "token":
    mean = (w * m).sum() / m.sum()
  else:
    seq = (w * m).sum(-1) / (m.sum(-1) + 1e-8)
    valid = m.sum(-1) > 0
    mean = (seq * valid).sum() / max(valid.sum(), 1e-8)
  return w / mean if mean > 1e-8 else w


# ---------------------------------------------------------------- packing the policy tests' batch

# The policy tests' batch holds sequences of 6, 4, 0 and 2 counted tokens (a prefix of each
# row): packed into two rows of PACKED_LENGTH tokens, [seq 0 | pad] and [seq 1, seq 3 | pad],
# segment ids 1 and 1, 2 (0: padding). (row, sequence, start, id) of each packed sequence:
PACKING = ((0, 0, 0, 1), (1, 1, 0, 1), (1, 3, 4, 2))
PACKED_LENGTH = 8


def pack(x, mask, fill=0):
  """``x [B, T]``'s counted tokens laid out as :data:`PACKING` says, ``[2, PACKED_LENGTH]``
  (``fill`` elsewhere)."""
  x = np.asarray(x)
  out = np.full((2, PACKED_LENGTH), fill, x.dtype)
  for row, seq, start, _ in PACKING:
    n = int(np.sum(mask[seq]))
    out[row, start : start + n] = x[seq, :n]
  return out


def packed_segment_ids(mask):
  """The segment ids of :func:`pack`'s layout, ``[2, PACKED_LENGTH]`` int32."""
  ids = np.zeros((2, PACKED_LENGTH), np.int32)
  for row, seq, start, sid in PACKING:
    ids[row, start : start + int(np.sum(mask[seq]))] = sid
  return ids
