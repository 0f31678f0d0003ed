"""Large-vocabulary benchmark: ``fused_distillation_loss`` against materialised logits.

Two contenders, both ``jax.value_and_grad`` wrt the student's hidden states
and LM head (float32, forward KL at temperature 2, the teacher stopped):

* ``fused``: ``kldiv_jax.fused_distillation_loss(hidden, weight, target_hidden,
  target_weight, temperature=2.0)`` (logits made a chunk of tokens at a time,
  ``chunk_size=None``);
* ``materialised``: ``kldiv_jax.distillation_loss(hidden @ weight,
  stop_gradient(target_hidden @ target_weight), temperature=2.0)``, the full
  ``[N, V]`` logits of both sides.

Measured:

* ``memory``: XLA's compiled temp bytes of both, compiled without running
  (``jax.ShapeDtypeStruct`` arguments) at N=8192 tokens, H=1024, V=65536.
  Target: fused at most 0.05x the materialised temp.
* ``time``: jitted, warmed up, timed round-robin (median of 3) at N=2048,
  H=1024, V=32768. Target: fused at most 1.1x the materialised time.

``--quick`` uses small shapes (a smoke test: the targets are not meaningful
there). Run through ``benchmarks/run.py`` (section ``large``) or directly:

  python benchmarks/bench_large.py            # full size; the timing takes minutes on 2 cores
  python benchmarks/bench_large.py --quick
"""

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from _harness import (
  compile_jax,
  describe_machine,
  fmt_bytes,
  fmt_ms,
  fmt_ratio,
  machine_info,
  median_ms,
  memory_stats,
  ratio,
  round_robin,
  write_json,
)

import kldiv_jax

HERE = Path(__file__).resolve().parent
TEMPERATURE = 2.0
# (tokens, hidden, vocab)
MEMORY_SHAPE = (8192, 1024, 65536)
TIME_SHAPE = (2048, 1024, 32768)
QUICK_MEMORY_SHAPE = (1024, 64, 8192)
QUICK_TIME_SHAPE = (256, 64, 2048)
MEMORY_TARGET = 0.05
TIME_TARGET = 1.1


def fused(hidden, weight, target_hidden, target_weight):
  return kldiv_jax.fused_distillation_loss(
    hidden, weight, target_hidden, target_weight, temperature=TEMPERATURE
  )


def materialised(hidden, weight, target_hidden, target_weight):
  logits = hidden @ weight
  target = jax.lax.stop_gradient(target_hidden @ target_weight)
  return kldiv_jax.distillation_loss(logits, target, temperature=TEMPERATURE)


CONTENDERS = {"fused": fused, "materialised": materialised}


def value_and_grad(fn):
  return jax.value_and_grad(fn, argnums=(0, 1))


def abstract_args(tokens: int, hidden: int, vocab: int) -> tuple[jax.ShapeDtypeStruct, ...]:
  h = jax.ShapeDtypeStruct((tokens, hidden), jnp.float32)
  w = jax.ShapeDtypeStruct((hidden, vocab), jnp.float32)
  return h, w, h, w


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
  args = abstract_args(*shape)
  out: dict[str, Any] = {
    "tokens": tokens,
    "hidden": hidden,
    "vocab": vocab,
    "logits_bytes": tokens * vocab * 4,
  }
  for name, fn in CONTENDERS.items():
    compiled = jax.jit(value_and_grad(fn)).lower(*args).compile()
    out[name] = memory_stats(compiled)
  out["temp_ratio"] = ratio(out["fused"]["temp_bytes"], out["materialised"]["temp_bytes"])
  return out


def measure_time(shape: tuple[int, int, int], repeats: int, seed: int) -> dict[str, Any]:
  tokens, hidden, vocab = shape
  args = random_args(*shape, seed)
  thunks, info = {}, {}
  for name, fn in CONTENDERS.items():
    thunks[name], info[name] = compile_jax(value_and_grad(fn), *args)
  values = {name: float(thunk()[0]) for name, thunk in thunks.items()}  # also the warm-up
  times = round_robin(thunks, repeats, warmup=0)
  out: dict[str, Any] = {"tokens": tokens, "hidden": hidden, "vocab": vocab, "repeats": repeats}
  for name in CONTENDERS:
    out[name] = {
      "median_ms": median_ms(times[name]),
      "times_ms": [1e3 * t for t in times[name]],
      "loss": values[name],
      **info[name],
    }
  out["time_ratio"] = ratio(out["fused"]["median_ms"], out["materialised"]["median_ms"])
  out["loss_relative_difference"] = abs(values["fused"] - values["materialised"]) / abs(
    values["materialised"]
  )
  return out


def targets(memory: dict[str, Any], time: dict[str, Any], quick: bool) -> list[dict[str, Any]]:
  rows = [
    ("fused temp memory / materialised", memory["temp_ratio"], MEMORY_TARGET, memory),
    ("fused time / materialised", time["time_ratio"], TIME_TARGET, time),
  ]
  return [
    {
      "target": what,
      "shape": f"N={m['tokens']} H={m['hidden']} V={m['vocab']}",
      "value": value,
      "limit": limit,
      "met": None if value is None else bool(value <= limit),
      "quick": quick,
    }
    for what, value, limit, m in rows
  ]


def print_report(result: dict[str, Any]) -> None:
  memory, time = result["memory"], result["time"]
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
  print(
    "\ntargets"
    + (" (--quick: small shapes, not the full-size ones)" if result["settings"]["quick"] else "")
  )
  for t in result["targets"]:
    met = {True: "met", False: "MISSED", None: "-"}[t["met"]]
    print(f"  {t['target']:34} {t['shape']:24} {fmt_ratio(t['value']):>6} <= {t['limit']:<5} {met}")


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--quick", action="store_true", help="small shapes (smoke test)")
  p.add_argument("--repeats", type=int, default=None, help="timed calls per contender (default 3)")
  p.add_argument(
    "--out",
    type=Path,
    default=None,
    help="directory for large.json (default: benchmarks/results when run as a script)",
  )
  p.add_argument("--seed", type=int, default=0)
  return p


def main(argv: Sequence[str] | None = None, *, default_out: Path | None = None) -> dict[str, Any]:
  """Runs the section; returns its results (JSON-serialisable) and writes ``large.json``
  to ``--out`` (or ``default_out``) when one is given."""
  args = parser().parse_args(argv)
  memory_shape = QUICK_MEMORY_SHAPE if args.quick else MEMORY_SHAPE
  time_shape = QUICK_TIME_SHAPE if args.quick else TIME_SHAPE
  repeats = args.repeats or 3
  machine = machine_info()
  print(f"large: {describe_machine(machine)}")
  memory = measure_memory(memory_shape)
  time = measure_time(time_shape, repeats, args.seed)
  result = {
    "section": "large",
    "machine": machine,
    "settings": {
      "quick": args.quick,
      "repeats": repeats,
      "seed": args.seed,
      "temperature": TEMPERATURE,
      "dtype": "float32",
      "memory_shape": list(memory_shape),
      "time_shape": list(time_shape),
      "contenders": {
        "fused": "fused_distillation_loss(h, w, th, tw, temperature=2.0)",
        "materialised": "distillation_loss(h @ w, stop_gradient(th @ tw), temperature=2.0)",
      },
    },
    "memory": memory,
    "time": time,
  }
  result["targets"] = targets(memory, time, args.quick)
  print_report(result)
  out = args.out or default_out
  if out is not None:
    write_json(Path(out) / "large.json", result)
    print(f"large: wrote {Path(out) / 'large.json'}")
  return result


if __name__ == "__main__":
  main(sys.argv[1:], default_out=HERE / "results")
