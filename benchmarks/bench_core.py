"""Core benchmark: ``kldiv_jax.kl_div`` against the double-``where`` formula, optax and torch.

Per case (size, dtype, ``log_target``, reduction) and operation (``fwd``, ``vg_x``,
``vg_xt``) the contenders and, with ``fwd``, three bandwidth/transcendental limits are
timed round-robin; ``benchmarks/README.md`` (*Method*) says what each is. ``--help`` lists
the options.
"""

import argparse
import operator
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _harness import (
  compile_jax,
  core_count,
  fmt_bytes,
  fmt_ms,
  fmt_ratio,
  median_ms,
  parser,
  print_targets,
  ratio,
  round_robin,
  save,
  start,
  target_row,
)

import kldiv_jax

FLAGSHIP_SHAPE = (4096, 8192)
DEFAULT_LOG2_SIZES = (16, 19, 22, 25)
QUICK_LOG2_SIZES = (10, 12)
DTYPES = ("float32", "bfloat16")
REDUCTIONS = ("batchmean", "none")
OPS = ("fwd", "vg_x", "vg_xt")
ZERO_FRACTION = 0.01
MAX_COLS = 8192

KLDIV = "kldiv_jax"
KLDIV_OPTAX_API = "kldiv_jax_optax_api"
WHERE = "where_guarded"
OPTAX = "optax"
TORCH = "torch_cpu"
LIMITS = ("limit_read2", "limit_read2_write1", "limit_transcendental")
SHORT = {KLDIV: "kldiv", KLDIV_OPTAX_API: "k.optax", WHERE: "where", OPTAX: "optax", TORCH: "torch"}
SHORT |= dict(zip(LIMITS, ("rd2", "rd2wr1", "transc")))

# ----------------------------------------------------------------------------- data


def shape_for(elements: int) -> tuple[int, int]:
  """``(rows, cols)`` with ``cols = min(8192, elements // 8)``: (4096, 8192) at 2^25."""
  cols = min(MAX_COLS, max(elements // 8, 1))
  return elements // cols, cols


def make_data(
  shape: tuple[int, int], dtype: str, log_target: bool, seed: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(x, t, g)``: log-probabilities, targets with exact zeros, a cotangent."""

  @jax.jit
  def draw(key):
    k_x, k_t, k_zero, k_g = jax.random.split(key, 4)
    x = jax.nn.log_softmax(jax.random.normal(k_x, shape))
    p = jax.nn.softmax(jax.random.normal(k_t, shape))
    p = jnp.where(jax.random.bernoulli(k_zero, ZERO_FRACTION, shape), 0.0, p)
    p = p / jnp.sum(p, axis=-1, keepdims=True)
    t = jnp.log(p) if log_target else p
    g = jax.random.normal(k_g, shape)
    return x.astype(dtype), t.astype(dtype), g.astype(dtype)

  return jax.block_until_ready(draw(jax.random.key(seed)))


# ------------------------------------------------------------------------ contenders


def _reduce(terms: jax.Array, reduction: str, rows: int) -> jax.Array:
  return terms if reduction == "none" else jnp.sum(terms) / rows


def where_guarded_terms(x: jax.Array, t: jax.Array, log_target: bool) -> jax.Array:
  """The double-``where`` formula (JAX FAQ) a careful user writes."""
  if log_target:
    m = t > -jnp.inf
    s = jnp.where(m, t, 0.0)
    return jnp.where(m, jnp.exp(s) * (s - x), 0.0)
  safe = jnp.where(t > 0, t, 1.0)
  return jnp.where(t > 0, t * (jnp.log(safe) - x), 0.0)


def optax_terms(x: jax.Array, t: jax.Array, log_target: bool) -> jax.Array:
  """optax's per-element formulas (optax/losses/_classification.py), for ``'none'``."""
  if log_target:
    return jnp.exp(t) * (t - x)
  return t * (jnp.where(t == 0, 0, jnp.log(t)) - x)


def contenders(reduction: str, log_target: bool, rows: int) -> dict[str, Callable]:
  """The jitted contenders of one mode, each ``f(x, t) -> loss``."""
  out: dict[str, Callable] = {
    KLDIV: lambda x, t: kldiv_jax.kl_div(x, t, reduction=reduction, log_target=log_target),
    WHERE: lambda x, t: _reduce(where_guarded_terms(x, t, log_target), reduction, rows),
  }
  if reduction == "none":
    out[OPTAX] = lambda x, t: optax_terms(x, t, log_target)
  else:
    ox = optax.losses.kl_divergence_with_log_targets if log_target else optax.losses.kl_divergence
    kx = kldiv_jax.kl_divergence_with_log_targets if log_target else kldiv_jax.kl_divergence
    out[OPTAX] = lambda x, t: jnp.sum(ox(x, t)) / rows
    out[KLDIV_OPTAX_API] = lambda x, t: jnp.sum(kx(x, t)) / rows
  return out


def with_op(f: Callable, op: str, reduction: str) -> tuple[Callable, bool]:
  """``f`` turned into operation ``op``; the flag says whether it takes the cotangent."""
  if op == "fwd":
    return f, False
  argnums = 0 if op == "vg_x" else (0, 1)
  if reduction != "none":
    return jax.value_and_grad(f, argnums=argnums), False

  def value_and_vjp(x, t, g):
    if op == "vg_x":
      out, pull = jax.vjp(lambda x_: f(x_, t), x)
    else:
      out, pull = jax.vjp(f, x, t)
    return out, pull(g)

  return value_and_vjp, True


def limits(log_target: bool) -> dict[str, Callable]:
  f32 = jnp.float32
  transc = jnp.exp if log_target else jnp.log
  return {
    "limit_read2": lambda x, t: jnp.sum(x.astype(f32) * t.astype(f32)),
    "limit_read2_write1": lambda x, t: x * t,
    "limit_transcendental": lambda x, t: jnp.sum(transc(t.astype(f32))),
  }


def torch_module():
  """``torch`` set to use every core, or ``None`` where it is not importable."""
  try:
    import torch
  except ImportError:
    return None
  torch.set_num_threads(core_count())
  return torch


def torch_thunks(torch, x, t, g, dtype: str, reduction: str, log_target: bool):
  """The three operations with ``torch.nn.functional.kl_div`` on CPU."""
  f = torch.nn.functional.kl_div
  tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]

  def convert(a):
    return torch.from_numpy(np.array(a.astype(jnp.float32))).to(tdtype).contiguous()

  X, T, G = convert(x), convert(t), convert(g)
  grad_out = G if reduction == "none" else None

  def fwd():
    with torch.no_grad():
      return f(X, T, reduction=reduction, log_target=log_target)

  def vg(wrt_t: bool):
    def run():
      xl = X.detach().requires_grad_(True)
      tl = T.detach().requires_grad_(wrt_t)
      loss = f(xl, tl, reduction=reduction, log_target=log_target)
      grads = torch.autograd.grad(loss, [xl, tl] if wrt_t else [xl], grad_outputs=grad_out)
      return loss, grads

    return run

  return {"fwd": fwd, "vg_x": vg(False), "vg_xt": vg(True)}


# ----------------------------------------------------------------------------- runs


def default_repeats(elements: int, quick: bool, flagship: bool = True) -> int:
  """Repeats per timing: 7 at the flagship, 5 at the other 2^25 cases, more below."""
  if quick:
    return 3
  if elements >= 2**25:
    return 7 if flagship else 5
  if elements >= 2**22:
    return 7
  return 11


def is_flagship(shape: tuple[int, int], dtype: str, reduction: str) -> bool:
  return tuple(shape) == FLAGSHIP_SHAPE and dtype == "float32" and reduction == "batchmean"


def parse_sizes(text: str) -> list[int]:
  """Comma-separated sizes: log2 exponents (``16,25``) or element counts (``65536``)."""
  sizes = []
  for part in text.split(","):
    value = int(part.strip())
    sizes.append(2**value if value < 64 else value)
  return sorted(set(sizes))


def run_case(
  data, torch_data, elements, shape, dtype, log_target, reduction, op, repeats
) -> list[dict[str, Any]]:
  """Times one (case, op) group round-robin; returns its records."""
  x, t, g = data
  thunks, info, kinds = {}, {}, {}
  for name, f in contenders(reduction, log_target, shape[0]).items():
    fn, takes_g = with_op(f, op, reduction)
    thunks[name], info[name] = compile_jax(fn, *((x, t, g) if takes_g else (x, t)))
    kinds[name] = "contender"
  if torch_data is not None:
    thunks[TORCH] = torch_data[op]
    info[TORCH] = {"temp_bytes": None, "output_bytes": None, "compile_s": None}
    kinds[TORCH] = "contender"
  if op == "fwd":
    for name, f in limits(log_target).items():
      thunks[name], info[name] = compile_jax(f, x, t)
      kinds[name] = "limit"
  times = round_robin(thunks, repeats)
  med = {name: median_ms(ts) for name, ts in times.items()}
  case = {"elements": elements, "log2_elements": int(np.log2(elements)), "shape": list(shape)}
  case |= {"dtype": dtype, "log_target": log_target, "reduction": reduction, "op": op}
  return [
    case
    | {"contender": name, "kind": kinds[name], "median_ms": med[name], "min_ms": 1e3 * min(ts)}
    | {"times_ms": [1e3 * s for s in ts], "ns_per_element": 1e6 * med[name] / elements}
    | {"repeats": repeats}
    | {k: info[name][k] for k in ("temp_bytes", "output_bytes", "compile_s")}
    | {"ratio_vs_where": ratio(med[name], med.get(WHERE))}
    | {"ratio_vs_optax": ratio(med[name], med.get(OPTAX))}
    for name, ts in times.items()
  ]


TABLE_HEADER = (
  f"{'shape':>12} {'dtype':8} {'lt':>2} {'reduction':9} {'op':5} |"
  f" {'kldiv':>8} {'k.optax':>8} {'where':>8} {'optax':>8} {'torch':>8} ms |"
  f" {'k/where':>7} {'k/optax':>7} {'torch/k':>7} |"
  f" {'temp k':>7} {'temp w':>7} {'temp o':>7} {'out k':>7} |"
  f" {'rd2':>7} {'rd2wr1':>7} {'transc':>7} ms"
)


def table_row(records: list[dict[str, Any]]) -> str:
  by = {r["contender"]: r for r in records}
  r0 = records[0]

  def ms(name):
    return fmt_ms(by[name]["median_ms"]) if name in by else "-"

  def mem(name, key="temp_bytes"):
    return fmt_bytes(by[name][key]) if name in by else "-"

  k = by[KLDIV]["median_ms"]
  torch_ratio = ratio(by[TORCH]["median_ms"], k) if TORCH in by else None
  shape = "x".join(map(str, r0["shape"]))
  return (
    f"{shape:>12} {r0['dtype']:8} {'T' if r0['log_target'] else 'F':>2} "
    f"{r0['reduction']:9} {r0['op']:5} |"
    f" {ms(KLDIV):>8} {ms(KLDIV_OPTAX_API):>8} {ms(WHERE):>8} {ms(OPTAX):>8} {ms(TORCH):>8}    |"
    f" {fmt_ratio(by[KLDIV]['ratio_vs_where']):>7} {fmt_ratio(by[KLDIV]['ratio_vs_optax']):>7}"
    f" {fmt_ratio(torch_ratio):>7} |"
    f" {mem(KLDIV):>7} {mem(WHERE):>7} {mem(OPTAX):>7} {mem(KLDIV, 'output_bytes'):>7} |"
    f" {ms(LIMITS[0]):>7} {ms(LIMITS[1]):>7} {ms(LIMITS[2]):>7}"
  )


# -------------------------------------------------------------------------- targets


def evaluate_targets(records: list[dict[str, Any]]) -> dict[str, Any]:
  """The targets at the flagship case (float32, (4096, 8192), batchmean).

  Where the flagship was not measured (``--quick``, ``--sizes``), the largest
  float32 ``batchmean`` case stands in, flagged ``flagship: False``.
  """
  cands = [
    r
    for r in records
    if r["dtype"] == "float32" and r["reduction"] == "batchmean" and r["kind"] == "contender"
  ]
  if not cands:
    return {"shape": None, "flagship": False, "rows": []}
  flagship = [r for r in cands if tuple(r["shape"]) == FLAGSHIP_SHAPE]
  pick = flagship or [r for r in cands if r["elements"] == max(c["elements"] for c in cands)]
  by = {(r["log_target"], r["op"], r["contender"]): r for r in pick}

  def get(lt, op, name, key="median_ms"):
    return by[lt, op, name][key] if (lt, op, name) in by else None

  rows = []
  for lt in sorted({r["log_target"] for r in pick}):
    k_f, k_vg = get(lt, "fwd", KLDIV), get(lt, "vg_x", KLDIV)
    for name, limit, value, *sense in (
      ("fwd / where_guarded", 0.4, ratio(k_f, get(lt, "fwd", WHERE))),
      ("fwd / optax", 1.1, ratio(k_f, get(lt, "fwd", OPTAX))),
      ("vg_x / where_guarded", 0.75, ratio(k_vg, get(lt, "vg_x", WHERE))),
      ("vg_x / optax", 1.1, ratio(k_vg, get(lt, "vg_x", OPTAX))),
      ("torch fwd+bwd / vg_x (speed-up)", 4.0, ratio(get(lt, "vg_x", TORCH), k_vg), ">="),
    ):
      rows.append(target_row(name, limit, value, *sense, log_target=lt, detail=""))
    for op in OPS:
      kb, wb = get(lt, op, KLDIV, "temp_bytes"), get(lt, op, WHERE, "temp_bytes")
      value = ratio(kb, wb) if wb or kb is None or wb is None else 0.0 if kb == 0 else float("inf")
      detail = f"{fmt_bytes(kb)} vs {fmt_bytes(wb)}"
      name = f"XLA temp bytes {op} / where_guarded"
      rows.append(target_row(name, 1.0, value, log_target=lt, detail=detail))
  return {"shape": pick[0]["shape"], "flagship": bool(flagship), "rows": rows}


def show_targets(targets: dict[str, Any]) -> None:
  if targets["shape"] is None:
    print("targets: no float32 batchmean case measured")
    return
  rows = [
    r | {"target": f"log_target={r['log_target']!s:5} {r['target']}"} for r in targets["rows"]
  ]
  title = f"Targets at float32 {'x'.join(map(str, targets['shape']))} batchmean"
  print_targets(rows, not targets["flagship"], f"not the flagship {FLAGSHIP_SHAPE}", title)


# ---------------------------------------------------------------------------- chart


def plot(records: list[dict[str, Any]], path: Path, title: str) -> bool:
  """Time per element vs size, one panel per (dtype, log_target, reduction): each contender's
  ``fwd`` (solid) and ``vg_x`` (dashed), the limits in grey."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib not importable: no chart", file=sys.stderr)
    return False
  mode = operator.itemgetter("dtype", "log_target", "reduction")
  modes = list(dict.fromkeys(map(mode, records)))  # the order they were run in
  ncols = min(4, len(modes))
  nrows = -(-len(modes) // ncols)
  fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.6 * nrows), squeeze=False)
  colors = {KLDIV: "C0", KLDIV_OPTAX_API: "C4", WHERE: "C1", OPTAX: "C2", TORCH: "C3"}
  lines = [
    (name, op, {"ls": ls, "color": c, "marker": "o"}, f"{SHORT[name]} {op}")
    for name, c in colors.items()
    for op, ls in (("fwd", "-"), ("vg_x", "--"))
  ] + [
    (name, "fwd", {"ls": ls, "color": "0.35", "marker": "x"}, f"limit {SHORT[name]}")
    for name, ls in zip(LIMITS, (":", "-.", (0, (1, 3))))
  ]
  for ax, m in zip(axes.flat, modes):
    for name, op, style, label in lines:
      pts = sorted(
        (r["elements"], r["ns_per_element"])
        for r in records
        if mode(r) == m and r["contender"] == name and r["op"] == op
      )
      if pts:
        ax.plot(*zip(*pts), ms=3, label=label, **style)
    ax.set_title("{}, log_target={}, {}".format(*m), fontsize=9)
    ax.set_xscale("log", base=2)
    ax.set(yscale="log", xlabel="elements", ylabel="ns / element (median)")
    ax.grid(True, which="both", alpha=0.3)
  for ax in axes.flat[len(modes) :]:
    ax.set_visible(False)
  handles, labels = axes.flat[0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="lower center", ncol=min(7, len(labels)), fontsize=8)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout(rect=(0, 0.08, 1, 0.95))
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


# ----------------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> dict[str, Any]:
  sizes = args.sizes or [2**k for k in (QUICK_LOG2_SIZES if args.quick else DEFAULT_LOG2_SIZES)]
  dtypes = [d.strip() for d in args.dtypes.split(",")]
  reductions = [r.strip() for r in args.reductions.split(",")]
  ops = [o.strip() for o in args.ops.split(",")]
  log_targets = {"both": [False, True], "true": [True], "false": [False]}[args.log_target]
  for value, allowed, what in (
    (dtypes, DTYPES, "dtype"),
    (reductions, REDUCTIONS, "reduction"),
    (ops, OPS, "op"),
  ):
    bad = sorted(set(value) - set(allowed))
    if bad:
      raise SystemExit(f"bench_core: unknown {what} {bad}; expected some of {list(allowed)}")
  torch = None if args.no_torch else torch_module()
  machine = start("core")
  if torch is None:
    print("core: torch not used (not importable or --no-torch)")
  print(TABLE_HEADER)
  records: list[dict[str, Any]] = []
  for elements in sizes:
    shape = shape_for(elements)
    for dtype in dtypes:
      for lt in log_targets:
        data = make_data(shape, dtype, lt, args.seed)
        for reduction in reductions:
          tdata = None if torch is None else torch_thunks(torch, *data, dtype, reduction, lt)
          flagship = is_flagship(shape, dtype, reduction)
          repeats = args.repeats or default_repeats(elements, args.quick, flagship)
          for op in ops:
            rs = run_case(data, tdata, elements, shape, dtype, lt, reduction, op, repeats)
            records.extend(rs)
            print(table_row(rs), flush=True)
        del data, tdata
  targets = evaluate_targets(records)
  show_targets(targets)
  settings = {"sizes": sizes, "shapes": [list(shape_for(n)) for n in sizes], "dtypes": dtypes}
  settings |= {"reductions": reductions, "log_targets": log_targets, "ops": ops}
  # repeats_override None: default_repeats; each record has its own
  settings |= {"repeats_override": args.repeats, "quick": args.quick, "seed": args.seed}
  settings |= {"torch": torch is not None, "zero_fraction": ZERO_FRACTION}
  return {
    "section": "core",
    "machine": machine,
    "settings": settings,
    "notes": "what each contender, operation and limit is: benchmarks/README.md, Method",
    "records": records,
    "targets": targets,
  }


def main(argv: Sequence[str] | None = None) -> int:
  p = parser(__doc__, quick="a few small sizes, few repeats", repeats="repeats for every size")
  p.add_argument(
    "--sizes",
    type=parse_sizes,
    default=None,
    help="comma-separated log2 sizes or element counts (default 16,19,22,25)",
  )
  p.add_argument("--dtypes", default=",".join(DTYPES))
  p.add_argument("--reductions", default=",".join(REDUCTIONS))
  p.add_argument("--log-target", choices=("both", "true", "false"), default="both")
  p.add_argument("--ops", default=",".join(OPS))
  p.add_argument("--no-torch", action="store_true", help="leave torch out")
  args = p.parse_args(argv)
  result = run(args)
  m = result["machine"]
  title = (
    f"kldiv_jax core benchmark: {m['cpu_model']} ({m['cpu_cores']} cores), "
    f"{m['backend']} [{m['device_kind']}], jax {m['versions']['jax']}"
  )
  charted = plot(result["records"], args.out / "core.png", title)
  save(result, args.out, f" and {args.out / 'core.png'}" if charted else "")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
