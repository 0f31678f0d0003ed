"""LLM-distillation options: what soft-capping, vocabulary padding, the hard loss in the fused
head and a top-k tail bucket cost.

Each figure is a ratio of two contenders measured side by side (``benchmarks/README.md``
lists them): ``overheads`` (``value_and_grad`` time with the option against without it;
target: each at most 1.1x), ``fused memory`` (compiled temp of the fused head with labels
and soft-caps against the materialised loss, N=8192, H=1024, V=65536; at most 0.05x) and
``top-k memory`` (the ``tail="bucket"`` top-k divergence against the materialised
``log_softmax``, N=4096, V=131072, k=64; at most 0.02x). ``--quick``: small shapes.
"""

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from _harness import (
  compare_memory,
  f32,
  parser,
  print_memory,
  print_targets,
  print_times,
  ratio_targets,
  save,
  start,
  target_row,
  time_contenders,
)

import kldiv_jax

T = 2.0
CAP = 30.0
PAD = 128
# (tokens, vocab) of the logits overheads; (tokens, hidden, vocab) of the fused ones
LOGITS_SHAPE, QUICK_LOGITS_SHAPE = (2048, 16384), (128, 1024)
FUSED_SHAPE, QUICK_FUSED_SHAPE = (1024, 512, 16384), (64, 32, 1024)
FUSED_MEMORY_SHAPE, QUICK_FUSED_MEMORY_SHAPE = (8192, 1024, 65536), (512, 64, 4096)
TOPK_SHAPE, QUICK_TOPK_SHAPE = (4096, 131072, 64), (128, 4096, 16)


def _keys(n):
  return jax.random.split(jax.random.key(0), n)


def logits_contenders(shape):
  n, v = shape
  k = _keys(3)
  s = jax.random.normal(k[0], (n, v)) * 2
  t = jax.random.normal(k[1], (n, v + PAD)) * 2
  y = jax.random.randint(k[2], (n,), 0, v)

  def loss(**kw):
    def fn(s, t):
      return kldiv_jax.distillation_loss(s, t, y, temperature=T, **kw)

    return jax.value_and_grad(fn)

  same = (s, t[:, :v])
  return {
    "logits: plain": (loss(), same),
    "logits: softcap": (loss(softcap=CAP, target_softcap=CAP), same),
    "logits: padded teacher": (loss(teacher_vocab_size=v + PAD), (s, t)),
  }


def fused_contenders(shape):
  n, h, v = shape
  k = _keys(5)
  hs = jax.random.normal(k[0], (n, h))
  w = jax.random.normal(k[1], (h, v)) / h**0.5 * 2
  th = jax.random.normal(k[2], (n, h))
  tw = jax.random.normal(k[3], (h, v + PAD)) / h**0.5 * 2
  y = jax.random.randint(k[4], (n,), 0, v)

  def loss(**kw):
    def fn(hs, w, th, tw):
      return kldiv_jax.fused_distillation_loss(hs, w, th, tw, temperature=T, **kw)

    return jax.value_and_grad(fn, argnums=(0, 1))

  same = (hs, w, th, tw[:, :v])
  return {
    "fused: plain": (loss(), same),
    "fused: softcap": (loss(softcap=CAP, target_softcap=CAP), same),
    "fused: padded teacher": (loss(teacher_vocab_size=v + PAD), (hs, w, th, tw)),
    "fused: labels (CE inside)": (loss(labels=y, alpha=0.5), same),
  }


# (target, limit, with the option, without it): time ratios.
OVERHEADS = (
  ("soft-capping, distillation_loss", 1.1, "logits: softcap", "logits: plain"),
  ("padded teacher, distillation_loss", 1.1, "logits: padded teacher", "logits: plain"),
  ("soft-capping, fused head", 1.1, "fused: softcap", "fused: plain"),
  ("padded teacher, fused head", 1.1, "fused: padded teacher", "fused: plain"),
  ("hard loss inside the fused head", 1.1, "fused: labels (CE inside)", "fused: plain"),
)


def measure_fused_memory(shape) -> dict[str, Any]:
  n, h, v = shape
  args = (f32(n, h), f32(h, v), f32(n, h), f32(h, v), jax.ShapeDtypeStruct((n,), jnp.int32))
  kw = dict(temperature=T, alpha=0.5, softcap=CAP, target_softcap=CAP)

  def fused(hs, w, th, tw, y):
    return kldiv_jax.fused_distillation_loss(hs, w, th, tw, labels=y, **kw)

  def materialised(hs, w, th, tw, y):
    return kldiv_jax.distillation_loss(hs @ w, jax.lax.stop_gradient(th @ tw), y, **kw)

  fns = {"fused": fused, "materialised": materialised}
  return compare_memory(fns, args, (0, 1), tokens=n, hidden=h, vocab=v)


def _materialised_topk(z, ids, lp):
  """Forward KL with the tail bucket on the materialised log-softmax (what one writes without
  kldiv_jax: the ``[N, V]`` log-probabilities, gathered, a tail appended)."""
  lq = jnp.take_along_axis(jax.nn.log_softmax(z / T), ids, axis=-1)
  q_tail = jnp.log1p(-jnp.minimum(jnp.exp(lq).sum(-1, keepdims=True), 1 - 1e-6))
  p_tail = jnp.log1p(-jnp.minimum(jnp.exp(lp).sum(-1, keepdims=True), 1 - 1e-6))
  log_p = jnp.concatenate([lp, p_tail], -1)
  log_q = jnp.concatenate([lq, q_tail], -1)
  return jnp.sum(jnp.exp(log_p) * (log_p - log_q))


def measure_topk_memory(shape) -> dict[str, Any]:
  n, v, k = shape
  args = (f32(n, v), jax.ShapeDtypeStruct((n, k), jnp.int32), f32(n, k))

  def topk(z, ids, lp):
    return kldiv_jax.divergence_from_topk(z, ids, lp, temperature=T, tail="bucket").sum()

  fns = {"topk": topk, "materialised": _materialised_topk}
  return compare_memory(fns, args, tokens=n, vocab=v, k=k, logits_bytes=n * v * 4)


def main(argv: Sequence[str] | None = None) -> int:
  args = parser(__doc__, repeats="timed calls per contender (default 5)").parse_args(argv)
  q = args.quick
  repeats = args.repeats or 5
  machine = start("llm")
  logits_shape = QUICK_LOGITS_SHAPE if q else LOGITS_SHAPE
  fused_shape = QUICK_FUSED_SHAPE if q else FUSED_SHAPE
  times = time_contenders(logits_contenders(logits_shape), repeats)
  times |= time_contenders(fused_contenders(fused_shape), repeats)
  fused_memory = measure_fused_memory(QUICK_FUSED_MEMORY_SHAPE if q else FUSED_MEMORY_SHAPE)
  topk_memory = measure_topk_memory(QUICK_TOPK_SHAPE if q else TOPK_SHAPE)
  targets = ratio_targets(OVERHEADS, times)
  for what, limit, m in (
    ("fused temp / materialised (labels, caps)", 0.05, fused_memory),
    ("top-k tail bucket temp / log_softmax", 0.02, topk_memory),
  ):
    targets.append(target_row(what, limit, m["temp_ratio"]))
  print_times(
    f"\nvalue_and_grad time, median of {repeats} (round-robin): logits {logits_shape}, "
    f"fused (N, H, V) = {fused_shape}",
    times,
  )
  for m, what in (
    (fused_memory, "fused head N={tokens} H={hidden} V={vocab}"),
    (topk_memory, "top-k N={tokens} V={vocab} k={k}"),
  ):
    print_memory(f"\ncompiled temp, {what.format(**m)}:", m)
  print_targets(targets, q)
  settings = {"quick": q, "repeats": repeats, "temperature": T, "softcap": CAP, "pad": PAD}
  result = {"section": "llm", "machine": machine, "settings": settings, "times": times}
  save(
    result | {"fused_memory": fused_memory, "topk_memory": topk_memory, "targets": targets},
    args.out,
  )
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
