"""The accelerator cases run for real: ``bench_accel``'s estimates, timed on an attached GPU or TPU.

The same row and fused cases as ``bench_accel.py`` (``value_and_grad`` wrt the student
against the straightforward code, the row cases with a temperature at T = 1 and T = 2,
or for the fused losses against the same loss on materialised ``hidden @ weight``
logits), on random data, on the default device: medians
of round-robin timed calls (``_harness.time_contenders``), XLA's temp of each compiled
program, the bandwidth at which each row kernel moves its HBM floor (both inputs read
once, the gradient written once), and each pair's values side by side. Nothing here is
an estimate; the figures are only as good as the one machine and run they come from.

  python benchmarks/bench_device.py                 # full sizes (needs about 40 GB)
  python benchmarks/bench_device.py --quick         # small sizes, a smoke test (any device)
  python benchmarks/bench_device.py --cases jsd,tvd,fused_distillation --repeats 11
  python benchmarks/bench_device.py --cases forward_kl,jsd --gpu-kernels both  # opt-in kernels
  python benchmarks/bench_device.py --cases fused_distillation+logits_f32,fused_policy+logits_f32

``--gpu-kernels both`` adds to each row case a third contender, ``kldiv_jax_gpu``: the same
loss traced with the opt-in Pallas Triton kernels on (``kldiv_jax._gpu_rows``' row
statistics and class sums, and ``kldiv_jax._gpu_grad``'s gradient pass: the programs are
``value_and_grad``; on a GPU only), timed round-robin with the other two, its ratio to ``kldiv_jax`` (XLA) and the rate at
which it moves the floor beside theirs; ``on`` times it in place of ``kldiv_jax``.
``--gpu-configs 2x2048w8s3,...`` adds one such contender per layout of the kernels (rows per
program x classes per tile, warps, pipeline stages; tile 0: JSD, skew KL, skew reverse KL and
TVD from whole rows held by a program, ``1x0w16s1`` the default where a row fits),
``kldiv_jax_gpu[2x2048w8s3]``: a sweep.
The fused token log-probs, policy and distillation losses (``GPU_FUSED_CASES``) take
``--gpu-kernels`` too: the opt-in fused-head kernels (``kldiv_jax._gpu_fused_head``,
``kldiv_jax._gpu_fused_distill``), each backward (two kernels that own
their sums, ``gpu owned``; one with atomic adds to dW, ``gpu atomic``, and it with CCE's
gradient filter at 2**-12, ``gpu atomic skip``), beside XLA's chunk
loop and the materialised loss, in one round-robin; ``--head-configs
owned:128x128x64w8s3,...`` adds one contender per layout of theirs (backward, tokens per
block x vocabulary tile x hidden step, warps, stages).

A fused case ending ``+logits_f32`` runs the loss with ``logits_dtype=jnp.float32`` and times
the default (bf16 chunk logits) fused loss beside it, in the same round robin.
"""

import json
import sys
from pathlib import Path
from typing import Any

import _harness
import jax
import jax.numpy as jnp
from _harness import fmt_bytes, fmt_ratio
from bench_accel import (
  FUSED_ARGS,
  FUSED_SHAPE,
  GPU_FUSED_CASES,
  GPU_HEAD_BACKWARDS,
  GPU_HEAD_MATMULS,
  LOGITS_F32,
  POLICY_SHAPE,
  QUICK_FUSED_SHAPE,
  QUICK_POLICY_SHAPE,
  QUICK_ROW_SHAPES,
  ROW_ARGS,
  ROW_SHAPES,
  TOPK,
  _fused_contenders,
  _row_contenders,
  _temperature,
  head_config,
  row_temperatures,
  with_gpu_kernels,
  with_head_backward,
)


def _inputs(kinds, n: int, v: int, h: int | None, dtype, seed: int) -> list[jax.Array]:
  """Random arguments of the given kinds (``bench_accel``'s), made on the device."""
  keys = iter(jax.random.split(jax.random.key(seed), len(kinds)))
  normal = lambda shape, scale=1.0: scale * jax.random.normal(next(keys), shape, jnp.float32)  # noqa: E731
  stride = max(1, v // TOPK)

  def make(kind):
    if kind == "x":
      return normal((n, v), 2.0).astype(dtype)
    if kind in ("labels", "ids"):
      return jax.random.randint(next(keys), (n,), 0, v, jnp.int32)
    if kind == "topk_ids":  # k distinct ids per row
      start = jax.random.randint(next(keys), (n, 1), 0, v, jnp.int32)
      return (start + stride * jnp.arange(TOPK, dtype=jnp.int32)) % v
    if kind == "topk_lp":
      return jax.nn.log_softmax(normal((n, TOPK), 2.0))
    if kind == "per_token":
      return -jnp.abs(normal((n,)))
    if kind == "h":
      return normal((n, h)).astype(dtype)
    assert kind == "w", kind
    return normal((h, v), h**-0.5).astype(dtype)

  return jax.block_until_ready([make(k) for k in kinds])


def _pair(fns: dict[str, Any], args, argnums, repeats: int) -> dict[str, Any]:
  """Both contenders timed round-robin, with their values and temps."""
  out = _harness.time_grads(fns, args, repeats, argnums=argnums, keep=("value", _value))
  keys = ("median_ms", "times_ms", "temp_bytes", "value", "compile_s")
  return {name: {k: r[k] for k in keys} for name, r in out.items()}


def _value(out) -> float:
  return float(out[0])


def _row(
  case: str, n: int, v: int, dtype: str, T, repeats: int, seed: int, gpu: str = "off", configs=()
) -> dict[str, Any]:
  """A row case at temperature ``T`` (``None``: a case without one); ``gpu``: the opt-in GPU
  kernels off, on, or both side by side; ``configs``: their layouts to sweep."""
  kinds, floor_arrays = ROW_ARGS[case]
  dt = jnp.dtype(dtype)
  args = _inputs(kinds, n, v, None, dt, seed)
  if case == "kl_div":  # torch's semantics: log-probabilities and probabilities
    args = [jax.nn.log_softmax(args[0].astype(jnp.float32)).astype(dt), jax.nn.softmax(args[1])]
  row: dict[str, Any] = {"case": case, "kind": "row", "shape": [n, v], "dtype": dtype}
  row["temperature"] = T
  fns = _row_contenders(case, T or 1.0)
  if gpu == "on":
    fns["kldiv_jax"] = with_gpu_kernels(fns["kldiv_jax"])
  elif gpu == "both":
    fns["kldiv_jax_gpu"] = with_gpu_kernels(fns["kldiv_jax"])
  for text in configs:
    fns[f"kldiv_jax_gpu[{text}]"] = with_gpu_kernels(fns["kldiv_jax"], _config(text))
  row |= _pair(fns, args, 0, repeats)
  row["gpu_kernels"] = gpu
  floor = floor_arrays * n * v * dt.itemsize
  ours, naive = row["kldiv_jax"], row["naive"]
  row["floor_bytes"] = floor
  row["time_ratio"] = ours["median_ms"] / naive["median_ms"]
  row["floor_tb_per_s"] = floor / (ours["median_ms"] * 1e-3) / 1e12
  row["naive_floor_tb_per_s"] = floor / (naive["median_ms"] * 1e-3) / 1e12
  for name in [k for k in row if k.startswith("kldiv_jax_gpu")]:
    kernel = row[name]["median_ms"]
    row[name]["time_ratio_to_xla"] = kernel / ours["median_ms"]  # the kernels' time / XLA's
    row[name]["floor_tb_per_s"] = floor / (kernel * 1e-3) / 1e12
  return row


def _fused(
  case: str, shape, repeats: int, seed: int, gpu: str = "off", configs=()
) -> dict[str, Any]:
  """A fused case against the materialised loss; ``gpu`` (``GPU_FUSED_CASES``): the opt-in
  fused-head kernels (``kldiv_jax._gpu_fused_head``) off, on (in place of XLA's chunk loop)
  or both side by side; ``configs``: their layouts to sweep (``"owned:64x128x64w4s3"``)."""
  n, h, v = shape
  kinds, _ = FUSED_ARGS[case]
  args = _inputs(kinds, n, v, h, jnp.dtype("bfloat16"), seed)
  materialised, fused = _fused_contenders(case)
  fns = {"materialised": materialised, "fused": fused(None)}
  gpu = gpu if case in GPU_FUSED_CASES else "off"
  if gpu == "on":
    fns["fused"] = with_gpu_kernels(fns["fused"])
  elif gpu == "both":  # each backward of the kernels (GPU_HEAD_BACKWARDS)
    for name, (backward, _, skip) in GPU_HEAD_BACKWARDS.items():
      if skip is None or case not in GPU_HEAD_MATMULS:  # no filter in the distillation's
        fns[name] = with_head_backward(fns["fused"], backward, skip=skip)
  for text in configs if gpu != "off" else ():
    backward, _, layout = text.partition(":")
    fns[f"kldiv_jax_gpu[{text}]"] = with_head_backward(fns["fused"], backward, head_config(layout))
  base = case.removesuffix(LOGITS_F32)
  if base != case:  # logits_dtype=float32: timed beside the default (bf16) fused loss too
    fns["fused_default"] = _fused_contenders(base)[1](None)
  row: dict[str, Any] = {"case": case, "kind": "fused", "shape": list(shape), "dtype": "bfloat16"}
  row |= _pair(fns, args, (0, 1), repeats)
  row["time_ratio"] = row["fused"]["median_ms"] / row["materialised"]["median_ms"]
  row["gpu_kernels"] = gpu
  for name in [k for k in row if k.startswith("kldiv_jax_gpu")]:
    kernel = row[name]["median_ms"]
    row[name]["time_ratio_to_xla"] = kernel / row["fused"]["median_ms"]
    row[name]["time_ratio"] = kernel / row["materialised"]["median_ms"]
  if "fused_default" in row:
    ours, default = row["fused"], row["fused_default"]
    row["vs_default"] = {
      "time": ours["median_ms"] / default["median_ms"],
      "temp": ours["temp_bytes"] / max(default["temp_bytes"], 1),
    }
  return row


def _line(row: dict[str, Any]) -> str:
  a, b = ("naive", "kldiv_jax") if row["kind"] == "row" else ("materialised", "fused")
  shape = "x".join(map(str, row["shape"]))
  text = (
    f"{row['case']:<24} {shape:<17} {row['dtype']:<9} {_temperature(row):<4} {b}"
    f" {row[b]['median_ms']:8.3f} ms"
    f" / {a} {row[a]['median_ms']:8.3f} ms = {fmt_ratio(row['time_ratio'])}"
    f"  temp {fmt_bytes(row[b]['temp_bytes'])} ({fmt_bytes(row[a]['temp_bytes'])})"
    f"  values {row[b]['value']:.6g} / {row[a]['value']:.6g}"
  )
  if "vs_default" in row:
    text += (
      f"  vs default {row['fused_default']['median_ms']:8.3f} ms:"
      f" time {fmt_ratio(row['vs_default']['time'])}, temp {fmt_ratio(row['vs_default']['temp'])}"
    )
  if row["kind"] == "row":
    text += f"  floor at {row['floor_tb_per_s']:.2f} TB/s ({row['naive_floor_tb_per_s']:.2f})"
  for name in [k for k in row if k.startswith("kldiv_jax_gpu") and row["kind"] == "fused"]:
    g = row[name]
    label = name[14:].replace("_", " ") + " backward" if name in GPU_HEAD_BACKWARDS else name[14:-1]
    label = "owned backward" if name == "kldiv_jax_gpu" else label
    text += (
      f"\n{'':<24} {'gpu ' + label:<22} {g['median_ms']:8.3f} ms"
      f" = {fmt_ratio(g['time_ratio'])} x materialised, {fmt_ratio(g['time_ratio_to_xla'])} x"
      f" fused (XLA)  temp {fmt_bytes(g['temp_bytes'])}  value {g['value']:.6g}"
      f"  compile {g['compile_s']:.1f}s ({row['fused']['compile_s']:.1f}s)"
    )
  for name in [k for k in row if k.startswith("kldiv_jax_gpu") and row["kind"] == "row"]:
    g = row[name]
    text += (
      f"\n{'':<24} {name[len('kldiv_jax_') :]:<22} {g['median_ms']:8.3f} ms"
      f" = {fmt_ratio(g['time_ratio_to_xla'])} x kldiv_jax (XLA)"
      f"  floor at {g['floor_tb_per_s']:.2f} TB/s  temp {fmt_bytes(g['temp_bytes'])}"
      f"  value {g['value']:.6g}  compile {g['compile_s']:.1f}s ({row['kldiv_jax']['compile_s']:.1f}s)"
    )
  return text


def _config(text: str) -> tuple[int, int, int, int]:
  """``"2x2048w8s3"`` as the kernels' layout ``(2, 2048, 8, 3)``."""
  rows, rest = text.split("x")
  tile, rest = rest.split("w")
  warps, stages = rest.split("s")
  return int(rows), int(tile), int(warps), int(stages)


def _shape(text: str) -> tuple[tuple[int, int], str]:
  """``"4096x8192:float32"`` as ``((4096, 8192), "float32")``."""
  dims, _, dtype = text.partition(":")
  n, v = (int(d) for d in dims.split("x"))
  return (n, v), dtype or "float32"


def main(argv=None) -> int:
  p = _harness.parser(__doc__, repeats="timed calls per contender (default 7)")
  p.add_argument("--cases", default="", help="comma-separated cases (default: all)")
  p.add_argument(
    "--gpu-kernels",
    choices=("off", "on", "both"),
    default="off",
    help="the row cases and fused_token_log_probs with kldiv_jax's opt-in Pallas Triton "
    "kernels: off (default), on (in place of XLA's), both (side by side, in one round-robin)",
  )
  p.add_argument(
    "--gpu-configs",
    default="",
    help="layouts of the GPU kernels to time side by side, RxTILEwWARPSsSTAGES (TILE 0: whole "
    "rows), comma-separated",
  )
  p.add_argument(
    "--head-configs",
    default="",
    help="layouts of the fused-head kernels to time side by side (with --gpu-kernels), "
    "BACKWARD:TOKENSxVOCABxHIDDENwWARPSsSTAGES (owned:64x128x64w4s3), comma-separated",
  )
  p.add_argument(
    "--shapes", default="", help="row shapes NxV:dtype, comma-separated (default: the standard)"
  )
  args = p.parse_args(argv)
  repeats = args.repeats or 7
  result = _harness.start("device") | {
    "section": "device",
    "device_kind": jax.devices()[0].device_kind,
  }
  cases = [c for c in args.cases.split(",") if c] or [*ROW_ARGS, *FUSED_ARGS]
  records: list[dict[str, Any]] = []
  out = Path(args.out)
  print(f"device: {result['device_kind']} | jax {jax.__version__}", flush=True)

  def record(make, *make_args):
    try:
      row = make(*make_args)
      print(_line(row), flush=True)
    except Exception as err:  # reported, not fatal: the next case still runs
      row = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
      print(f"error: {row['error']}", flush=True)
    records.append(row)
    _harness.write_json(out / "device.json", result | {"records": records})

  shapes = QUICK_ROW_SHAPES if args.quick else ROW_SHAPES
  if args.shapes:
    shapes = [_shape(s) for s in args.shapes.split(",")]
  for (n, v), dtype in shapes:
    for case in [c for c in cases if c in ROW_ARGS]:
      configs = [c for c in args.gpu_configs.split(",") if c]
      for T in row_temperatures(case):  # T = 1 (the default) and T = 2
        record(_row, case, n, v, dtype, T, repeats, args.seed, args.gpu_kernels, configs)
  for case in [c for c in cases if c in FUSED_ARGS]:
    policy = case.startswith("fused_policy")
    shape = (QUICK_POLICY_SHAPE if args.quick else POLICY_SHAPE) if policy else None
    shape = shape or (QUICK_FUSED_SHAPE if args.quick else FUSED_SHAPE)
    head_configs = [c for c in args.head_configs.split(",") if c]
    record(_fused, case, shape, max(3, repeats // 2), args.seed + 1, args.gpu_kernels, head_configs)
  print(json.dumps({"errors": sum("error" in r for r in records)}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
