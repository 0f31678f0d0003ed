"""Sharding benchmarks: per-device memory of the vocabulary-parallel losses.

``vocab_parallel_memory()`` compiles (without running) ``value_and_grad`` of
``kl_div_from_logits``, of ``divergence_from_logits`` for every other divergence
and of ``fused_distillation_loss`` twice: on one device,
and inside ``jax.shard_map`` on 8 simulated CPU devices with the vocabulary
split over the mesh axis ``"vocab"`` (``axis_name="vocab"``). It reports XLA's
compiled memory analysis of both (temp, argument and output bytes) and the
collectives of the sharded HLO (the target: per-device temp at most
0.2x the single-device program's, and no all-gather of a vocabulary-sized
buffer).

For an SPMD program, ``memory_analysis()`` describes the program one device
runs: its argument bytes are those of one device's shards (logits and heads
split 8 ways, hidden states whole; the table checks it, column ``per-dev``),
so the figures are per device.

The device count of the CPU backend is fixed when JAX starts, so this module
sets ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before it imports
JAX; ``main`` re-runs itself in a subprocess when JAX was imported before
(``benchmarks/run.py`` runs sections in one process).

  python benchmarks/bench_sharding.py            # kl [4096, 32768]; fused N=2048 H=512 V=32768
  python benchmarks/bench_sharding.py --quick    # kl [512, 8192]; fused N=512 H=128 V=8192
"""

import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

NUM_DEVICES = 8
_FLAG = f"--xla_force_host_platform_device_count={NUM_DEVICES}"
if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get(
  "XLA_FLAGS", ""
):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _harness import memory_stats, parser, print_table, save, start  # noqa: E402
from bench_divergences import SPECS  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import kldiv_jax as kd  # noqa: E402

SHAPES = {
  False: {"kl": (4096, 32768), "fused": (2048, 512, 32768)},
  True: {"kl": (512, 8192), "fused": (512, 128, 8192)},
}
TARGET = 0.2
_COLLECTIVE = re.compile(
  r"=\s*(\(?[a-z0-9]+\[[^=]*?)\s+(all-gather|all-reduce|all-to-all|collective-permute|"
  r"reduce-scatter|all-gather-start|all-reduce-start)\("
)


def _collectives(hlo: str) -> list[list[str]]:
  return [[m.group(2), m.group(1).strip()] for m in _COLLECTIVE.finditer(hlo)]


def _last_dims(shape_text: str) -> set[int]:
  """The last dimension of each array in an HLO result shape (a tuple has several)."""
  return {int(s.split(",")[-1]) for s in re.findall(r"\[([\d,]*)\]", shape_text) if s}


def _elements(shape_text: str) -> int:
  """Elements of the largest array in an HLO result shape (a tuple has several)."""
  shapes = re.findall(r"\[([\d,]*)\]", shape_text)
  return max((int(np.prod([int(d) for d in s.split(",") if d])) for s in shapes), default=0)


def _total(m: dict[str, Any]) -> int:
  return m["temp_bytes"] + m["argument_bytes"] + m["output_bytes"]


def vocab_parallel_memory(quick: bool = False) -> dict[str, Any]:
  """Compiled per-device memory of the vocabulary-parallel losses vs one device.

  Returns ``{"devices", "rows": [{"program", "shape", "single", "sharded",
  "temp_ratio", "total_ratio", "per_device", "all_gathers",
  "largest_collective", "vocab_sized_collective"}]}``, bytes in the
  ``single``/``sharded`` dicts (``temp_bytes``, ``argument_bytes``,
  ``output_bytes``). ``total_ratio`` compares argument + output + temp.
  """
  if jax.device_count() < NUM_DEVICES:
    raise RuntimeError(
      f"vocab_parallel_memory needs {NUM_DEVICES} devices; JAX sees {jax.device_count()} "
      f"(set XLA_FLAGS={_FLAG} before JAX starts)."
    )
  mesh = Mesh(np.array(jax.devices()[:NUM_DEVICES]), ("vocab",))

  def spec(shape, sharding=None):
    s = None if sharding is None else NamedSharding(mesh, sharding)
    return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=s)

  # The single-device baseline runs on a one-device mesh inside shard_map: the
  # program a one-device machine compiles (under plain jit in this 8-device
  # process, the row-blocked CPU statistics would step aside for XLA's
  # partitioner, see kldiv_jax._rows).
  one = Mesh(np.array(jax.devices()[:1]), ("one",))

  def row(program, shape, loss, arg_shapes, in_specs, argnums, vocab):
    """``value_and_grad`` of ``loss(axis_name)`` on one device and sharded over the mesh."""
    single_fn = jax.shard_map(  # value_and_grad on the one device, as before the mesh
      jax.value_and_grad(loss(None), argnums),
      mesh=one,
      in_specs=P(),
      out_specs=P(),
      check_vma=False,
    )
    on_one = NamedSharding(one, P())
    single_args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=on_one) for s in arg_shapes]
    sharded_fn = jax.shard_map(loss("vocab"), mesh=mesh, in_specs=in_specs, out_specs=P())
    sharded_args = [spec(s, p) for s, p in zip(arg_shapes, in_specs)]
    single = jax.jit(single_fn).lower(*single_args).compile()
    sharded = jax.jit(jax.value_and_grad(sharded_fn, argnums)).lower(*sharded_args).compile()
    ms, mp = memory_stats(single), memory_stats(sharded)
    collectives = _collectives(sharded.as_text())
    local_vocab = vocab // NUM_DEVICES
    return {
      "program": program,
      "shape": shape,
      "single": ms,
      "sharded": mp,
      "temp_ratio": mp["temp_bytes"] / max(ms["temp_bytes"], 1),
      "total_ratio": _total(mp) / max(_total(ms), 1),
      # memory_analysis describes one device's program: its arguments are the shards.
      "per_device": mp["argument_bytes"]
      == sum(
        int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize for a in sharded_args
      ),
      "all_gathers": [c for c in collectives if "all-gather" in c[0]],
      "largest_collective": max((c[1] for c in collectives), key=_elements, default=""),
      # The class axis is the last one of the logits, of their per-row statistics
      # ([rows, 1]) and of any slice of them a collective would carry.
      "vocab_sized_collective": any(_last_dims(c[1]) & {vocab, local_vocab} for c in collectives),
    }

  n, v = SHAPES[quick]["kl"]

  def per_example(fn, **kw):  # the sum over rows of fn, given the axis name
    return lambda axis_name: (
      lambda a, b: jnp.sum(fn(a, b, temperature=2.0, axis_name=axis_name, **kw))
    )

  losses = {"kl_div_from_logits": per_example(kd.kl_div_from_logits)}
  # Every other divergence of the engine, per example (the same shapes).
  losses |= {
    f"divergence_from_logits {name}": per_example(kd.divergence_from_logits, divergence=div)
    for name, div in SPECS.items()
    if name != "forward_kl"
  }
  rows = [
    row(f"{name} value_and_grad", f"[{n}, {v}]", loss, [(n, v)] * 2, (P(None, "vocab"),) * 2, 0, v)
    for name, loss in losses.items()
  ]
  n, h, v = SHAPES[quick]["fused"]

  def fused(axis_name):
    return lambda a, w, ta, tw: kd.fused_distillation_loss(
      a, w, ta, tw, temperature=2.0, axis_name=axis_name
    )

  rows.append(
    row(
      "fused_distillation_loss value_and_grad (hidden, weight)",
      f"N={n} H={h} V={v}",
      fused,
      [(n, h), (h, v), (n, h), (h, v)],
      (P(), P(None, "vocab"), P(), P(None, "vocab")),
      (0, 1),
      v,
    )
  )
  return {"devices": NUM_DEVICES, "target_temp_ratio": TARGET, "rows": rows}


def _passes(r: dict[str, Any]) -> bool:
  return r["temp_ratio"] <= TARGET and not r["all_gathers"] and not r["vocab_sized_collective"]


def print_report(result: dict[str, Any]) -> None:
  print(
    f"vocabulary-parallel memory, {result['devices']} simulated CPU devices, float32, "
    "compiled (not run); MiB per device"
  )
  mib = [("temp 1", ">8.2f"), ("temp 8", ">8.2f"), ("ratio", ">6.3f")]
  mib += [("arg+out+temp 1", ">15.2f"), ("... 8", ">8.2f"), ("ratio", ">6.3f")]
  rows = []
  for r in result["rows"]:
    sizes = [r[k]["temp_bytes"] / 2**20 for k in ("single", "sharded")] + [r["temp_ratio"]]
    sizes += [_total(r[k]) / 2**20 for k in ("single", "sharded")] + [r["total_ratio"]]
    gathers = ["yes" if r["per_device"] else "NO", len(r["all_gathers"])]
    rows.append([r["program"], r["shape"], *sizes, *gathers])
  print_table(
    [("program", "60"), ("shape", "22"), *mib, ("per-dev", ">7"), ("gather", ">6d")], rows
  )
  for r in result["rows"]:
    print(
      f"  {'PASS' if _passes(r) else 'FAIL'} {r['program']}: temp {r['temp_ratio']:.3f}x "
      f"(target <= {result['target_temp_ratio']}x), {len(r['all_gathers'])} all-gathers, "
      f"largest collective {r['largest_collective']}"
    )


def main(argv: Sequence[str] | None = None) -> int:
  p = parser(__doc__, quick="smaller shapes", repeats="ignored (nothing is timed)")
  args = p.parse_args(argv)
  if jax.device_count() < NUM_DEVICES:  # JAX started before this module set XLA_FLAGS
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {_FLAG}".strip()
    rest = list(sys.argv[1:] if argv is None else argv)
    cmd = [sys.executable, str(Path(__file__).resolve()), *rest]
    return subprocess.run(cmd, env=env, check=False).returncode
  machine = start("sharding")
  result = vocab_parallel_memory(quick=args.quick)
  print_report(result)
  save({"section": "sharding", "machine": machine, "vocab_parallel_memory": result}, args.out)
  return 0 if all(_passes(r) for r in result["rows"]) else 1


if __name__ == "__main__":
  raise SystemExit(main())
