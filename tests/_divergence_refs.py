"""Float64 references for the divergences, ported from their authors' code.

Each ``ref_<name>(student, teacher, temperature, ..., xp=np)`` gives the
per-token divergence (summed over the last axis) of ``softmax(teacher / T)``
(``p``) from ``softmax(student / T)`` (``q``), written as the authors write the
per-token part of their loss (before their masked mean over tokens). ``xp`` is
``numpy`` (values) or ``jax.numpy`` (autodiff, under ``jax.enable_x64``).

* DistiLLM, ``jongwooko/distillm``, ``distillm/losses.py`` (commit 17c0f98):
  ``forward_kl``, ``reverse_kl``, ``symmetric_kl``, ``skewed_forward_kl``,
  ``skewed_reverse_kl``, ``tv_distance``. Its ``forward_kl`` and
  ``skewed_forward_kl`` are cross-entropies, ``-sum p log q`` and ``-sum p log
  m``: they differ from the KL divergences by the teacher's entropy, a constant
  for the student. The references add it back (``+ sum p log p``) to give
  ``KL(p || q)`` and ``KL(p || m)``. (torchtune's ``ForwardKLLoss`` is the same
  port of DistiLLM.)
* TRL, ``huggingface/trl``, ``trl/trainer/gkd_trainer.py``,
  ``GKDTrainer.generalized_jsd_loss`` (``beta`` 0 and 1 are forward and reverse
  KL).
* Liger Kernel, ``linkedin/Liger-Kernel``, ``src/liger_kernel/ops/tvd.py``:
  ``0.5 * |p - q|`` (as DistiLLM's ``tv_distance``).
* ABKD, ``ghwang-s/abkd``, ``distillation_llm/distillm/losses.py``, ``ab_div``:
  the general branch. Its limit branches (``alpha`` or ``beta`` = 0, ``alpha +
  beta = 0``) are scaled by ``1/alpha`` where Cichocki et al. (2011, Eq. 4-5)
  have ``1/alpha**2``, so they are not the limits of its general branch;
  :func:`ref_alpha_beta` uses the paper's closed forms, and
  :func:`ab_decimal` evaluates the general branch in 80-digit decimal
  arithmetic next to a limit, as an independent check of them.

DistiLLM, TRL and ABKD drop every class where either logit is infinite
(``inf_mask``); these references are meant for finite logits (the tests
express "no mass" as a very negative finite logit when comparing).
"""

import decimal

import numpy as np


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
