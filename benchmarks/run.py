"""Runs the benchmark sections of kldiv_jax (``make bench``).

Each section is a module ``benchmarks/bench_<name>.py`` with a ``main`` entry
point (``core``, ``logits``, ``large``, ``sharding``). Sections run in one
process, one after the other; each writes ``<out>/<name>.json`` (and a chart)
and prints its table. Options this runner does not know are passed to the
``core`` section (see ``python benchmarks/bench_core.py --help``).

  python benchmarks/run.py                      # every section, full size grid
  python benchmarks/run.py --quick              # small sizes, few repeats (smoke test)
  python benchmarks/run.py --sections core --sizes 20,25 --repeats 9
"""

import argparse
import importlib
import inspect
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
for _p in (str(HERE.parent), str(HERE)):  # `import _harness` and `import benchmarks._harness`
  if _p not in sys.path:
    sys.path.insert(0, _p)

ORDER = ("core", "logits")
# Sections run only when named (`--sections accel`): they need their own environments.
OPT_IN = ("accel",)


def available_sections() -> list[str]:
  names = [p.stem.removeprefix("bench_") for p in HERE.glob("bench_*.py")]
  return sorted(names, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n))


def section_argv(name: str, args: argparse.Namespace, extra: list[str]) -> list[str]:
  argv = ["--out", str(args.out)]
  if args.quick:
    argv.append("--quick")
  if args.repeats is not None:
    argv += ["--repeats", str(args.repeats)]
  if name == "core":
    if args.sizes is not None:
      argv += ["--sizes", args.sizes]
    argv += extra
  return argv


def call_main(module, argv: list[str]) -> int:
  """Calls ``module.main`` with ``argv`` (as an argument if it takes one, and as ``sys.argv``)."""
  entry = getattr(module, "main", None)
  if not callable(entry):
    raise TypeError(f"{module.__name__} has no callable main()")
  saved = sys.argv
  sys.argv = [str(getattr(module, "__file__", module.__name__)), *argv]
  try:
    takes_argv = bool(inspect.signature(entry).parameters)
    result = entry(argv) if takes_argv else entry()
  except SystemExit as exit_:
    code = exit_.code
    return code if isinstance(code, int) else (0 if code is None else 1)
  finally:
    sys.argv = saved
  return result if isinstance(result, int) else 0


def run_section(name: str, args: argparse.Namespace, extra: list[str]) -> tuple[bool, str]:
  """Runs one section defensively; returns (ok, how it went)."""
  try:
    module = importlib.import_module(f"bench_{name}")
  except Exception:
    traceback.print_exc()
    return False, "import failed"
  argv = section_argv(name, args, extra)
  try:
    code = call_main(module, argv)
    if code == 2 and name != "core":  # argparse rejected an option: retry with the bare minimum
      minimal = ["--quick"] if args.quick else []
      print(f"run: section {name} rejected {argv}; retrying with {minimal}", file=sys.stderr)
      code = call_main(module, minimal)
  except Exception:
    traceback.print_exc()
    return False, "raised"
  return code == 0, f"exit {code}"


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--quick", action="store_true", help="a few small sizes, few repeats")
  p.add_argument(
    "--sizes", default=None, help="core sizes: comma-separated log2 exponents or element counts"
  )
  p.add_argument("--repeats", type=int, default=None, help="repeats per timing (all sizes)")
  p.add_argument("--out", type=Path, default=HERE / "results", help="output directory")
  p.add_argument(
    "--sections",
    default=None,
    help=f"comma-separated sections (available: {','.join(available_sections())}; "
    f"{','.join(OPT_IN)} only when named)",
  )
  args, extra = p.parse_known_args(argv)
  available = available_sections()
  sections = (
    [s for s in available if s not in OPT_IN]
    if args.sections is None
    else [s.strip() for s in args.sections.split(",") if s.strip()]
  )
  unknown = [s for s in sections if s not in available]
  if unknown:
    p.error(f"unknown section(s) {unknown}; available: {available}")
  args.out.mkdir(parents=True, exist_ok=True)
  summary = []
  for name in sections:
    print(f"\n=== section {name} ===", flush=True)
    start = time.perf_counter()
    ok, how = run_section(name, args, extra)
    summary.append((name, ok, how, time.perf_counter() - start))
  print("\n=== summary ===")
  for name, ok, how, seconds in summary:
    print(f"  {name:10} {'ok' if ok else 'FAILED':7} {how:14} {seconds:7.1f} s")
  print(f"  results in {args.out}")
  return 0 if all(ok for _, ok, _, _ in summary) else 1


if __name__ == "__main__":
  raise SystemExit(main())
