"""References that several test modules compare against (test modules never import each other).

Everything here is independent of kldiv_jax: float64 NumPy, closed forms, TRL's
``generalized_jsd_loss`` ported to NumPy, and the same textbook formulas in
torch. The ``torch_*`` functions import torch when called; a test that calls
them carries the ``torch`` marker and skips without torch (``conftest.py``),
and each has a float64 twin here that runs everywhere.

Logits references take ``z`` (student) and ``y`` (teacher) of shape
``[..., classes]``, finite, with ``q = softmax(z / T)`` and ``p = softmax(y / T)``.
"""

import contextlib
import decimal
import re
from pathlib import Path

import jax
import numpy as np

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


def docs_snippet(page: str, heading: str) -> str:
  """The first Python block of a section of a docs page (the guides' snippets must run)."""
  text = (Path(__file__).resolve().parent.parent / "docs" / page).read_text()
  return re.search(r"```python\n(.*?)```", text.split(heading, 1)[1], re.S).group(1)


# ------------------------------------------------------------------ float64 NumPy


def np_log_softmax(x, axis=-1):
  """float64 log-softmax; a row of -inf stays -inf."""
  x = np.asarray(x, np.float64)
  m = np.max(np.where(np.isfinite(x), x, -INF), axis=axis, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.0)
  with np.errstate(divide="ignore"):
    return x - m - np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True))


def np_pointwise(x, t, log_target=False):
  """torch's ``kl_div`` terms, 0 at zero mass (``t = 0``, or ``-inf`` with log targets)."""
  x, t = np.broadcast_arrays(np.asarray(x, np.float64), np.asarray(t, np.float64))
  with np.errstate(all="ignore"):
    if log_target:
      return np.where((t == -INF) & (x < INF), 0.0, np.exp(t) * (t - x))
    return np.where((t == 0) & (x < INF), 0.0, t * (np.log(t) - x))


def np_kl(lp, lq, axis=-1):
  """``sum p (log p - log q)`` over ``axis`` from log-probabilities, 0 where p = 0."""
  with np.errstate(invalid="ignore"):
    terms = np.where(np.exp(lp) > 0, np.exp(lp) * (lp - lq), 0.0)
  return np.sum(terms, axis=axis)


def np_kl_from_logits(z, y, temperature=1.0, direction="forward"):
  """``KL(p || q)`` (forward) or ``KL(q || p)`` (reverse) per row."""
  lq = np_log_softmax(np.asarray(z, np.float64) / temperature)
  lp = np_log_softmax(np.asarray(y, np.float64) / temperature)
  return np_kl(lp, lq) if direction == "forward" else np_kl(lq, lp)


def np_trl_gjsd(student, teacher, beta, temperature=1.0):
  """TRL's ``GKDTrainer.generalized_jsd_loss`` (reduction='none', summed over classes).

  ``beta = 0`` is forward KL and ``beta = 1`` reverse KL, TRL's endpoints;
  otherwise ``beta KL(p || m) + (1 - beta) KL(q || m)``, ``m = beta p + (1 - beta) q``.
  """
  s = np_log_softmax(np.asarray(student, np.float64) / temperature)
  t = np_log_softmax(np.asarray(teacher, np.float64) / temperature)
  if beta == 0:
    return np_kl(t, s)  # F.kl_div(s, t, log_target=True)
  if beta == 1:
    return np_kl(s, t)  # F.kl_div(t, s, log_target=True)
  mixture = np.logaddexp(s + np.log1p(-beta), t + np.log(beta))
  return beta * np_kl(t, mixture) + (1 - beta) * np_kl(s, mixture)


def _softmax_pullback(prob, g, temperature):
  """The gradient wrt the logits of ``sum_j g_j prob_j``-linearised: ``prob (g - <prob, g>) / T``."""
  return prob * (g - np.sum(prob * g, -1, keepdims=True)) / temperature


def np_logits_grads(z, y, weights, temperature=1.0, *, direction="forward", beta=None):
  """Closed-form gradients of ``sum(weights * divergence)`` wrt ``z`` and ``y``.

  ``divergence`` is the forward or reverse KL (``direction``) or, with
  ``beta``, TRL's generalized JSD (:func:`np_trl_gjsd`). ``weights`` has the
  rows' shape. With ``m = beta p + (1 - beta) q``, the JSD's partials are
  ``beta (log p - log m)`` wrt ``p`` and ``(1 - beta)(log q - log m)`` wrt
  ``q``; the forward KL's are ``log p - log q + 1`` and ``-p / q``; each goes
  through the softmax Jacobian ``diag(prob) - prob prob^T`` over ``T``.
  """
  lq = np_log_softmax(np.asarray(z, np.float64) / temperature)
  lp = np_log_softmax(np.asarray(y, np.float64) / temperature)
  q, p = np.exp(lq), np.exp(lp)
  w = np.asarray(weights, np.float64)[..., None]
  if beta is not None and beta not in (0, 1):
    lm = np.logaddexp(lp + np.log(beta), lq + np.log1p(-beta))
    gz = _softmax_pullback(q, (1 - beta) * (lq - lm), temperature)
    gy = _softmax_pullback(p, beta * (lp - lm), temperature)
    return w * gz, w * gy
  if beta is not None:
    direction = "forward" if beta == 0 else "reverse"
  if direction == "forward":  # KL(p || q)
    return w * (q - p) / temperature, w * _softmax_pullback(p, lp - lq, temperature)
  return w * _softmax_pullback(q, lq - lp, temperature), w * (p - q) / temperature


def np_logits_value_and_grads(z, y, weights, temperature=1.0, *, direction="forward", beta=None):
  """``(divergence, grad_z, grad_y)``: :func:`np_kl_from_logits` or :func:`np_trl_gjsd`, and
  :func:`np_logits_grads`."""
  if beta is None:
    value = np_kl_from_logits(z, y, temperature, direction)
  else:
    value = np_trl_gjsd(z, y, beta, temperature)
  grads = np_logits_grads(z, y, weights, temperature, direction=direction, beta=beta)
  return (value, *grads)


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
  beta_ = {"forward_kl": None, "reverse_kl": None, "jsd": beta}[divergence]
  direction = "reverse" if divergence == "reverse_kl" else "forward"
  if beta_ is None:
    div = np_kl_from_logits(s, t, temperature, direction)
  else:
    div = np_trl_gjsd(s, t, beta_, temperature)
  t2 = temperature**2 if scale else 1.0
  valid = np.ones(div.shape, bool) if valid is None else np.asarray(valid, bool)
  if labels is None:
    per_token, div_weight = div * t2, t2
  else:
    labels = np.asarray(labels)
    valid = valid & (labels != -100)
    safe = np.where(valid, labels, 0)
    log_q1 = np_log_softmax(s)
    ce = -np.take_along_axis(log_q1, safe[..., None], -1)[..., 0]
    per_token, div_weight = alpha * div * t2 + (1 - alpha) * ce, alpha * t2
  count = max(int(valid.sum()), 1)
  value = np.sum(np.where(valid, per_token, 0.0)) / count
  w = valid / count
  gs, gt = np_logits_grads(s, t, w * div_weight, temperature, direction=direction, beta=beta_)
  if labels is not None:
    one_hot = np.eye(s.shape[-1])[safe]
    gs = gs + (w * (1 - alpha))[..., None] * (np.exp(log_q1) - one_hot)
  return value, gs, gt


def np_gaussian_kl(mean, log_var, prior_mean=0.0, prior_log_var=0.0, axis=-1):
  """``KL(N(mean, e^log_var) || N(prior_mean, e^prior_log_var))``, summed over ``axis``.

  The textbook closed form ``log(s0 / s) + (s^2 + (m - m0)^2) / (2 s0^2) - 1/2``.
  """
  m, lv, m0, lv0 = (np.asarray(a, np.float64) for a in (mean, log_var, prior_mean, prior_log_var))
  terms = 0.5 * (lv0 - lv) + (np.exp(lv) + (m - m0) ** 2) / (2 * np.exp(lv0)) - 0.5
  return terms.sum(axis)


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
  """:func:`np_logits_grads`'s quantities by torch autograd: ``(value, grad_z, grad_y)``."""
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


# Each reference by source: the ``source`` fixture (conftest.py) picks one.
LOGITS = {"numpy": np_logits_value_and_grads, "torch": torch_logits_value_and_grads}
DISTILLATION = {"numpy": np_distillation, "torch": torch_distillation}
GAUSSIAN_KL = {"numpy": np_gaussian_kl, "torch": torch_gaussian_kl}


# Compilations counted by one listener registered for the whole session: jax.monitoring has
# no way to unregister a listener before jax 0.8 (the floor is 0.7.0).
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


# ----------------------------------------------------------------- divergences (test_engine)
#
# Float64 references for the divergences, ported from their authors' code.
#
# Each ``ref_<name>(student, teacher, temperature, ..., xp=np)`` gives the
# per-token divergence (summed over the last axis) of ``softmax(teacher / T)``
# (``p``) from ``softmax(student / T)`` (``q``), written as the authors write the
# per-token part of their loss (before their masked mean over tokens). ``xp`` is
# ``numpy`` (values) or ``jax.numpy`` (autodiff, under ``jax.enable_x64``).
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
# (``inf_mask``); these references are meant for finite logits (the tests
# express "no mass" as a very negative finite logit when comparing).


def log_softmax(x, xp=np):
  x = xp.asarray(x)
  m = xp.max(x, axis=-1, keepdims=True)
  return x - m - xp.log(xp.sum(xp.exp(x - m), axis=-1, keepdims=True))


def _logs(student, teacher, temperature, xp):
  lq = log_softmax(xp.asarray(student) / temperature, xp)
  lp = log_softmax(xp.asarray(teacher) / temperature, xp)
  return lq, lp, xp.exp(lq), xp.exp(lp)


def ref_forward_kl(student, teacher, temperature=1.0, xp=np):
  # DistiLLM forward_kl: -sum(teacher_probs * student_logprobs), plus the teacher's entropy term.
  lq, lp, _, p = _logs(student, teacher, temperature, xp)
  return -xp.sum(p * lq, axis=-1) + xp.sum(p * lp, axis=-1)


def ref_reverse_kl(student, teacher, temperature=1.0, xp=np):
  # DistiLLM reverse_kl: -(sum(student_probs * teacher_logprobs) - sum(student_probs * student_logprobs)).
  lq, lp, q, _ = _logs(student, teacher, temperature, xp)
  return -(xp.sum(q * lp, axis=-1) - xp.sum(q * lq, axis=-1))


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


def ref_jsd(student, teacher, temperature=1.0, beta=0.5, xp=np):
  """TRL's generalized_jsd_loss (reduction='none', summed over the vocabulary)."""
  s, t, _, _ = _logs(student, teacher, temperature, xp)
  if beta == 0:
    jsd = xp.exp(t) * (t - s)  # F.kl_div(student_log_probs, teacher_log_probs, log_target=True)
  elif beta == 1:
    jsd = xp.exp(s) * (s - t)  # F.kl_div(teacher_log_probs, student_log_probs, log_target=True)
  else:
    # mixture_log_probs = logsumexp(stack([s + log(1 - beta), t + log(beta)]))
    mixture = xp.logaddexp(s + xp.log(1 - beta), t + xp.log(beta))
    kl_teacher = xp.exp(t) * (t - mixture)
    kl_student = xp.exp(s) * (s - mixture)
    jsd = beta * kl_teacher + (1 - beta) * kl_student
  return xp.sum(jsd, axis=-1)


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


def np_topk_log_probs(z, ids, lp, temperature=1.0, tail="renormalize"):
  """float64 ``(log_q, log_p)`` ``[rows, k + 1]`` of a top-k teacher (distinct ids ``[rows,
  k]``, log-probabilities ``lp``, all with mass) and a student's logits ``z``: the ``k``
  classes and the tail, both tails from log-sum-exps (the student's over the logits outside
  the top-k, the teacher's as ``log1p(-sum p)``), never from ``1 - sum q`` in the working
  precision; ``-inf`` for an empty tail. ``tail="bucket"``: the teacher as stored and the
  temperature on the student only; ``"renormalize"``: the teacher's softmax of ``lp / T``
  over the top-k and no tail."""
  z = np.asarray(z, np.float64) / temperature
  ids, lp = np.asarray(ids), np.asarray(lp, np.float64)
  lse = np.logaddexp.reduce(z, axis=-1, keepdims=True)
  outside = np.ones(z.shape, bool)
  np.put_along_axis(outside, ids, False, axis=-1)
  with np.errstate(divide="ignore"):
    tail_lse = np.logaddexp.reduce(np.where(outside, z, -np.inf), axis=-1, keepdims=True)
    log_q = np.concatenate([np.take_along_axis(z, ids, -1), tail_lse], -1) - lse
    if tail == "bucket":
      p_tail = -np.expm1(np.logaddexp.reduce(lp, axis=-1, keepdims=True))
      log_p = np.concatenate([lp, np.log(p_tail)], -1)
    else:
      log_p = np.concatenate(
        [np_log_softmax(lp / temperature), np.full_like(tail_lse, -np.inf)], -1
      )
  return log_q, log_p


def np_topk_divergence(name, params, z, ids, lp, temperature=1.0, tail="renormalize"):
  """float64 per-row divergence of :func:`np_topk_log_probs`' classes from the authors'
  formula (:data:`REFERENCES`); ``+inf`` where the student has mass the teacher lacks and the
  divergence charges it (a class without mass enters as a log-probability of ``-1e300``)."""
  log_q, log_p = np_topk_log_probs(z, ids, lp, temperature, tail)
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
