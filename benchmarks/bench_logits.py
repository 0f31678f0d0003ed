"""Logits benchmark: the distillation losses against the code users write.

For student/teacher logits ``(rows, classes)`` (default ``(4096, 8192)`` float32,
``T = 2``), each group times ``jax.value_and_grad`` wrt the student's logits of a
scalar loss (the mean over rows), side by side in one process, round-robin:

* ``kl``: ``mean(kl_div_from_logits(s, t, temperature=T))`` against the
  straightforward ``log_softmax`` + ``sum(p * (log p - log q))`` with autodiff;
* ``jsd``: ``mean(generalized_jsd(s, t, beta=0.5, temperature=T))`` against a
  direct port of TRL's ``generalized_jsd_loss`` (``logsumexp`` of the stacked
  log-mixture terms, two ``kl_div(log_target=True)``);
* ``distill``: ``distillation_loss(s, t, labels, temperature=T, alpha=0.5)`` (10%
  of the labels ``ignore_index``) against ``log_softmax`` + ``T^2`` KL +
  cross-entropy, averaged over the valid tokens, with autodiff.

The targets: ``kl`` at most 0.5x the time and 0.5x the temp bytes of the
straightforward version, ``jsd`` at most 0.6x TRL's port, ``distill`` at most
0.6x the straightforward version.

  python benchmarks/bench_logits.py            # (4096, 8192)
  python benchmarks/bench_logits.py --quick    # (256, 1024), a smoke test
"""

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from _harness import logits_data, logits_section, target_row

import kldiv_jax

IGNORE_INDEX = -100
# (group, time target, temp-bytes target), each as a ratio to the baseline.
TARGETS = {"kl": (0.5, 0.5), "jsd": (0.6, None), "distill": (0.6, None)}


def naive_kl(temperature: float) -> Callable[..., jax.Array]:
  def loss(s, t):
    log_q = jax.nn.log_softmax(s / temperature)
    log_p = jax.nn.log_softmax(t / temperature)
    return jnp.mean(jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1))

  return loss


def trl_jsd(temperature: float, beta: float) -> Callable[..., jax.Array]:
  """TRL's ``GKDTrainer.generalized_jsd_loss`` (0 < beta < 1), ported line by line."""

  def loss(s, t):
    student = jax.nn.log_softmax(s / temperature, axis=-1)
    teacher = jax.nn.log_softmax(t / temperature, axis=-1)
    mixture = jax.nn.logsumexp(
      jnp.stack([student + jnp.log1p(-beta), teacher + jnp.log(beta)]), axis=0
    )
    # F.kl_div(mixture, x, reduction="none", log_target=True) = exp(x) * (x - mixture)
    kl_teacher = jnp.exp(teacher) * (teacher - mixture)
    kl_student = jnp.exp(student) * (student - mixture)
    jsd = beta * kl_teacher + (1 - beta) * kl_student
    return jnp.sum(jsd) / jsd.shape[0]  # reduction="batchmean"

  return loss


def naive_distill(temperature: float, alpha: float) -> Callable[..., jax.Array]:
  def loss(s, t, labels):
    valid = labels != IGNORE_INDEX
    log_q = jax.nn.log_softmax(s / temperature)
    log_p = jax.nn.log_softmax(t / temperature)
    kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
    log_probs = jax.nn.log_softmax(s)
    safe = jnp.where(valid, labels, 0)
    ce = -jnp.take_along_axis(log_probs, safe[:, None], axis=-1)[:, 0]
    per_token = alpha * temperature**2 * kl + (1 - alpha) * ce
    return jnp.sum(jnp.where(valid, per_token, 0.0)) / jnp.maximum(jnp.sum(valid), 1)

  return loss


def contenders(temperature: float) -> dict[str, dict[str, Callable[..., jax.Array]]]:
  """Per group, the baseline (first) and kldiv_jax: scalar losses of (s, t[, labels])."""
  return {
    "kl": {
      "straightforward": naive_kl(temperature),
      "kldiv_jax": lambda s, t: jnp.mean(
        kldiv_jax.kl_div_from_logits(s, t, temperature=temperature)
      ),
    },
    "jsd": {
      "trl_port": trl_jsd(temperature, 0.5),
      "kldiv_jax": lambda s, t: jnp.mean(
        kldiv_jax.generalized_jsd(s, t, beta=0.5, temperature=temperature)
      ),
    },
    "distill": {
      "straightforward": naive_distill(temperature, 0.5),
      "kldiv_jax": lambda s, t, labels: kldiv_jax.distillation_loss(
        s, t, labels, temperature=temperature, alpha=0.5
      ),
    },
  }


def check(baseline, ours) -> None:
  """Same values and gradients before timing anything."""
  (v0, g0), (v1, g1) = baseline, ours
  np.testing.assert_allclose(v1, v0, rtol=1e-4)
  np.testing.assert_allclose(g1, g0, rtol=1e-3, atol=1e-6 * float(jnp.max(jnp.abs(g0))))


def groups(args, shape):
  student, teacher, labels = logits_data(shape, args.seed, IGNORE_INDEX)
  return {
    group: (fns, (student, teacher, *((labels,) if group == "distill" else ())), check, {})
    for group, fns in contenders(args.temperature).items()
  }


def evaluate_targets(records):
  rows = []
  for group, (time_target, temp_target) in TARGETS.items():
    ours = next(r for r in records if r["group"] == group and r["contender"] == "kldiv_jax")
    for what, target, value in (
      ("time", time_target, ours["time_ratio"]),
      ("temp bytes", temp_target, ours["temp_ratio"]),
    ):
      if target is not None:
        rows.append(target_row(f"{group} {what} / {ours['baseline']}", target, value))
  return rows


def main(argv: Sequence[str] | None = None) -> int:
  return logits_section("logits", __doc__, "group", groups, evaluate_targets, argv)


if __name__ == "__main__":
  raise SystemExit(main())
