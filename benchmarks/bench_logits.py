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

Every contender is compiled ahead of time (XLA's memory analysis gives the temp
bytes) and warmed up; the figures are medians. The targets are printed
PASS/FAIL: ``kl`` at most 0.5x the time and 0.5x the temp bytes of the
straightforward version, ``jsd`` at most 0.6x TRL's port, ``distill`` at most
0.6x the straightforward version.

  python benchmarks/bench_logits.py            # (4096, 8192)
  python benchmarks/bench_logits.py --quick    # (256, 1024), a smoke test
"""

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
  sys.path.insert(0, str(HERE))

from _harness import (  # noqa: E402
  compile_jax,
  logits_parser,
  logits_result,
  print_ratio_report,
  round_robin,
  target_row,
  timing_records,
  write_json,
)

import kldiv_jax  # noqa: E402

FULL_SHAPE = (4096, 8192)
QUICK_SHAPE = (256, 1024)
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


def make_data(shape: tuple[int, int], seed: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  rng = np.random.default_rng(seed)
  student = jnp.asarray(rng.normal(size=shape) * 2.0, jnp.float32)
  teacher = jnp.asarray(rng.normal(size=shape) * 2.0, jnp.float32)
  labels = rng.integers(0, shape[1], size=shape[0])
  labels[rng.uniform(size=shape[0]) < 0.1] = IGNORE_INDEX
  return student, teacher, jnp.asarray(labels, jnp.int32)


def run(args: argparse.Namespace) -> dict[str, Any]:
  shape = (args.rows, args.classes) if args.rows else QUICK_SHAPE if args.quick else FULL_SHAPE
  repeats = args.repeats or (3 if args.quick else 7)
  student, teacher, labels = make_data(shape, args.seed)
  records = []
  for group, fns in contenders(args.temperature).items():
    extra = (labels,) if group == "distill" else ()
    thunks, infos = {}, {}
    for name, fn in fns.items():
      vg = jax.value_and_grad(fn)  # wrt the student's logits
      thunks[name], infos[name] = compile_jax(vg, student, teacher, *extra)
    # Same values and gradients before timing anything.
    (v0, g0), (v1, g1) = (thunks[name]() for name in fns)
    np.testing.assert_allclose(v1, v0, rtol=1e-4)
    np.testing.assert_allclose(g1, g0, rtol=1e-3, atol=1e-6 * float(jnp.max(jnp.abs(g0))))
    times = round_robin(thunks, repeats)
    records += timing_records(
      times,
      infos,
      next(iter(fns)),
      group=group,
      shape=list(shape),
      dtype="float32",
      temperature=args.temperature,
    )
  return logits_result("logits", args, shape, repeats, FULL_SHAPE, records, evaluate_targets)


def evaluate_targets(records: list[dict[str, Any]], full_size: bool) -> dict[str, Any]:
  rows = []
  for group, (time_target, temp_target) in TARGETS.items():
    ours = next(r for r in records if r["group"] == group and r["contender"] == "kldiv_jax")
    for what, target, value in (
      ("time", time_target, ours["time_ratio"]),
      ("temp bytes", temp_target, ours["temp_ratio"]),
    ):
      if target is not None:
        rows.append(target_row(f"{group} {what} / {ours['baseline']}", target, value))
  return {"full_size": full_size, "rows": rows}


def parser() -> argparse.ArgumentParser:
  return logits_parser(__doc__, QUICK_SHAPE, FULL_SHAPE, HERE / "results")


def main(argv: Sequence[str] | None = None) -> int:
  args = parser().parse_args(argv)
  result = run(args)
  print_ratio_report(result, "group")
  write_json(Path(args.out) / "logits.json", result)
  print(f"logits: wrote {Path(args.out) / 'logits.json'}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
