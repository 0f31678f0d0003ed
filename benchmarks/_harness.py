"""Timing, memory and machine-description helpers shared by the benchmark sections.

Every section times its contenders the same way:

* jitted functions are compiled ahead of time (``jax.jit(f).lower(*args).compile()``),
  which also gives XLA's compiled memory analysis, then run once to warm up;
* contenders of one group are timed round-robin (one call of each per repeat, the
  starting contender rotating) so that noise from a shared machine hits all of them
  alike; each call is timed with ``time.perf_counter`` around the call and
  ``jax.block_until_ready`` of its result;
* each timed call is preceded by one untimed call of the same contender (steady
  state, as in a training loop). XLA:CPU releases an execution's large temporary
  buffers after ``block_until_ready`` returns, so without this the unmapping of
  one contender's temporaries (hundreds of MiB for the straightforward versions)
  runs during the next contender's timed call: the first is under-charged and the
  second over-charged. Measured on the logits section's ``kl`` group, this shifted
  the ratio by 0.15-0.2 against kldiv_jax. ``BENCH_SETTLE=0`` in the environment
  times without the untimed call, to compare;
* the reported figure is the median over repeats.
"""

import argparse
import contextlib
import gc
import importlib.metadata
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax


def core_count() -> int:
  """CPU cores this process may run on (the affinity mask where the OS has one)."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # pragma: no cover - macOS, Windows
    return os.cpu_count() or 1


def cpu_model() -> str:
  """The CPU model name from ``/proc/cpuinfo``, or what ``platform`` knows."""
  with contextlib.suppress(OSError):
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.lower().startswith("model name"):
        return line.split(":", 1)[1].strip()
  return platform.processor() or platform.machine()


def _version(dist: str) -> str | None:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return None


def machine_info() -> dict[str, Any]:
  """What the numbers were measured on: CPU, cores, devices and library versions."""
  device = jax.devices()[0]
  return {
    "cpu_model": cpu_model(),
    "cpu_cores": core_count(),
    "cpu_count_os": os.cpu_count(),
    "platform": platform.platform(),
    "python": platform.python_version(),
    "backend": jax.default_backend(),
    "device_kind": device.device_kind,
    "device_count": jax.device_count(),
    "versions": {
      name: _version(name) for name in ("jax", "jaxlib", "optax", "torch", "numpy", "kldiv_jax")
    },
    "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    "settled_timing": settling(),
  }


def describe_machine(info: dict[str, Any]) -> str:
  """One line naming the machine, for terminal output."""
  versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v)
  return (
    f"{info['cpu_model']} ({info['cpu_cores']} cores), backend {info['backend']} "
    f"[{info['device_kind']} x{info['device_count']}]; {versions}"
    + ("" if info.get("settled_timing", True) else "; BENCH_SETTLE=0 (plain round-robin)")
  )


def memory_stats(compiled: Any) -> dict[str, int | None]:
  """XLA's compiled memory analysis: temp and output bytes (``None`` where unknown)."""
  try:
    stats = compiled.memory_analysis()
  except Exception:
    stats = None
  if stats is None:
    return {"temp_bytes": None, "output_bytes": None}
  return {
    "temp_bytes": int(stats.temp_size_in_bytes),
    "output_bytes": int(stats.output_size_in_bytes),
  }


def compile_jax(fn: Callable[..., Any], *args: Any) -> tuple[Callable[[], Any], dict[str, Any]]:
  """Compiles ``fn`` for ``args``; returns a blocking thunk and its memory stats."""
  start = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  info = memory_stats(compiled)
  info["compile_s"] = time.perf_counter() - start

  def call() -> Any:
    return jax.block_until_ready(compiled(*args))

  return call, info


def settling() -> bool:
  """Whether timed calls follow an untimed call of the same thunk (``BENCH_SETTLE``, default 1)."""
  return os.environ.get("BENCH_SETTLE", "1") != "0"


def round_robin(
  thunks: dict[str, Callable[[], Any]],
  repeats: int,
  warmup: int = 1,
  settle: bool | None = None,
) -> dict[str, list[float]]:
  """Times each thunk ``repeats`` times, interleaved; returns seconds per call per thunk.

  Each thunk must block until its work is done (``compile_jax``'s thunks do).
  With ``settle`` (default :func:`settling`), every timed call follows an
  untimed call of the same thunk, so that each is charged for its own deferred
  deallocations and for no other thunk's (see the module docstring). Python's garbage collector is off while timing, as in
  ``timeit``.
  """
  if settle is None:
    settle = settling()
  names = list(thunks)
  for _ in range(warmup):
    for name in names:
      thunks[name]()
  times: dict[str, list[float]] = {name: [] for name in names}
  gc.collect()
  was_enabled = gc.isenabled()
  gc.disable()
  try:
    for rep in range(repeats):
      shift = rep % len(names) if names else 0
      for name in names[shift:] + names[:shift]:
        fn = thunks[name]
        if settle:
          fn()
        start = time.perf_counter()
        fn()
        times[name].append(time.perf_counter() - start)
  finally:
    if was_enabled:
      gc.enable()
  return times


def median_ms(seconds: Sequence[float]) -> float:
  return 1e3 * statistics.median(seconds)


def ratio(a: float | None, b: float | None) -> float | None:
  """``a / b``, or ``None`` where either is missing or ``b`` is zero."""
  if a is None or b is None or b == 0:
    return None
  return a / b


def fmt_ms(ms: float | None) -> str:
  if ms is None:
    return "-"
  return f"{ms:.3f}" if ms < 10 else f"{ms:.2f}" if ms < 100 else f"{ms:.1f}"


def fmt_ratio(r: float | None) -> str:
  return "-" if r is None else f"{r:.2f}"


def fmt_bytes(n: int | None) -> str:
  if n is None:
    return "-"
  for unit in ("B", "K", "M", "G"):
    if abs(n) < 1024 or unit == "G":
      return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
    n /= 1024
  return str(n)  # pragma: no cover


def write_json(path: Path, payload: dict[str, Any]) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(path.suffix + ".tmp")
  tmp.write_text(json.dumps(payload, indent=1, sort_keys=False) + "\n")
  tmp.replace(path)


def target_row(target: str, limit: float, value: float | None) -> dict[str, Any]:
  """One row of a section's targets: ``value <= limit`` (``None`` when not measured)."""
  return {
    "target": target,
    "limit": limit,
    "value": value,
    "pass": None if value is None else value <= limit,
  }


def print_ratio_report(result: dict[str, Any], key: str) -> None:
  """The report of a value_and_grad section whose records are grouped by ``key``.

  One line per record (median ms and temp bytes, each with its ratio to the
  group's baseline), then the targets; used by the logits and divergences sections.
  """
  print(describe_machine(result["machine"]))
  s = result["settings"]
  print(
    f"value_and_grad wrt the student's logits, shape {tuple(s['shape'])} float32, "
    f"T = {s['temperature']}, median of {s['repeats']}"
  )
  width = max([len(key), *(len(str(r[key])) for r in result["records"])])
  header = f"{key:{width}} {'contender':16} {'ms':>9} {'ratio':>6} {'temp':>9} {'ratio':>6}"
  print(header)
  print("-" * len(header))
  for r in result["records"]:
    print(
      f"{r[key]:{width}} {r['contender']:16} {fmt_ms(r['median_ms']):>9} "
      f"{fmt_ratio(r['time_ratio']):>6} {fmt_bytes(r['temp_bytes']):>9} "
      f"{fmt_ratio(r['temp_ratio']):>6}"
    )
  targets = result["targets"]
  note = "" if targets["full_size"] else " (indicative only: not the (4096, 8192) size)"
  print(f"Targets{note}:")
  target_width = max((len(row["target"]) for row in targets["rows"]), default=0)
  for row in targets["rows"]:
    verdict = {True: "PASS", False: "FAIL", None: "n/a"}[row["pass"]]
    print(
      f"  {verdict:4}  {row['target']:{target_width}} {fmt_ratio(row['value']):>6} <= {row['limit']}"
    )


def logits_parser(
  doc: str, quick_shape: tuple[int, int], full_shape: tuple[int, int], out: Path
) -> argparse.ArgumentParser:
  """The options shared by the sections timed on ``[rows, classes]`` logits."""
  p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
  p.add_argument("--quick", action="store_true", help=f"shape {quick_shape}, 3 repeats")
  p.add_argument("--rows", type=int, default=None, help="rows (with --classes)")
  p.add_argument("--classes", type=int, default=full_shape[1])
  p.add_argument("--temperature", type=float, default=2.0)
  p.add_argument("--repeats", type=int, default=None, help="repeats (default 7, quick 3)")
  p.add_argument("--out", type=Path, default=out)
  p.add_argument("--seed", type=int, default=0)
  return p


def timing_records(
  times: dict[str, list[float]], infos: dict[str, dict[str, Any]], baseline: str, **fields: Any
) -> list[dict[str, Any]]:
  """One record per contender: median and every time, XLA memory, ratios to ``baseline``.

  ``fields`` (the case: shape, dtype, temperature, ...) are copied into each record.
  """
  base_ms, base_temp = median_ms(times[baseline]), infos[baseline]["temp_bytes"]
  records = []
  for contender, seconds in times.items():
    ms = median_ms(seconds)
    records.append(
      {
        **fields,
        "contender": contender,
        "median_ms": ms,
        "times_ms": [1e3 * t for t in seconds],
        "repeats": len(seconds),
        "temp_bytes": infos[contender]["temp_bytes"],
        "output_bytes": infos[contender]["output_bytes"],
        "compile_s": infos[contender]["compile_s"],
        "baseline": baseline,
        "time_ratio": ratio(ms, base_ms),
        "temp_ratio": ratio(infos[contender]["temp_bytes"], base_temp),
      }
    )
  return records


def logits_result(
  section: str,
  args: Any,
  shape: tuple[int, int],
  repeats: int,
  full_shape: tuple[int, int],
  records: list[dict[str, Any]],
  evaluate: Callable[[list[dict[str, Any]], bool], dict[str, Any]],
) -> dict[str, Any]:
  """The JSON payload of a logits-style section: machine, settings, records, targets."""
  full_size = tuple(shape) == tuple(full_shape)
  return {
    "section": section,
    "machine": machine_info(),
    "settings": {
      "shape": list(shape),
      "temperature": args.temperature,
      "repeats": repeats,
      "seed": args.seed,
      "full_size": full_size,
    },
    "records": records,
    "targets": evaluate(records, full_size),
  }
