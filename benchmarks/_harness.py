"""What the benchmark sections share: the protocol, timing, memory, reports and the machine.

A section is ``benchmarks/bench_<name>.py`` with ``main(argv=None) -> int``: it parses
``argv`` with :func:`parser`, prints its table and its targets (:func:`print_targets`),
writes ``<out>/<name>.json`` (:func:`save`) and returns its exit status. How contenders are
timed (ahead-of-time compiled, round-robin, each timed call after an untimed one, medians)
is ``benchmarks/README.md``'s *Method*; :func:`round_robin` does it. The float64 references
come from ``tests/_references.py``, the test suite's own.
"""

import argparse
import contextlib
import gc
import importlib.metadata
import json
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:  # this checkout's kldiv_jax, whatever the environment installed
  sys.path.insert(0, str(REPO))
if str(REPO / "tests") not in sys.path:  # `import _references`
  sys.path.append(str(REPO / "tests"))

import jax  # noqa: E402

RESULTS = HERE / "results"


# ----------------------------------------------------------------------------- the machine


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


def start(section: str) -> dict[str, Any]:
  """The machine's description, printed under the section's name."""
  machine = machine_info()
  print(f"{section}: {describe_machine(machine)}")
  return machine


# ----------------------------------------------------------------------------- the protocol


def parser(doc: str, quick: str = "small shapes (smoke test)", repeats: str = "timed calls"):
  """The options every section takes (``run.py`` passes ``--quick``, ``--repeats``, ``--out``)."""
  p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
  p.add_argument("--quick", action="store_true", help=quick)
  p.add_argument("--repeats", type=int, default=None, help=repeats)
  p.add_argument("--out", type=Path, default=RESULTS, help="output directory")
  p.add_argument("--seed", type=int, default=0)
  return p


def write_json(path: Path, payload: dict[str, Any]) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(path.suffix + ".tmp")
  tmp.write_text(json.dumps(payload, indent=1, sort_keys=False) + "\n")
  tmp.replace(path)


def save(result: dict[str, Any], out: Path, note: str = "") -> Path:
  """Writes ``<out>/<section>.json`` and says so."""
  path = Path(out) / f"{result['section']}.json"
  write_json(path, result)
  print(f"{result['section']}: wrote {path}{note}")
  return path


# ----------------------------------------------------------------------------- memory


def memory_stats(compiled: Any) -> dict[str, int | None]:
  """XLA's compiled memory analysis: temp, output and argument bytes (``None`` where unknown)."""
  try:
    stats = compiled.memory_analysis()
  except Exception:
    stats = None
  keys = ("temp", "output", "argument")
  if stats is None:
    return {f"{k}_bytes": None for k in keys}
  return {f"{k}_bytes": int(getattr(stats, f"{k}_size_in_bytes")) for k in keys}


def grad_memory(fn: Callable[..., Any], *args: Any, argnums: int | Sequence[int] = 0):
  """:func:`memory_stats` of ``jit(value_and_grad(fn))`` compiled (not run) for ``args``
  (``jax.ShapeDtypeStruct`` s will do)."""
  return memory_stats(jax.jit(jax.value_and_grad(fn, argnums)).lower(*args).compile())


def compare_memory(fns: Mapping[str, Callable[..., Any]], args, argnums=0, **fields):
  """``fields``, :func:`grad_memory` of each of the two ``fns`` compiled for ``args`` and the
  first's temp bytes over the second's (``temp_ratio``)."""
  out = fields | {name: grad_memory(fn, *args, argnums=argnums) for name, fn in fns.items()}
  first, second = fns
  return out | {"temp_ratio": ratio(out[first]["temp_bytes"], out[second]["temp_bytes"])}


def f32(*shape: int) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape, jax.numpy.float32)


# ----------------------------------------------------------------------------- timing


def compile_jax(fn: Callable[..., Any], *args: Any) -> tuple[Callable[[], Any], dict[str, Any]]:
  """Compiles ``fn`` for ``args``; returns a blocking thunk and its memory stats."""
  begin = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  info: dict[str, Any] = memory_stats(compiled)
  info["compile_s"] = time.perf_counter() - begin

  def call() -> Any:
    return jax.block_until_ready(compiled(*args))

  return call, info


def settling() -> bool:
  """Whether timed calls follow an untimed call of the same thunk (``BENCH_SETTLE``, default 1)."""
  return os.environ.get("BENCH_SETTLE", "1") != "0"


def round_robin(
  thunks: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1, settle: bool | None = None
) -> dict[str, list[float]]:
  """Times each thunk ``repeats`` times, interleaved; returns seconds per call per thunk.

  Each thunk must block until its work is done (``compile_jax``'s thunks do).
  With ``settle`` (default :func:`settling`), every timed call follows an
  untimed call of the same thunk, so that each is charged for its own deferred
  deallocations and for no other thunk's (README, *Method*). Python's
  garbage collector is off while timing, as in ``timeit``.
  """
  settle = settling() if settle is None else settle
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
        begin = time.perf_counter()
        fn()
        times[name].append(time.perf_counter() - begin)
  finally:
    if was_enabled:
      gc.enable()
  return times


def time_contenders(
  contenders: Mapping[str, tuple[Callable[..., Any], Sequence[Any]]],
  repeats: int,
  keep: tuple[str, Callable[[Any], Any]] | None = None,
  check: Callable[..., None] | None = None,
  warmup: int = 0,
) -> dict[str, dict[str, Any]]:
  """Compiles each ``name: (fn, args)``, warms it up and times them round-robin.

  Returns per name the median and every time (ms) and XLA's memory of the program;
  ``keep=(key, f)`` adds ``f`` of the warm-up call's result under ``key``; ``check`` gets
  every warm-up result (in order) before anything is timed; ``warmup``: more untimed calls.
  """
  thunks, info = {}, {}
  for name, (fn, args) in contenders.items():
    thunks[name], info[name] = compile_jax(fn, *args)
  outs = [thunk() for thunk in thunks.values()]  # the warm-up
  if keep is not None:
    for name, out in zip(thunks, outs):
      info[name][keep[0]] = keep[1](out)
  if check is not None:
    check(*outs)
  del outs
  times = round_robin(thunks, repeats, warmup=warmup)
  return {
    name: {"median_ms": median_ms(times[name]), "times_ms": [1e3 * t for t in times[name]]}
    | info[name]
    for name in contenders
  }


def time_grads(fns: Mapping[str, Callable[..., Any]], inputs, repeats: int, argnums=0, **kw):
  """:func:`time_contenders` of ``value_and_grad(fn, argnums)`` of each ``fns`` on ``inputs``."""
  vg = {name: (jax.value_and_grad(fn, argnums), inputs) for name, fn in fns.items()}
  return time_contenders(vg, repeats, **kw)


def median_ms(seconds: Sequence[float]) -> float:
  return 1e3 * statistics.median(seconds)


def ratio(a: float | None, b: float | None) -> float | None:
  """``a / b``, or ``None`` where either is missing or ``b`` is zero."""
  if a is None or b is None or b == 0:
    return None
  return a / b


# ----------------------------------------------------------------------------- reports


def fmt_ms(ms: float | None) -> str:
  if ms is None:
    return "-"
  return f"{ms:.3f}" if ms < 10 else f"{ms:.2f}" if ms < 100 else f"{ms:.1f}"


def fmt_ratio(r: float | None) -> str:
  return "-" if r is None else f"{r:.2f}"


def fmt_bytes(n: float | None) -> str:
  if n is None:
    return "-"
  for unit in ("B", "K", "M", "G"):
    if abs(n) < 1024 or unit == "G":
      return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
    n /= 1024
  return str(n)  # pragma: no cover


def target_row(
  target: str, limit: float, value: float | None, sense: str = "<=", **extra: Any
) -> dict[str, Any]:
  """One row of a section's targets: ``value <= limit`` (``sense=">="``: at least ``limit``;
  ``pass`` is ``None`` when not measured)."""
  ok = None if value is None else bool(value <= limit if sense == "<=" else value >= limit)
  return (
    {"target": target, "limit": limit, "value": value, "pass": ok}
    | ({} if sense == "<=" else {"sense": sense})
    | extra
  )


def ratio_targets(spec, times: Mapping[str, Any], memory: Mapping[str, Any] | None = None):
  """Target rows of ``(target, limit, a, b)``: ``a``'s median time over ``b``'s in ``times``,
  or their temp bytes in ``memory`` where the target names `` temp ``."""
  rows = []
  for what, limit, a, b in spec:
    table, key = (memory, "temp_bytes") if " temp " in what else (times, "median_ms")
    rows.append(target_row(what, limit, ratio(table[a][key], table[b][key])))
  return rows


def print_targets(
  rows: Sequence[dict[str, Any]], indicative: bool, why: str = "--quick sizes", title="Targets"
):
  """The targets, PASS/FAIL; ``indicative``: not at the targets' sizes (``why``)."""
  print(f"\n{title}{f' (indicative only: {why})' if indicative else ''}:")
  width = max((len(row["target"]) for row in rows), default=0)
  for row in rows:
    verdict = {True: "PASS", False: "FAIL", None: "n/a"}[row["pass"]]
    bound = f"{row.get('sense', '<=')} {row['limit']}"
    detail = f"  ({row['detail']})" if row.get("detail") else ""
    print(f"  {verdict:4}  {row['target']:{width}} {fmt_ratio(row['value']):>6} {bound}{detail}")


def print_table(columns: Sequence[tuple[str, str]], rows: Iterable[Sequence[Any]]) -> None:
  """A header, a rule and one line per row. ``columns``: ``(header, spec)``, ``spec`` a format
  spec ``[<>]width[rest]`` for the values (strings and ``None``, printed ``-``, take only the
  alignment and width); a row may stop early."""
  specs = [re.fullmatch(r"([<>]?)(\d+)(.*)", spec).groups() for _, spec in columns]

  def cell(value: Any, align: str, width: str, rest: str) -> str:
    value, rest = ("-", "") if value is None else (value, "" if isinstance(value, str) else rest)
    return f"{value:{align or '<'}{width}{rest}}"

  header = " ".join(cell(h, *spec) for (h, _), spec in zip(columns, specs))
  print(f"{header}\n{'-' * len(header)}")
  for row in rows:
    print(" ".join(cell(v, *spec) for v, spec in zip(row, specs)))


def print_times(title: str, times: Mapping[str, dict[str, Any]], width: int = 28) -> None:
  """Median ms and temp bytes per contender."""
  print(title)
  for name, t in times.items():
    print(
      f"  {name:{width}} {fmt_ms(t['median_ms']):>10} ms  temp {fmt_bytes(t['temp_bytes']):>10}"
    )


def print_memory(title: str, memory: Mapping[str, Any]) -> None:
  """Temp bytes per contender (the entries of ``memory`` that are dicts)."""
  print(title)
  for name, m in memory.items():
    if isinstance(m, dict):
      print(f"  {name:28} {fmt_bytes(m['temp_bytes']):>10}")


# ----------------------------------------------------------------------------- logits sections

FULL_SHAPE, QUICK_SHAPE = (4096, 8192), (256, 1024)


def logits_data(shape: tuple[int, int], seed: int, ignore_index: int = -100):
  """Student and teacher logits ``N(0, 4)`` float32 and labels, 10% of them ``ignore_index``."""
  import jax.numpy as jnp
  import numpy as np

  rng = np.random.default_rng(seed)
  student = jnp.asarray(rng.normal(size=shape) * 2.0, jnp.float32)
  teacher = jnp.asarray(rng.normal(size=shape) * 2.0, jnp.float32)
  labels = rng.integers(0, shape[1], size=shape[0])
  labels[rng.uniform(size=shape[0]) < 0.1] = ignore_index
  return student, teacher, jnp.asarray(labels, jnp.int32)


def logits_section(section: str, doc: str, key: str, groups, evaluate, argv, add=None) -> int:
  """The sections timing ``value_and_grad`` wrt the student's logits (``logits``, ``divergences``).

  ``groups(args, shape)`` gives per group ``(contenders, inputs, check, fields)``: scalar
  losses of ``inputs``, the baseline first; ``check(out_baseline, out_ours)`` compares their
  values and gradients before anything is timed; ``fields`` go into the group's records.
  ``evaluate(records)`` gives the target rows.
  """
  p = parser(doc, quick=f"shape {QUICK_SHAPE}, 3 repeats", repeats="repeats (default 7, quick 3)")
  p.add_argument("--rows", type=int, default=None, help="rows (with --classes)")
  p.add_argument("--classes", type=int, default=FULL_SHAPE[1])
  p.add_argument("--temperature", type=float, default=2.0)
  if add is not None:
    add(p)
  args = p.parse_args(argv)
  shape = (args.rows, args.classes) if args.rows else QUICK_SHAPE if args.quick else FULL_SHAPE
  repeats = args.repeats or (3 if args.quick else 7)
  machine = start(section)
  records = []
  for group, (fns, inputs, check, fields) in groups(args, shape).items():
    times = time_grads(fns, inputs, repeats, check=check, warmup=1)
    base = next(iter(fns))
    for name, t in times.items():
      records.append(
        {key: group, **fields, "shape": list(shape), "dtype": "float32"}
        | {"temperature": args.temperature, "contender": name, "median_ms": t["median_ms"]}
        | {"times_ms": t["times_ms"], "repeats": repeats}
        | {k: t[k] for k in ("temp_bytes", "output_bytes", "compile_s")}
        | {"baseline": base, "time_ratio": ratio(t["median_ms"], times[base]["median_ms"])}
        | {"temp_ratio": ratio(t["temp_bytes"], times[base]["temp_bytes"])}
      )
  full_size = tuple(shape) == FULL_SHAPE
  settings = dict(shape=list(shape), temperature=args.temperature, repeats=repeats, seed=args.seed)
  result = {"section": section, "machine": machine, "settings": settings | {"full_size": full_size}}
  result |= {"records": records, "targets": {"full_size": full_size, "rows": evaluate(records)}}
  print(
    f"value_and_grad wrt the student's logits, shape {shape} float32, "
    f"T = {args.temperature}, median of {repeats}"
  )
  width = max([len(key), *(len(str(r[key])) for r in records)])
  header = f"{key:{width}} {'contender':16} {'ms':>9} {'ratio':>6} {'temp':>9} {'ratio':>6}"
  print(f"{header}\n{'-' * len(header)}")
  for r in records:
    print(
      f"{r[key]:{width}} {r['contender']:16} {fmt_ms(r['median_ms']):>9} "
      f"{fmt_ratio(r['time_ratio']):>6} {fmt_bytes(r['temp_bytes']):>9} "
      f"{fmt_ratio(r['temp_ratio']):>6}"
    )
  print_targets(result["targets"]["rows"], not full_size, f"not the {FULL_SHAPE} size")
  save(result, args.out)
  return 0
