"""Divergences benchmark: the engine against the straightforward autodiff version, per divergence.

For student/teacher logits ``(rows, classes)`` (default ``(4096, 8192)`` float32,
``T = 2``), each divergence times ``jax.value_and_grad`` wrt the student's logits
of the mean over rows, side by side in one process, round-robin (``_harness``):

* ``straightforward``: ``jax.nn.log_softmax`` of both sides and the divergence's
  formula as its authors write it (DistiLLM's ``distillm/losses.py`` for the KL
  family and TVD, TRL's ``generalized_jsd_loss`` for JSD, ABKD's ``ab_div``),
  differentiated by JAX;
* ``engine``: ``mean(divergence_from_logits(s, t, divergence=..., temperature=T))``.

The targets (one divergence engine issue), per divergence: at most 0.6x the
time and 0.05x the XLA temp bytes of the straightforward version.

  python benchmarks/bench_divergences.py            # (4096, 8192)
  python benchmarks/bench_divergences.py --quick    # (256, 1024), a smoke test
"""

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from _harness import logits_data, logits_section, target_row

from kldiv_jax import Divergence, divergence_from_logits

TIME_TARGET, TEMP_TARGET = 0.6, 0.05
# The divergences and their parameters (alpha-beta has no default: ABKD-like values).
NAMES = ("forward_kl", "reverse_kl", "jsd", "symmetric_kl", "skew_kl", "skew_reverse_kl", "tvd")
SPECS = {n: Divergence(n) for n in NAMES} | {
  "alpha_beta": Divergence("alpha_beta", alpha=0.5, beta=0.3)
}


def per_token(name: str, params: dict[str, float], lq: jax.Array, lp: jax.Array) -> jax.Array:
  """The divergence per token of ``log_softmax`` outputs, as the authors' code writes it
  (reduced over the last axis with XLA's own sum)."""
  q, p = jnp.exp(lq), jnp.exp(lp)
  if name == "forward_kl":
    return jnp.sum(p * (lp - lq), -1)
  if name == "reverse_kl":
    return jnp.sum(q * (lq - lp), -1)
  if name == "jsd":  # TRL: logsumexp of the stacked log-mixture terms
    beta = params["beta"]
    lm = jax.nn.logsumexp(jnp.stack([lq + np.log1p(-beta), lp + np.log(beta)]), axis=0)
    return jnp.sum(beta * p * (lp - lm) + (1 - beta) * q * (lq - lm), -1)
  if name == "symmetric_kl":
    lam = params["lam"]
    return jnp.sum((1 - lam) * p * (lp - lq) + lam * q * (lq - lp), -1)
  if name == "skew_kl":
    alpha = params["alpha"]
    return jnp.sum(p * (lp - jnp.log(alpha * p + (1 - alpha) * q)), -1)
  if name == "skew_reverse_kl":
    alpha = params["alpha"]
    return jnp.sum(q * (lq - jnp.log((1 - alpha) * p + alpha * q)), -1)
  if name == "tvd":
    return 0.5 * jnp.sum(jnp.abs(p - q), -1)
  if name == "alpha_beta":
    a, b = params["alpha"], params["beta"]
    terms = p**a * q**b - a / (a + b) * p ** (a + b) - b / (a + b) * q ** (a + b)
    return -jnp.sum(terms, -1) / (a * b)
  raise ValueError(name)


def straightforward(name: str, params: dict[str, float]) -> Callable[..., jax.Array]:
  """The mean over tokens of :func:`per_token` on ``log_softmax`` outputs."""

  def loss(s, t, temperature):
    lq = jax.nn.log_softmax(s / temperature)
    lp = jax.nn.log_softmax(t / temperature)
    return jnp.mean(per_token(name, params, lq, lp))

  return loss


def checker(name: str, smooth: bool):
  """Same values and gradients before timing anything, to float32 rounding: both sides
  round, so an element's tolerance is relative to the largest gradient element.

  TVD's gradient jumps where p = q: where a class's p and q round to a tie on one side and
  not on the other, its subgradient differs, and through the softmax so does the rest of
  its row. A few rows may thus differ (at (4096, 8192), seed 0, one element does: row 1528,
  class 2538, where the engine gives float64's +5.9e-9 and the straightforward code
  -1.8e-8; at (256, 1024), row 226, where the engine's one-row call matches float64).
  """

  def check(baseline, ours) -> None:
    (v0, g0), (v1, g1) = baseline, ours
    np.testing.assert_allclose(v1, v0, rtol=2e-4)
    g0, g1 = np.asarray(g0), np.asarray(g1)
    atol = 1e-5 * float(np.max(np.abs(g0)))
    if smooth:
      np.testing.assert_allclose(g1, g0, rtol=1e-3, atol=atol)
    else:
      rows = int(np.sum(np.any(~np.isclose(g1, g0, rtol=1e-3, atol=atol), axis=-1)))
      assert rows <= 4, f"{name}: the gradients of {rows} rows differ"

  return check


def groups(args, shape):
  student, teacher, _ = logits_data(shape, args.seed)
  out, t = {}, args.temperature
  for name in args.divergences.split(",") if args.divergences else list(SPECS):
    spec = SPECS[name]
    naive = straightforward(name, dict(spec.params))
    fns = {
      "straightforward": lambda s, y, naive=naive: naive(s, y, t),
      "engine": lambda s, y, spec=spec: jnp.mean(
        divergence_from_logits(s, y, divergence=spec, temperature=t)
      ),
    }
    check = checker(name, spec.formula.smooth)
    out[name] = (fns, (student, teacher), check, {"params": dict(spec.params)})
  return out


def evaluate_targets(records):
  return [
    target_row(f"{r['divergence']} {what} / straightforward", limit, value)
    for r in records
    if r["contender"] == "engine"
    for what, limit, value in (
      ("time", TIME_TARGET, r["time_ratio"]),
      ("temp bytes", TEMP_TARGET, r["temp_ratio"]),
    )
  ]


def main(argv: Sequence[str] | None = None) -> int:
  def add(p):
    p.add_argument("--divergences", default=None, help="comma-separated names (default: all)")

  return logits_section("divergences", __doc__, "divergence", groups, evaluate_targets, argv, add)


if __name__ == "__main__":
  raise SystemExit(main())
