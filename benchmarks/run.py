"""Runs the benchmark sections of kldiv_jax (``make bench``).

Each section is a module ``benchmarks/bench_<name>.py`` whose ``main(argv) -> int`` parses
its options (``--quick``, ``--repeats``, ``--out`` and its own), prints its table and its
targets and writes ``<out>/<name>.json`` (``_harness.py`` holds what they share):

* ``core``: ``kl_div`` against the double-``where`` formula, optax and torch;
* ``logits``: ``kl_div_from_logits``, ``generalized_jsd``, ``distillation_loss``;
* ``divergences``: every divergence of the engine against its authors' formula;
* ``large``: ``fused_distillation_loss`` against materialised logits;
* ``sharding``: per-device memory of the vocabulary-parallel losses;
* ``llm``: soft-caps, padded teacher vocabularies, labels in the fused head, top-k tails;
* ``rl``: ``token_log_probs``, ``fused_token_log_probs``, the fused policy loss;
* ``precision``: every divergence on bf16 logits against float64;
* ``accel`` (only when named): every loss compiled for TPU and an H100, XLA's estimates.
* ``device`` (only when named): ``accel``'s cases timed on the attached GPU or TPU.
* ``tunix`` (only when named): Tunix's whole GRPO and distillation train steps, stock
  against the fused losses, compiled for v5e and an H100 (XLA's estimates; its own venvs).
* ``uld`` (only when named): ULD's sort at V=151936 (minutes of CPU sorting): the
  chunked ``uld_loss``, ``uld_loss_from_topk``; ``--accel``: XLA's v5e and H100 estimates.

Sections run in one process, one after the other. ``--quick``, ``--repeats`` and
``--out`` go to every section; ``--sizes`` and the options this runner does not know go to
``core`` (see ``python benchmarks/bench_core.py --help``).

  python benchmarks/run.py                      # every section, full size grid
  python benchmarks/run.py --quick              # small sizes, few repeats (smoke test)
  python benchmarks/run.py --sections core --sizes 20,25 --repeats 9
"""

import argparse
import importlib
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # `import bench_<name>`, `import _harness`
  sys.path.insert(0, str(HERE))

ORDER = ("core", "logits")
# Sections run only when named (`--sections accel`): they need their own environments
# (accel, tunix), an accelerator and tens of GB of its memory (device), or minutes of CPU
# sorting (uld).
OPT_IN = ("accel", "device", "tunix", "uld")


def available_sections() -> list[str]:
  names = [p.stem.removeprefix("bench_") for p in HERE.glob("bench_*.py")]
  return sorted(names, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n))


def section_argv(name: str, args: argparse.Namespace, extra: list[str]) -> list[str]:
  argv = ["--out", str(args.out)] + (["--quick"] if args.quick else [])
  if args.repeats is not None:
    argv += ["--repeats", str(args.repeats)]
  if name == "core":
    argv += (["--sizes", args.sizes] if args.sizes is not None else []) + extra
  return argv


def run_section(name: str, argv: list[str]) -> tuple[bool, str]:
  """Runs one section defensively; returns (ok, how it went)."""
  try:
    code = importlib.import_module(f"bench_{name}").main(argv)
  except SystemExit as exit_:  # argparse
    code = exit_.code if isinstance(exit_.code, int) else 1
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
    begin = time.perf_counter()
    ok, how = run_section(name, section_argv(name, args, extra))
    summary.append((name, ok, how, time.perf_counter() - begin))
  print("\n=== summary ===")
  for name, ok, how, seconds in summary:
    print(f"  {name:10} {'ok' if ok else 'FAILED':7} {how:14} {seconds:7.1f} s")
  print(f"  results in {args.out}")
  return 0 if all(ok for _, ok, _, _ in summary) else 1


if __name__ == "__main__":
  raise SystemExit(main())
