"""Large-vocabulary benchmark: ``fused_distillation_loss`` against materialised logits.

``value_and_grad`` wrt the student's hidden states and head (float32, forward KL, T = 2,
the teacher stopped) of ``fused_distillation_loss`` against ``distillation_loss`` on
``hidden @ weight``: compiled temp at N=8192, H=1024, V=65536 (target: at most 0.05x) and
time at N=2048, H=1024, V=32768 (target: at most 1.1x). ``--quick``: small shapes.
"""

from collections.abc import Sequence
from typing import Any

import jax
from _harness import (
  compare_memory,
  f32,
  fmt_bytes,
  fmt_ms,
  parser,
  print_targets,
  ratio,
  save,
  start,
  target_row,
  time_grads,
)

import kldiv_jax

TEMPERATURE = 2.0
# (tokens, hidden, vocab)
MEMORY_SHAPE, QUICK_MEMORY_SHAPE = (8192, 1024, 65536), (1024, 64, 8192)
TIME_SHAPE, QUICK_TIME_SHAPE = (2048, 1024, 32768), (256, 64, 2048)
MEMORY_TARGET, TIME_TARGET = 0.05, 1.1


def fused(hidden, weight, target_hidden, target_weight):
  return kldiv_jax.fused_distillation_loss(
    hidden, weight, target_hidden, target_weight, temperature=TEMPERATURE
  )


def materialised(hidden, weight, target_hidden, target_weight):
  logits = hidden @ weight
  target = jax.lax.stop_gradient(target_hidden @ target_weight)
  return kldiv_jax.distillation_loss(logits, target, temperature=TEMPERATURE)


CONTENDERS = {"fused": fused, "materialised": materialised}


def random_args(tokens: int, hidden: int, vocab: int, seed: int) -> tuple[jax.Array, ...]:
  """Hidden states ~ N(0, 1), heads ~ N(0, 1/H): logits of unit scale."""
  k = jax.random.split(jax.random.key(seed), 4)
  scale = 1.0 / hidden**0.5
  return (
    jax.random.normal(k[0], (tokens, hidden)),
    jax.random.normal(k[1], (hidden, vocab)) * scale,
    jax.random.normal(k[2], (tokens, hidden)),
    jax.random.normal(k[3], (hidden, vocab)) * scale,
  )


def measure_memory(shape: tuple[int, int, int]) -> dict[str, Any]:
  tokens, hidden, vocab = shape
  args = (f32(tokens, hidden), f32(hidden, vocab)) * 2
  fields = dict(tokens=tokens, hidden=hidden, vocab=vocab, logits_bytes=tokens * vocab * 4)
  return compare_memory(CONTENDERS, args, (0, 1), **fields)


def measure_time(shape: tuple[int, int, int], repeats: int, seed: int) -> dict[str, Any]:
  out: dict[str, Any] = dict(zip(("tokens", "hidden", "vocab"), shape)) | {"repeats": repeats}
  keep = ("loss", lambda value_grads: float(value_grads[0]))
  out |= time_grads(CONTENDERS, random_args(*shape, seed), repeats, (0, 1), keep=keep)
  out["time_ratio"] = ratio(out["fused"]["median_ms"], out["materialised"]["median_ms"])
  loss = out["materialised"]["loss"]
  out["loss_relative_difference"] = abs(out["fused"]["loss"] - loss) / abs(loss)
  return out


def print_report(memory: dict[str, Any], time: dict[str, Any]) -> None:
  print(
    f"\nXLA compiled memory of value_and_grad, N={memory['tokens']} H={memory['hidden']} "
    f"V={memory['vocab']} float32 (one side's logits: {fmt_bytes(memory['logits_bytes'])})"
  )
  print(f"  {'contender':14} {'temp':>10} {'output':>10}")
  for name in CONTENDERS:
    m = memory[name]
    print(f"  {name:14} {fmt_bytes(m['temp_bytes']):>10} {fmt_bytes(m['output_bytes']):>10}")
  print(
    f"\nvalue_and_grad time, N={time['tokens']} H={time['hidden']} V={time['vocab']} float32, "
    f"median of {time['repeats']} (round-robin)"
  )
  print(f"  {'contender':14} {'median ms':>10} {'temp':>10}  times ms")
  for name in CONTENDERS:
    t = time[name]
    times = ", ".join(fmt_ms(x) for x in t["times_ms"])
    print(f"  {name:14} {fmt_ms(t['median_ms']):>10} {fmt_bytes(t['temp_bytes']):>10}  {times}")
  print(f"  loss relative difference fused vs materialised: {time['loss_relative_difference']:.1e}")


def main(argv: Sequence[str] | None = None) -> int:
  args = parser(__doc__, repeats="timed calls per contender (default 3)").parse_args(argv)
  memory_shape = QUICK_MEMORY_SHAPE if args.quick else MEMORY_SHAPE
  time_shape = QUICK_TIME_SHAPE if args.quick else TIME_SHAPE
  repeats = args.repeats or 3
  machine = start("large")
  memory = measure_memory(memory_shape)
  time = measure_time(time_shape, repeats, args.seed)
  settings = {"quick": args.quick, "repeats": repeats, "seed": args.seed}
  settings |= {"temperature": TEMPERATURE, "dtype": "float32"}
  settings |= {"memory_shape": list(memory_shape), "time_shape": list(time_shape)}
  settings["contenders"] = {
    "fused": "fused_distillation_loss(h, w, th, tw, temperature=2.0)",
    "materialised": "distillation_loss(h @ w, stop_gradient(th @ tw), temperature=2.0)",
  }
  targets = [
    target_row(what, limit, m[key], shape=f"N={m['tokens']} H={m['hidden']} V={m['vocab']}")
    for what, m, key, limit in (
      ("fused temp memory / materialised", memory, "temp_ratio", MEMORY_TARGET),
      ("fused time / materialised", time, "time_ratio", TIME_TARGET),
    )
  ]
  print_report(memory, time)
  print_targets(targets, args.quick)
  result = {"section": "large", "machine": machine, "settings": settings}
  save(result | {"memory": memory, "time": time, "targets": targets}, args.out)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
