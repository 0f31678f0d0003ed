"""ULD at large vocabularies: the sort's cost, the chunked exact form and the top-k form.

A student of Qwen2.5's vocabulary (151936) against a teacher of Llama 3's (128256), float32
logits, the teacher stopped; ``value`` and ``value_and_grad`` wrt the student of:

* ``jnp.sort``: the straightforward form (both rows sorted whole, autodiff through the sort);
* ``uld_loss``: kldiv_jax's (row chunks, one sort per side, int8 signs scattered back);
* ``topk k=64``, ``topk k=1024``: ``uld_loss_from_topk`` (``lax.top_k`` and tail masses);
* ``kl (same vocab)``: ``kl_div_from_logits`` on two [N, 151936] rows, what a loss that
  needs no sort costs (a yardstick, not a contender).

CPU: medians of ``--repeats`` round-robin calls in one process, as ratios to ``jnp.sort``,
at N=64 tokens; XLA's compiled temp at N=4096 against one [N, 151936] float32 array (the
target: ``uld_loss`` at most 2x). ``--accel``: the same programs compiled for TPU v5e and an
H100 without the device (``bench_accel.py``'s environments and helpers): **XLA's estimates,
not measurements**, of time (v5e: XLA's ``optimal_seconds``; H100: the roofline of XLA's
flop and byte counts) and temp, at N=256.

  python benchmarks/bench_uld.py                       # CPU: time and temp
  python benchmarks/bench_uld.py --accel --venvs /work/main   # + v5e, H100 estimates
  python benchmarks/bench_uld.py --quick               # small vocabularies, a smoke test

``--fused`` (opt-in, instead of the above): ``fused_uld_loss_from_topk`` from hidden states
and LM heads against ``uld_loss_from_topk(h_s @ W_s, h_t @ W_t)`` on the materialised
logits, ``value_and_grad`` wrt the student's hidden states and head (teacher stopped), k=64,
N=1024 tokens, H=512 on both sides: CPU medians (round-robin) and XLA's compiled temp, as
ratios to the materialised form; with ``--accel``, XLA's v5e and H100 estimates of the same.

  python benchmarks/bench_uld.py --fused --repeats 3
  python benchmarks/bench_uld.py --fused --accel --no-cpu --venvs /work/main
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import _harness
from _harness import fmt_bytes, fmt_ms, ratio, save, start, target_row

VS, VT = 151936, 128256  # Qwen2.5's and Llama 3's vocabularies
QUICK_VS, QUICK_VT = 4096, 3000
TIME_TOKENS, MEMORY_TOKENS, ACCEL_TOKENS = 64, 4096, 256
QUICK_TOKENS = 32
KS = (64, 1024)
TEMP_TARGET = 2.0  # uld_loss's temp / one [N, Vs] float32 array
BASELINE = "jnp.sort"
# --fused: the fused form from hidden states against the materialised logits.
FUSED_TOKENS, FUSED_HIDDEN, FUSED_K = 1024, 512, 64
QUICK_FUSED_TOKENS, QUICK_FUSED_HIDDEN = 64, 32
FUSED_BASELINE = "materialised"
# Compiled without the device, XLA:GPU cannot use its CUB radix sort (its rewrite asks the
# device, "invalid device ordinal"): the H100 estimates are of XLA's own sort.
CUDA_FLAGS = "--xla_gpu_enable_cub_radix_sort=false"


def contenders() -> dict[str, Callable]:
  """Scalar losses of ``(student [N, Vs], teacher [N, Vt], same-vocab teacher [N, Vs])``."""
  import jax
  import jax.numpy as jnp

  import kldiv_jax as kd
  from kldiv_jax._uld_sorted import sorted_distance_reference

  stop = jax.lax.stop_gradient
  one = jnp.float32(1.0)
  out = {
    BASELINE: lambda s, t, u: jnp.mean(sorted_distance_reference(s, stop(t), one, one)),
    "uld_loss": lambda s, t, u: kd.uld_loss(s, stop(t)),
  }
  for k in KS:
    out[f"topk k={k}"] = lambda s, t, u, k=k: kd.uld_loss_from_topk(s, stop(t), k=k)
  out["kl (same vocab)"] = lambda s, t, u: jnp.mean(kd.kl_div_from_logits(s, stop(u)))
  return out


def fused_contenders() -> dict[str, Callable]:
  """Scalar losses of ``(h [N, H], w [H, Vs], th [N, H], tw [H, Vt])``, the teacher stopped."""
  import jax

  import kldiv_jax as kd

  stop = jax.lax.stop_gradient
  return {
    FUSED_BASELINE: lambda h, w, th, tw: kd.uld_loss_from_topk(h @ w, stop(th @ tw), k=FUSED_K),
    "fused": lambda h, w, th, tw: kd.fused_uld_loss_from_topk(h, w, stop(th), stop(tw), k=FUSED_K),
  }


def fused_structs(n: int, hidden: int, vs: int, vt: int, sharding=None):
  import jax
  import jax.numpy as jnp

  kw = {} if sharding is None else {"sharding": sharding}
  shapes = ((n, hidden), (hidden, vs), (n, hidden), (hidden, vt))
  return [jax.ShapeDtypeStruct(s, jnp.float32, **kw) for s in shapes]


def fused_cpu(n: int, hidden: int, vs: int, vt: int, repeats: int, seed: int) -> dict[str, Any]:
  """value_and_grad wrt ``(h, w)``: medians (ms, round-robin) and XLA's temp of each contender,
  as ratios to the materialised form's; the two losses checked to agree first."""
  import jax
  import numpy as np

  rng = np.random.default_rng(seed)
  scale = 4.0 / np.sqrt(hidden)  # logits of spread ~4: peaked rows, a tail of some mass
  shapes = fused_structs(n, hidden, vs, vt)
  args = [
    jax.numpy.asarray(rng.normal(size=a.shape) * (1.0 if i % 2 == 0 else scale), "float32")
    for i, a in enumerate(shapes)
  ]

  def agree(*outs):
    (value, (gh, gw)), (fused, (fh, fw)) = outs
    np.testing.assert_allclose(fused, value, rtol=1e-4)
    np.testing.assert_allclose(fw, gw, rtol=1e-3, atol=1e-3 * float(np.abs(gw).max()))
    np.testing.assert_allclose(fh, gh, rtol=1e-3, atol=1e-3 * float(np.abs(gh).max()))

  fns = {name: (jax.value_and_grad(f, (0, 1)), args) for name, f in fused_contenders().items()}
  times = _harness.time_contenders(fns, repeats, check=agree)
  one = n * vs * 4
  base = times[FUSED_BASELINE]
  return {
    name: {k: t[k] for k in ("median_ms", "times_ms", "temp_bytes", "compile_s")}
    | {"ratio": ratio(t["median_ms"], base["median_ms"])}
    | {"temp_ratio": ratio(t["temp_bytes"], base["temp_bytes"])}
    | {"temp_over_logits": ratio(t["temp_bytes"], one)}
    for name, t in times.items()
  }


def print_fused(result: dict, n: int, hidden: int, vs: int, vt: int) -> None:
  print(
    f"\nvalue_and_grad wrt (hidden, weight), N={n}, H={hidden}, Vs={vs}, Vt={vt}, k={FUSED_K}, "
    f"CPU (ratios to {FUSED_BASELINE}; temp also over one [N, Vs] f32 array)"
  )
  for name, r in result.items():
    print(
      f"  {name:13} {fmt_ms(r['median_ms']):>10} ({r['ratio']:.2f})   temp "
      f"{fmt_bytes(r['temp_bytes']):>10} ({r['temp_ratio']:.3f}; {r['temp_over_logits']:.3f}x)"
    )


def structs(n: int, vs: int, vt: int, sharding=None):
  import jax
  import jax.numpy as jnp

  kw = {} if sharding is None else {"sharding": sharding}
  return [jax.ShapeDtypeStruct(s, jnp.float32, **kw) for s in ((n, vs), (n, vt), (n, vs))]


def cpu_time(n: int, vs: int, vt: int, repeats: int, seed: int) -> dict[str, Any]:
  """Medians (ms) of value and value_and_grad, and their ratios to ``jnp.sort``'s."""
  import jax
  import numpy as np

  rng = np.random.default_rng(seed)
  args = [jax.numpy.asarray(rng.normal(size=(n, v)) * 2.0, "float32") for v in (vs, vt, vs)]
  fns = contenders()
  out = {}
  for op, wrap in (("value", lambda f: f), ("value_and_grad", jax.value_and_grad)):
    times = _harness.time_contenders({k: (wrap(f), args) for k, f in fns.items()}, repeats)
    out[op] = {
      name: {"median_ms": t["median_ms"], "times_ms": t["times_ms"]}
      | {"ratio": ratio(t["median_ms"], times[BASELINE]["median_ms"])}
      for name, t in times.items()
    }
  return out


def temps(n: int, vs: int, vt: int, device=None) -> dict[str, dict[str, Any]]:
  """XLA's temp of value and value_and_grad (compiled, not run), over one [N, Vs] f32."""
  import jax
  from jax.sharding import SingleDeviceSharding

  sharding = None if device is None else SingleDeviceSharding(device)
  args = structs(n, vs, vt, sharding)
  one = n * vs * 4
  out: dict[str, dict[str, Any]] = {}
  for name, fn in contenders().items():
    out[name] = {}
    for op, wrap in (("value", lambda f: f), ("value_and_grad", jax.value_and_grad)):
      temp = _harness.memory_stats(jax.jit(wrap(fn)).lower(*args).compile())["temp_bytes"]
      out[name][op] = {"temp_bytes": temp, "temp_ratio": ratio(temp, one)}
  return out


# ----------------------------------------------------------------------------- accelerators


def accel_worker(target: str, n: int, vs: int, vt: int, out: Path, hidden: int = 0) -> int:
  """In an accelerator venv: each contender compiled for ``target``, XLA's estimates
  (``hidden``: the ``--fused`` contenders, value_and_grad wrt ``(h, w)``)."""
  import jax
  from bench_accel import TARGETS, _cost, _device, _seconds, _unrolled_loops

  if TARGETS[target]["kind"] == "tpu":
    jax.config.update("jax_platforms", "cpu")
  dev = _device(target)
  from jax.sharding import SingleDeviceSharding

  sharding = SingleDeviceSharding(dev)
  if hidden:
    args = fused_structs(n, hidden, vs, vt, sharding)
    fns, ops = fused_contenders(), (("value_and_grad", lambda f: jax.value_and_grad(f, (0, 1))),)
  else:
    args = structs(n, vs, vt, sharding)
    fns, ops = contenders(), (("value", lambda f: f), ("value_and_grad", jax.value_and_grad))
  records = {}
  for name, fn in fns.items():
    records[name] = {}
    for op, wrap in ops:

      def estimate(fn=fn, wrap=wrap):
        looped = jax.jit(wrap(fn)).lower(*args).compile()
        unrolled = looped
        if "while" in looped.as_text():  # XLA counts a loop body once: the chunks unrolled
          with _unrolled_loops():
            unrolled = jax.jit(wrap(fn)).lower(*args).compile()
        cost = _cost(unrolled, target)
        seconds, source = _seconds(cost, target, matmul=bool(hidden))
        temp = int(looped.memory_analysis().temp_size_in_bytes)
        return cost | {"seconds": seconds, "time_source": source, "temp_bytes": temp}

      try:
        records[name][op] = estimate()
      except Exception as err:  # what XLA cannot compile: reported, not fatal
        records[name][op] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
      print(f"  [{target}] {name} {op}: {records[name][op]}", file=sys.stderr, flush=True)
  out.write_text(
    json.dumps({"target": target, "device_kind": dev.device_kind} | {"records": records})
  )
  return 0


def accel(
  venvs: Path, n: int, vs: int, vt: int, out_dir: Path, targets, hidden: int = 0
) -> dict[str, Any]:
  """Runs :func:`accel_worker` for ``targets`` in ``venvs/.venv-accel-{tpu,cuda}``."""
  from bench_accel import TARGETS, _worker_env

  results = {}
  for target in targets:
    kind = TARGETS[target]["kind"]
    python = venvs / f".venv-accel-{kind}" / "bin" / "python"
    if not python.exists():
      results[target] = {"error": f"no {python} (make bench-accel creates it)"}
      continue
    part = out_dir / f"uld-{target}.part.json"
    cmd = [
      str(python),
      str(Path(__file__).resolve()),
      "--worker",
      target,
      "--worker-out",
      str(part),
    ]
    cmd += ["--tokens", str(n), "--vocabs", f"{vs},{vt}", "--hidden", str(hidden)]
    env = _worker_env(target)
    if kind == "cuda":  # XLA:GPU's CUB radix sort queries the device it compiles for: off
      env["XLA_FLAGS"] = (env["XLA_FLAGS"] + " " + CUDA_FLAGS).strip()
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
      results[target] = {"error": f"worker exit {proc.returncode}"}
      continue
    results[target] = json.loads(part.read_text())
    part.unlink()
  return results


# ----------------------------------------------------------------------------- report


def print_report(time: dict | None, memory: dict | None, estimates, n_time: int, n_mem: int):
  for target, payload in (estimates or {}).items():
    print_estimates(target, payload)
  if time is None or memory is None:
    return
  print(f"\nCPU, N={n_time}: median ms (ratio to {BASELINE}); temp at N={n_mem} / [N, Vs] f32")
  header = (
    f"  {'contender':16} {'value':>16} {'value_and_grad':>16} {'temp value':>11} {'temp v&g':>9}"
  )
  print(header + "\n  " + "-" * (len(header) - 2))
  for name in time["value"]:
    cells = [
      f"{fmt_ms(time[op][name]['median_ms'])} ({time[op][name]['ratio']:.2f})"
      for op in ("value", "value_and_grad")
    ]
    mem = [f"{memory[name][op]['temp_ratio']:.2f}x" for op in ("value", "value_and_grad")]
    print(f"  {name:16} {cells[0]:>16} {cells[1]:>16} {mem[0]:>11} {mem[1]:>9}")


def print_estimates(target: str, payload: dict) -> None:
  if "error" in payload:
    print(f"\n{target}: {payload['error']}")
  else:
    print(f"\n{target} ({payload['device_kind']}), XLA's estimates (not measurements):")
    for name, ops in payload["records"].items():
      cells = []
      for op in ("value", "value_and_grad"):
        if op not in ops:
          cells.append("-")
          continue
        r = ops[op]
        cells.append(
          "error"
          if "error" in r
          else f"{r['seconds'] * 1e3:8.3f} ms temp {fmt_bytes(r['temp_bytes'])}"
        )
      print(f"  {name:16} value {cells[0]:>24}   value_and_grad {cells[1]:>24}")


def parser():
  p = _harness.parser(__doc__, quick="small vocabularies, a smoke test")
  p.add_argument("--accel", action="store_true", help="add XLA's v5e and H100 estimates")
  p.add_argument("--targets", default="v5e,h100", help="the estimates' chips (v5e, v6e, h100)")
  p.add_argument("--no-cpu", action="store_true", help="only the estimates (with --accel)")
  p.add_argument(
    "--accel-tokens", type=int, default=None, help=f"N of the estimates ({ACCEL_TOKENS})"
  )
  p.add_argument("--venvs", type=Path, default=_harness.REPO, help="where .venv-accel-* are")
  p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  p.add_argument("--worker-out", type=Path, default=None, help=argparse.SUPPRESS)
  p.add_argument("--tokens", type=int, default=None, help=argparse.SUPPRESS)
  p.add_argument("--vocabs", default=None, help=argparse.SUPPRESS)
  p.add_argument("--hidden", type=int, default=0, help=argparse.SUPPRESS)
  p.add_argument(
    "--fused", action="store_true", help="the fused form from hidden states vs the materialised"
  )
  return p


def main(argv: Sequence[str] | None = None) -> int:
  args = parser().parse_args(argv)
  if args.worker:
    vs, vt = (int(v) for v in args.vocabs.split(","))
    return accel_worker(args.worker, args.tokens, vs, vt, args.worker_out, args.hidden)
  if args.fused:
    return fused_main(args)
  vs, vt = (QUICK_VS, QUICK_VT) if args.quick else (VS, VT)
  n_time = QUICK_TOKENS if args.quick else TIME_TOKENS
  n_mem = QUICK_TOKENS * 4 if args.quick else MEMORY_TOKENS
  n_accel = args.accel_tokens or (QUICK_TOKENS * 4 if args.quick else ACCEL_TOKENS)
  repeats = args.repeats or (2 if args.quick else 5)
  machine = start("uld")
  time = memory = None
  if not args.no_cpu:
    time = cpu_time(n_time, vs, vt, repeats, args.seed)
    memory = temps(n_mem, vs, vt)
    print_report(time, memory, None, n_time, n_mem)
  estimates = None
  if args.accel:
    args.out.mkdir(parents=True, exist_ok=True)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    estimates = accel(args.venvs, n_accel, vs, vt, args.out, targets)
    print_report(None, None, estimates, n_time, n_mem)
  measured = None if memory is None else memory["uld_loss"]["value_and_grad"]["temp_ratio"]
  what = f"uld_loss value_and_grad temp / [N, Vs] f32 (N={n_mem}, Vs={vs})"
  targets = [target_row(what, TEMP_TARGET, measured)]
  _harness.print_targets(targets, args.quick)
  settings = {"quick": args.quick, "repeats": repeats, "seed": args.seed, "vocabs": [vs, vt]}
  settings |= {"time_tokens": n_time, "memory_tokens": n_mem, "accel_tokens": n_accel}
  result = {"section": "uld", "machine": machine, "settings": settings, "time": time}
  result |= {"memory": memory, "estimates": estimates, "targets": targets}
  result["note"] = "estimates: XLA's compile-only figures (deviceless), not measurements"
  save(result, args.out)
  return 0


def fused_main(args) -> int:
  """``--fused``: the section ``uld-fused`` (CPU time and temp; ``--accel``: estimates)."""
  vs, vt = (QUICK_VS, QUICK_VT) if args.quick else (VS, VT)
  n = args.accel_tokens or (QUICK_FUSED_TOKENS if args.quick else FUSED_TOKENS)
  hidden = QUICK_FUSED_HIDDEN if args.quick else FUSED_HIDDEN
  repeats = args.repeats or (1 if args.quick else 3)
  machine = start("uld-fused")
  cpu = None
  if not args.no_cpu:
    cpu = fused_cpu(n, hidden, vs, vt, repeats, args.seed)
    print_fused(cpu, n, hidden, vs, vt)
  estimates = None
  if args.accel:
    args.out.mkdir(parents=True, exist_ok=True)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    estimates = accel(args.venvs, n, vs, vt, args.out, targets, hidden)
    print_report(None, None, estimates, n, n)
  settings = {"quick": args.quick, "repeats": repeats, "seed": args.seed, "vocabs": [vs, vt]}
  settings |= {"tokens": n, "hidden": hidden, "k": FUSED_K}
  result = {"section": "uld-fused", "machine": machine, "settings": settings, "cpu": cpu}
  result |= {"estimates": estimates}
  result["note"] = "estimates: XLA's compile-only figures (deviceless), not measurements"
  save(result, args.out)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
