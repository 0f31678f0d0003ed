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
