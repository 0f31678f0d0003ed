"""Accelerator estimates: every loss compiled for TPU v5e/v6e and an H100, without the device.

XLA compiles for a chip that is not there (a compile-only, "deviceless" client) and
reports HBM bytes, flops, temporaries and, on TPU, its own time estimate: **XLA's
estimates, not measurements**, of ``value_and_grad`` wrt the student against the
straightforward code ("naive"; the cases with a temperature at T = 1, the default, and at
T = 2) or, for the fused losses, the materialised logits. How
(topologies, the roofline, fused loops unrolled at one and two chunks and extrapolated):
*Accelerators* in ``benchmarks/README.md``. Each platform runs in its own virtual
environment next to the repository (``.venv-accel-tpu``, ``.venv-accel-cuda``, created on
first use): this script re-runs itself there as a worker per target.

  python benchmarks/bench_accel.py                    # v5e, v6e, h100; full sizes
  python benchmarks/bench_accel.py --quick            # small sizes, a smoke test
  python benchmarks/bench_accel.py --targets v5e --cases forward_kl,fused_distillation
"""

import argparse
import contextlib
import functools
import importlib.metadata
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import _harness
from _harness import HERE, REPO, fmt_bytes, fmt_ratio, print_targets, target_row
from bench_divergences import SPECS, straightforward


def _tpu(topology: str, accel: str, peak: float, bw: float, hbm: int) -> dict[str, Any]:
  """A TPU chip: its vector units do an eighth of the matmul peak."""
  tpu = dict(kind="tpu", topology=topology, accel=accel, peak=peak, vector=peak / 8)
  return tpu | dict(bw=bw, hbm=hbm)


TARGETS: dict[str, dict[str, Any]] = {
  # peak: dense bf16 matmul flop/s; vector: float32 elementwise flop/s (the row kernels);
  # bw: HBM bytes/s; hbm: bytes. Public spec-sheet figures.
  "v5e": _tpu("v5e:2x2", "v5litepod-4", 197e12, 819e9, 16 * 2**30),
  "v6e": _tpu("v6e:2x2", "v6e-4", 918e12, 1640e9, 32 * 2**30),
  "h100": dict(kind="cuda", peak=989e12, vector=67e12, bw=3.35e12, hbm=80 * 2**30),
}
VENV_EXTRA = {"tpu": "tpu", "cuda": "cuda12"}
H100_CONFIG = HERE / "h100_sxm.txtpb"

ROW_SHAPES = [((4096, 8192), "float32"), ((2048, 131072), "bfloat16")]
QUICK_ROW_SHAPES = [((256, 2048), "float32")]
FUSED_SHAPE = (16384, 2048, 131072)  # N, H, V (bfloat16)
QUICK_FUSED_SHAPE = (2048, 256, 8192)
# The row cases with a temperature run at both: T = 1 (the losses' default, a constant XLA
# folds) and T = 2; the targets are checked at each.
ROW_TEMPERATURES = (1.0, 2.0)
TOPK = 64
# Targets of the accelerator issue, checked on v5e and h100 (XLA estimates).
ROW_HBM_TARGET = 1.8  # HBM bytes / floor
ROW_TIME_TARGET = 1.0  # time / naive, and 0.8 where naive moves > 2.25x the floor
ROW_TIME_TARGET_HEAVY, HEAVY_NAIVE = 0.8, 2.25
ROW_TEMP_TARGET = 0.05  # temp / one [N, V] float32 array
FUSED_TIME_TARGET = 1.15  # time per token / materialised
FUSED_TEMP_TARGET = {"v5e": 2.5 * 2**30, "h100": 5 * 2**30}
CHECKED_TARGETS = ("v5e", "h100")

# The row cases: the divergences (two logits, the floor three [N, V] arrays) and these
# (argument kinds, [N, V] arrays in the floor).
ROW_ARGS = {name: (["x", "x"], 3) for name in SPECS} | {
  "kl_div_from_logits": (["x", "x"], 3),
  "distillation_loss": (["x", "x", "labels"], 3),
  "token_log_probs": (["x", "ids"], 2),
  "token_log_probs_entropy": (["x", "ids"], 2),
  "divergence_from_topk": (["x", "topk_ids", "topk_lp"], 2),
  "kl_div": (["x", "x"], 3),
}
ROW_CASES = tuple(ROW_ARGS)
# The row cases without a temperature (one run each).
NO_TEMPERATURE = ("token_log_probs", "token_log_probs_entropy", "kl_div")
# Reported, not among the targets (its floor and straightforward code differ: a gather).
UNCHECKED = ("divergence_from_topk",)  # and the fused cases with LOGITS_F32 (below)
# The policy loss's target (issue 23), at its own shape: time <= 1.05x the materialised
# loss's (token_log_probs on hidden @ weight, then policy_loss).
POLICY_SHAPE = (8192, 1024, 65536)  # N, H, V (bfloat16)
QUICK_POLICY_SHAPE = (2048, 256, 8192)
# Its temp target (0.05x) is the CPU one (benchmarks/bench_rl.py): XLA:TPU and XLA:GPU fuse
# the materialised loss down to ~one [N, V] float32 array, and an accelerator chunk is sized
# for the matmuls' intensity; here the temp is held to the fused losses' budget per chip.
POLICY_TIME_TARGET = 1.05
POLICY_OPTIONS = dict(clip_low=0.2, clip_high=0.28, entropy_coef=0.01)
# The fused cases: (argument kinds, reads of an [H, V] head per chunk). The reads: the
# logits of each side, the gradient wrt the hidden states; the token log-probs recompute the
# logits backward, the policy loss computes its gradient in the forward pass. With the
# float32 weight gradient's read and write, the weight traffic a chunk cannot avoid.
FUSED_ARGS = {
  "fused_distillation": (["h", "w", "h", "w", "labels"], 3),
  "fused_topk": (["h", "w", "topk_ids", "topk_lp"], 2),
  "fused_token_log_probs": (["h", "w", "ids"], 3),
  "fused_policy": (["h", "w", "ids", "per_token", "per_token"], 2),
}
# Each fused loss again with ``logits_dtype=jnp.float32`` (bf16 inputs' chunk logits and their
# gradient kept in float32): reported beside the default (bf16) fused loss of the same run,
# what the option costs in time and temp; not among the targets.
LOGITS_F32 = "+logits_f32"
FUSED_ARGS |= {case + LOGITS_F32: FUSED_ARGS[case] for case in list(FUSED_ARGS)}
FUSED_CASES = tuple(FUSED_ARGS)


def row_temperatures(case: str) -> tuple[float | None, ...]:
  """The temperatures a row case runs at: ``ROW_TEMPERATURES``, or ``(None,)`` without one."""
  return (None,) if case in NO_TEMPERATURE else ROW_TEMPERATURES


# ----------------------------------------------------------------------------- the cases


def _row_contenders(case: str, T: float) -> dict[str, Callable]:
  """``{"naive": f, "kldiv_jax": g}`` of a row case (its arguments: ``ROW_ARGS``) at
  temperature ``T`` (a Python float, as users pass it): scalar losses of their arguments,
  differentiated wrt the first."""
  import jax
  import jax.numpy as jnp
  from bench_logits import naive_distill

  import kldiv_jax as k

  f32 = lambda a: a.astype(jnp.float32)  # noqa: E731

  def vs_naive(formula, ours):  # the straightforward formula on float32 logits
    return {"naive": lambda s, t: formula(f32(s), f32(t), T), "kldiv_jax": ours}

  if case in SPECS:
    spec = SPECS[case]
    ours = lambda s, t: jnp.mean(k.divergence_from_logits(s, t, divergence=spec, temperature=T))  # noqa: E731
    return vs_naive(straightforward(case, dict(spec.params)), ours)

  def naive_tokens(s, y):
    lp = jax.nn.log_softmax(f32(s))
    out = jnp.sum(jnp.take_along_axis(lp, y[:, None], axis=-1))
    return out + 0.01 * jnp.sum(-jnp.sum(jnp.exp(lp) * lp, -1)) if entropy else out

  def tokens(s, y):
    if not entropy:
      return jnp.sum(k.token_log_probs(s, y))
    lp, h = k.token_log_probs(s, y, return_entropy=True)
    return jnp.sum(lp) + 0.01 * jnp.sum(h)

  def naive_topk(s, ids, lp):  # forward KL, renormalised top-k teacher, both at T
    lq = jnp.take_along_axis(jax.nn.log_softmax(f32(s) / T), ids, axis=-1)
    lp = jax.nn.log_softmax(lp / T)
    return jnp.mean(jnp.sum(jnp.exp(lp) * (lp - lq), -1))

  def where_formula(x, t):  # the double-where formula (bench_core's where_guarded)
    x, t = f32(x), f32(t)
    return jnp.sum(jnp.where(t > 0, t * (jnp.log(jnp.where(t > 0, t, 1.0)) - x), 0.0)) / x.shape[0]

  entropy = case.endswith("entropy")
  distill = naive_distill(T, 0.5)
  return {
    "kl_div_from_logits": vs_naive(
      straightforward("forward_kl", {}),
      lambda s, t: jnp.mean(k.kl_div_from_logits(s, t, temperature=T)),
    ),
    "distillation_loss": {
      "naive": lambda s, t, y: distill(f32(s), f32(t), y),
      "kldiv_jax": lambda s, t, y: k.distillation_loss(s, t, y, temperature=T, alpha=0.5),
    },
    "token_log_probs": {"naive": naive_tokens, "kldiv_jax": tokens},
    "token_log_probs_entropy": {"naive": naive_tokens, "kldiv_jax": tokens},
    "divergence_from_topk": {
      "naive": naive_topk,
      "kldiv_jax": lambda s, ids, lp: jnp.mean(k.kl_div_from_topk(s, ids, lp, temperature=T)),
    },
    "kl_div": {
      "naive": where_formula,
      "kldiv_jax": lambda x, t: k.kl_div(x, t, reduction="batchmean"),
    },
  }[case]


def _fused_contenders(case: str) -> tuple[Callable, Callable[[int | None], Callable]]:
  """``(materialised loss, chunk_size -> fused loss)`` of a fused case (``FUSED_ARGS``); a
  ``LOGITS_F32`` case: the fused loss with ``logits_dtype=jnp.float32``, the materialised
  loss the same (bf16 logits)."""
  import jax.numpy as jnp

  import kldiv_jax as k

  mm = jnp.matmul
  base = case.removesuffix(LOGITS_F32)
  if base != case:
    k = _WithOptions(k, logits_dtype=jnp.float32)

  def total(out):  # log-probabilities with an entropy bonus
    lp, h = out
    return jnp.sum(lp) + 0.01 * jnp.sum(h)

  def materialised_policy(h, w, y, old, adv):  # clip-higher PPO/GRPO, entropy bonus, token-mean
    lp, entropy = k.token_log_probs(mm(h, w), y, return_entropy=True)
    return k.policy_loss(lp, old, adv, entropy=entropy, **POLICY_OPTIONS)[0]

  return {
    "fused_distillation": (
      lambda h, w, th, tw, y: k.distillation_loss(mm(h, w), mm(th, tw), y),
      lambda c: (
        lambda h, w, th, tw, y: k.fused_distillation_loss(h, w, th, tw, labels=y, chunk_size=c)
      ),
    ),
    "fused_topk": (
      lambda h, w, ids, lp: jnp.mean(k.kl_div_from_topk(mm(h, w), ids, lp)),
      lambda c: lambda h, w, ids, lp: k.fused_topk_distillation_loss(h, w, ids, lp, chunk_size=c),
    ),
    "fused_token_log_probs": (
      lambda h, w, y: total(k.token_log_probs(mm(h, w), y, return_entropy=True)),
      lambda c: (
        lambda h, w, y: total(k.fused_token_log_probs(h, w, y, return_entropy=True, chunk_size=c))
      ),
    ),
    "fused_policy": (
      materialised_policy,
      lambda c: (
        lambda h, w, y, old, adv: k.fused_policy_loss(
          h, w, y, old, adv, chunk_size=c, **POLICY_OPTIONS
        )[0]
      ),
    ),
  }[base]


class _WithOptions:
  """``kldiv_jax`` with keyword options added to its fused losses."""

  FUSED = ("fused_distillation_loss", "fused_topk_distillation_loss", "fused_token_log_probs",
           "fused_policy_loss")  # fmt: skip

  def __init__(self, module, **options):
    self._module, self._options = module, options

  def __getattr__(self, name):
    fn = getattr(self._module, name)
    return functools.partial(fn, **self._options) if name in self.FUSED else fn


# ----------------------------------------------------------------------------- the worker


def _device(target: str):
  from jax.experimental import topologies

  cfg = TARGETS[target]
  if cfg["kind"] == "tpu":
    return topologies.get_topology_desc(topology_name=cfg["topology"], platform="tpu").devices[0]
  return topologies.get_topology_desc(
    platform="cuda", target_config=H100_CONFIG.read_text(), topology="1x1x1"
  ).devices[0]


def _cost(compiled, target: str) -> dict[str, float | None]:
  """Flops, HBM bytes and (TPU) XLA's optimal_seconds of a compiled program."""
  tpu = TARGETS[target]["kind"] == "tpu"
  if tpu:
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
  else:
    import jax
    from jax._src.lib import _jax  # tooling only: XLA's HLO cost analysis of the GPU module

    module = compiled.runtime_executable().hlo_modules()[0]
    ca = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
  return {
    "flops": float(ca.get("flops", 0.0)),
    "bytes": float(ca.get("bytes accessed", 0.0)),
    "optimal_seconds": float(ca.get("optimal_seconds", -1.0)) if tpu else None,
  }


def _seconds(cost: dict[str, float | None], target: str, matmul: bool) -> tuple[float, str]:
  """Estimated seconds and where they come from (``optimal_seconds`` or ``roofline``)."""
  opt = cost.get("optimal_seconds")
  if opt is not None and opt > 0:
    return opt, "optimal_seconds"
  cfg = TARGETS[target]
  peak = cfg["peak"] if matmul else cfg["vector"]
  return max(cost["flops"] / peak, cost["bytes"] / cfg["bw"]), "roofline"


def _structs(kinds: Sequence[str], dims: dict[str, Any], dev):
  import jax
  import jax.numpy as jnp
  from jax.sharding import SingleDeviceSharding

  sharding = SingleDeviceSharding(dev)
  n, v, h, dt = dims["n"], dims["v"], dims.get("h"), dims["dtype"]
  shapes = {
    "x": ((n, v), dt),
    "labels": ((n,), jnp.int32),
    "ids": ((n,), jnp.int32),
    "topk_ids": ((n, TOPK), jnp.int32),
    "topk_lp": ((n, TOPK), jnp.float32),
    "per_token": ((n,), jnp.float32),
    "h": ((n, h), dt),
    "w": ((h, v), dt),
  }
  return [jax.ShapeDtypeStruct(*shapes[k], sharding=sharding) for k in kinds]


def _compile(fn, argnums, structs, options=None):
  import jax

  lowered = jax.jit(jax.value_and_grad(fn, argnums=argnums)).lower(*structs)
  return lowered.compile(options) if options else lowered.compile()


# The trace-context value inside _unrolled_loops (the tests' platform_branch uses 1_000_00x).
_UNROLLED_TRACES = 2_000_001


@contextlib.contextmanager
def _unrolled_loops():
  """Every ``lax.fori_loop`` traced inside is fully unrolled (XLA counts a loop body once).

  The traces made inside are kept apart from the others: the library's kernels are
  module-level ``jax.jit`` functions whose traces JAX caches by shapes and trace context,
  and an unrolled trace at ``2 c`` tokens was reused by the program users run at ``N = 2 c``
  (its temp reported for the looped one). Inside, the trace context holds a value of its own
  (``jax_pgle_profiling_runs``, which nothing reads while profile-guided latency estimation
  is off; the tests' ``platform_branch`` does the same), so no trace serves both sides and
  no cache needs clearing."""
  import jax
  from jax import lax

  original, runs = lax.fori_loop, jax.config.jax_pgle_profiling_runs
  assert not jax.config.jax_enable_pgle

  def unrolled(lower, upper, body, init, *, unroll=None):
    return original(lower, upper, body, init, unroll=True)

  jax.config.update("jax_pgle_profiling_runs", _UNROLLED_TRACES)
  lax.fori_loop = unrolled
  try:
    yield
  finally:
    lax.fori_loop = original
    jax.config.update("jax_pgle_profiling_runs", runs)


def _measure(fn, argnums, structs, target: str, matmul: bool, options=None) -> dict[str, Any]:
  start = time.perf_counter()
  compiled = _compile(fn, argnums, structs, options)
  cost = _cost(compiled, target)
  seconds, source = _seconds(cost, target, matmul)
  temp = int(compiled.memory_analysis().temp_size_in_bytes)
  return (
    cost
    | {"seconds": seconds, "time_source": source, "temp_bytes": temp}
    | {"compile_s": time.perf_counter() - start}
  )


def _or_error(compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
  try:
    return compute()
  except Exception as err:  # what XLA cannot compile: reported, not fatal
    return {"error": f"{type(err).__name__}: {str(err)[:300]}"}


# The row cases that take the opt-in Pallas Triton kernels (kldiv_jax._gpu_rows, and the
# gradient pass's, kldiv_jax._gpu_grad: the programs are the losses' gradients): on the CUDA
# target they are compiled too (``kldiv_jax_gpu``: Triton compiles them for the chip). XLA's
# cost analysis counts no flops and no bytes of a Triton custom call (its ``bytes`` is then
# the rest of the program: the derivative rule's pass), so the kernels' own traffic is added
# from the optimized module: each call's operands read once and results written once
# (``kernel_bytes``; what the kernels do when a program reads its block of the logits once
# and nothing spills: ptxas's report, ``ptxas``), and their flops are taken as those of the
# XLA passes they replace (the default program's flops less this one's).
GPU_KERNEL_CASES = ("forward_kl", "reverse_kl", "symmetric_kl", "jsd", "skew_kl")
GPU_KERNEL_CASES += ("skew_reverse_kl", "tvd", "alpha_beta", "kl_div_from_logits")
TRITON_TARGET = "__gpu$xla.gpu.triton"
_HLO_BYTES = {"f64": 8, "s64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2}
_HLO_BYTES |= {"s16": 2, "s8": 1, "u8": 1, "pred": 1}


def kernel_bytes(hlo: str) -> tuple[int, int]:
  """``(calls, bytes)`` of the Triton custom calls in an optimized HLO module's text: their
  results (the shapes before ``custom-call(``) and operands (``operand_layout_constraints``),
  each once."""
  import re

  shape = re.compile(r"\b(" + "|".join(_HLO_BYTES) + r")\[([0-9,]*)\]")

  def size(text):
    total = 0
    for dtype, dims in shape.findall(text):
      n = 1
      for d in filter(None, dims.split(",")):
        n *= int(d)
      total += n * _HLO_BYTES[dtype]
    return total

  calls = total = 0
  for line in hlo.splitlines():
    if f'custom_call_target="{TRITON_TARGET}"' not in line:
      continue
    results = line.split("=", 1)[1].split("custom-call(", 1)[0]
    # The operands' shapes, each with its layout in braces.
    operands = re.search(r"operand_layout_constraints=\{((?:[^{}]|\{[^{}]*\})*)\}", line)
    calls += 1
    total += size(results) + size(operands.group(1) if operands else "")
  return calls, total


def ptxas(dump: Path, prefix: str = "kldiv_jax_gpu_rows") -> list[dict[str, Any]]:
  """ptxas's report (``-v``, sm_90a) of the library's Triton kernels in an XLA dump's PTX
  (those whose entry's name starts with ``prefix``): name, threads, registers and spill
  bytes per kernel (``[]`` without ptxas: the CUDA wheels' ``nvidia-cuda-nvcc``)."""
  import importlib.util
  import re
  import shutil

  spec = importlib.util.find_spec("nvidia.cuda_nvcc")
  paths = list(spec.submodule_search_locations or []) if spec else []
  exe = next((p + "/bin/ptxas" for p in paths if Path(p, "bin", "ptxas").exists()), None)
  exe = exe or shutil.which("ptxas")
  out = []
  for ptx in sorted(dump.glob("*.ptx")) if exe else []:
    text = ptx.read_text()
    if f".entry {prefix}" not in text:
      continue
    threads = [int(t) for t in re.findall(r"\.reqntid (\d+)", text)]
    cubin = ptx.with_suffix(".cubin")
    run = subprocess.run([exe, "-arch=sm_90a", "-v", str(ptx), "-o", str(cubin)], **_TEXT)
    report = run.stderr.split("Compiling entry function")[1:]
    for i, part in enumerate(report):
      first = part.split("\n", 1)[0]
      if prefix not in first:
        continue
      spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", part)
      regs = re.search(r"Used (\d+) registers", part)
      out.append(
        {
          "kernel": next(iter(re.findall(prefix + r"\w*", first)), prefix),
          "threads": threads[i] if i < len(threads) else None,
          "registers": int(regs.group(1)) if regs else None,
          "spill_bytes": int(spill.group(1)) + int(spill.group(2)) if spill else None,
        }
      )
  return out


_TEXT = dict(capture_output=True, text=True, check=False)


def _measure_gpu(fn, structs, target: str, default: dict[str, Any]) -> dict[str, Any]:
  """:func:`_measure` of a program with the GPU kernels, its Triton calls' traffic added
  (``kernel_bytes``) and ptxas's report of them (``ptxas``); ``default``: the default
  program's record (the flops of the XLA passes the kernels replace)."""
  import tempfile

  with tempfile.TemporaryDirectory() as dump:
    start = time.perf_counter()
    compiled = _compile(fn, 0, structs, {"xla_dump_to": dump})
    cost = _cost(compiled, target)
    calls, extra = kernel_bytes(compiled.as_text())
    # The row kernels' and the gradient pass's (kldiv_jax._gpu_grad).
    report = ptxas(Path(dump)) + ptxas(Path(dump), "kldiv_jax_gpu_grad")
  flops = max(cost["flops"], default.get("flops", 0.0))
  cfg = TARGETS[target]
  seconds = max(flops / cfg["vector"], (cost["bytes"] + extra) / cfg["bw"])
  return cost | {
    "kernel_calls": calls,
    "kernel_bytes": extra,
    "bytes_with_kernels": cost["bytes"] + extra,
    "flops_with_kernels": flops,
    "seconds": seconds,
    "time_source": "roofline, the kernels' bytes added",
    "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
    "ptxas": report,
    "compile_s": time.perf_counter() - start,
  }


def with_gpu_kernels(fn: Callable, setting: bool | tuple[int, int, int, int] = True) -> Callable:
  """``fn`` traced with the opt-in GPU kernels switched on (the switch is read at trace time;
  ``setting``: ``True`` or a layout, ``(rows per program, tile, warps, stages)``)."""
  from kldiv_jax._platform import gpu_kernels

  def run(*args):
    with gpu_kernels(setting):
      return fn(*args)

  return run


# The fused cases that take the opt-in Pallas Triton kernels of the LM-head chunk
# (kldiv_jax._gpu_fused_head): on the CUDA target the program with them is compiled too, at
# N tokens, with each backward (``kldiv_jax_gpu``: two kernels that own their sums;
# ``kldiv_jax_gpu_atomic``: one kernel, dW by atomic adds): its temp, and XLA's counts, which
# leave out the Triton calls, i.e. every matmul (only the glue around them), with a model
# beside it: the kernels' N H V matmuls (five, or four with the atomic backward) at the
# chip's bf16 peak, the time they would take compute-bound (an ideal, not an estimate of
# Triton's code).
GPU_FUSED_CASES = ("fused_token_log_probs", "fused_token_log_probs" + LOGITS_F32, "fused_policy")
GPU_FUSED_CASES += ("fused_distillation", "fused_topk")
# contender: (kldiv_jax._gpu_fused_head.BACKWARD, N H V matmuls, its SKIP_BELOW: CCE's
# gradient filter, here at 2**-12, where the matmuls are a bound: skipped tiles skip two)
GPU_HEAD_BACKWARDS = {
  "kldiv_jax_gpu": ("owned", 5, None),
  "kldiv_jax_gpu_atomic": ("atomic", 4, None),
  "kldiv_jax_gpu_atomic_skip": ("atomic", 4, 2.0**-12),
}
# The distillation kernels (kldiv_jax._gpu_fused_distill) compute both sides' logits per pass
# (the teacher's head as wide as the student's here): forward KL (the case's divergence, a
# one-pass form) takes 2 matmuls forward, then 6 (owned) or 4 (atomic) backward; they have no
# gradient filter (SKIP_BELOW is the token kernels'): no "skip" contender. The top-k kernels
# (kldiv_jax._gpu_fused_topk, the tail's log-sum-exp: the student's head only; the logits at
# the ids are an N H k product in XLA) take 1 forward, then 4 (owned) or 3 (atomic), no filter.
GPU_HEAD_MATMULS = {
  "fused_distillation": {"owned": 8, "atomic": 6},
  "fused_topk": {"owned": 5, "atomic": 4},
}


# The module settings of kldiv_jax._gpu_fused_head a layout sets (read at trace time).
HEAD_SETTINGS = ("BLOCK_TOKENS", "BLOCK_VOCAB", "BLOCK_HIDDEN", "NUM_WARPS", "NUM_STAGES")


def head_config(text: str) -> tuple[int, int, int, int, int]:
  """``"64x128x64w4s3"`` as the fused-head kernels' layout ``(tokens per block, vocabulary
  tile, hidden step, warps, stages)``."""
  dims, rest = text.split("w")
  warps, stages = rest.split("s")
  bn, bv, bk = (int(d) for d in dims.split("x"))
  return bn, bv, bk, int(warps), int(stages)


def with_head_backward(
  fn: Callable, backward: str, config: tuple | None = None, skip: float | None = None
) -> Callable:
  """``fn`` traced with the fused-head kernels on (:func:`with_gpu_kernels`) and their
  ``backward`` (``"owned"`` or ``"atomic"``: ``kldiv_jax._gpu_fused_head.BACKWARD``),
  ``config`` (:func:`head_config`, of the token and the distillation kernels; ``None``: the
  modules' defaults) and gradient filter
  ``skip`` (``SKIP_BELOW``), read at trace time."""
  from kldiv_jax import _gpu_fused_distill as distill
  from kldiv_jax import _gpu_fused_head as head

  names = ("BACKWARD", "SKIP_BELOW", *HEAD_SETTINGS)

  def run(*args):
    saved = {k: getattr(head, k) for k in names}
    saved_distill = {k: getattr(distill, k) for k in HEAD_SETTINGS}
    head.BACKWARD, head.SKIP_BELOW = backward, skip
    for k, value in zip(HEAD_SETTINGS, config or ()):
      setattr(head, k, value)
      setattr(distill, k, value)  # the distillation kernels' layout (their own defaults)
    try:
      return with_gpu_kernels(fn)(*args)
    finally:
      for k, value in saved.items():
        setattr(head, k, value)
      for k, value in saved_distill.items():
        setattr(distill, k, value)

  return run


def _row_records(target: str, dev, shapes, cases) -> list[dict[str, Any]]:
  import jax.numpy as jnp

  records = []
  for (n, v), dtype in shapes:
    dt = jnp.dtype(dtype)
    for case in [c for c in cases if c in ROW_CASES]:
      for T in row_temperatures(case):
        fns, (kinds, floor_arrays) = _row_contenders(case, T or 1.0), ROW_ARGS[case]
        structs = _structs(kinds, {"n": n, "v": v, "dtype": dt}, dev)
        floor = floor_arrays * n * v * dt.itemsize
        row = {"case": case, "kind": "row", "shape": [n, v], "dtype": dtype, "temperature": T}
        row["floor_bytes"] = floor
        if TARGETS[target]["kind"] == "cuda" and case in GPU_KERNEL_CASES:
          fns["kldiv_jax_gpu"] = with_gpu_kernels(fns["kldiv_jax"])
        for name, fn in fns.items():
          if name == "kldiv_jax_gpu":
            measure = functools.partial(_measure_gpu, fn, structs, target, row["kldiv_jax"])
          else:
            measure = functools.partial(_measure, fn, 0, structs, target, matmul=False)
          row[name] = _or_error(measure)
        naive, ours = row["naive"], row["kldiv_jax"]
        if "seconds" in naive and "seconds" in ours:
          row["time_ratio"] = ours["seconds"] / naive["seconds"]
          row["naive_hbm_ratio"] = naive["bytes"] / floor
          row["hbm_ratio"] = ours["bytes"] / floor
          row["temp_ratio"] = ours["temp_bytes"] / (n * v * 4)
          gpu = row.get("kldiv_jax_gpu", {})
          if "seconds" in gpu:
            gpu["hbm_ratio"] = gpu["bytes_with_kernels"] / floor
            gpu["time_ratio"] = gpu["seconds"] / naive["seconds"]
            gpu["time_ratio_to_xla"] = gpu["seconds"] / ours["seconds"]
        records.append(row)
        _progress(target, row)
  return records


def _fused_records(target: str, dev, shape, cases, chunk: int | None) -> list[dict[str, Any]]:
  from kldiv_jax._fused_chunks import platform_chunk_size

  n, _, v = shape
  platform = "tpu" if TARGETS[target]["kind"] == "tpu" else "cuda"
  c = chunk or platform_chunk_size(n, v, platform)
  records = []
  for case in [x for x in cases if x in FUSED_CASES]:
    row = {"case": case, "kind": "fused", "shape": list(shape), "dtype": "bfloat16", "chunk": c}
    row["chunk_source"] = "given" if chunk else f"default for {platform}"
    records.append(_fused_row(row, target, dev, chunk))
    with_default(row, records)
    _progress(target, row)
  return records


def with_default(row: dict[str, Any], records: list[dict[str, Any]]) -> None:
  """A ``LOGITS_F32`` row: its time and temp over those of the default fused loss's row in
  ``records`` (same shape and chunk), as ``row["vs_default"]``."""
  base = row["case"].removesuffix(LOGITS_F32)
  for r in records:
    same = r["case"] == base and r["shape"] == row["shape"] and r["chunk"] == row["chunk"]
    if base != row["case"] and same and "time_ratio" in r and "time_ratio" in row:
      row["vs_default"] = {
        "time": row["fused"]["seconds"] / r["fused"]["seconds"],
        "temp": row["fused"]["temp_bytes"] / max(r["fused"]["temp_bytes"], 1),
      }


def _fused_row(row: dict[str, Any], target: str, dev, chunk: int | None) -> dict[str, Any]:
  import jax.numpy as jnp

  (n, h, v), c, dt = row["shape"], row["chunk"], jnp.dtype("bfloat16")
  materialised, fused = _fused_contenders(row["case"])
  kinds, head_reads = FUSED_ARGS[row["case"]]

  def measure(fn, tokens, options=None):
    structs = _structs(kinds, {"n": tokens, "v": v, "h": h, "dtype": dt}, dev)
    return _measure(fn, (0, 1), structs, target, True, options)

  def estimate():
    fn = fused(c)
    # The real program at N tokens, its chunk chosen by the library (looped): its temp.
    full = measure(fn if chunk else fused(None), n)
    with _unrolled_loops():
      one, two = measure(fn, c), measure(fn, 2 * c)
    if one["time_source"] != two["time_source"]:  # one source for both (XLA:TPU's
      # optimal_seconds is sometimes not positive): the roofline of each one's counts
      for x in (one, two):
        x["seconds"], x["time_source"] = _seconds({**x, "optimal_seconds": None}, target, True)
    est = {k: one[k] + (n / c - 1) * (two[k] - one[k]) for k in ("flops", "bytes", "seconds")}
    weight_bytes = h * v * (head_reads * dt.itemsize + 2 * 4)
    return est | {
      "time_source": one["time_source"],
      "temp_bytes": full["temp_bytes"],
      "chunk_intensity": (two["flops"] - one["flops"]) / max(two["bytes"] - one["bytes"], 1),
      "weight_intensity": (two["flops"] - one["flops"]) / weight_bytes,
      "one_chunk": one,
      "two_chunks": two,
    }

  mat = row["materialised"] = _or_error(lambda: measure(materialised, n))
  ours = row["fused"] = _or_error(estimate)
  for name, (backward, matmuls, skip) in GPU_HEAD_BACKWARDS.items():
    if TARGETS[target]["kind"] != "cuda" or row["case"] not in GPU_FUSED_CASES:
      break
    if row["case"] in GPU_HEAD_MATMULS:
      if skip is not None:
        continue
      matmuls = GPU_HEAD_MATMULS[row["case"]][backward]

    def gpu(backward=backward, matmuls=matmuls, skip=skip):
      import tempfile

      with tempfile.TemporaryDirectory() as dump:
        fn = with_head_backward(fused(chunk), backward, skip=skip)
        out = measure(fn, n, {"xla_dump_to": dump})
        report = ptxas(Path(dump), "kldiv_jax_gpu_head")
      flops = matmuls * 2 * n * h * v
      model = {"model_flops": flops, "model_seconds": flops / TARGETS[target]["peak"]}
      return out | model | {"matmuls": matmuls, "ptxas": report}

    gpu_row = row[name] = _or_error(gpu)
    if "model_seconds" in gpu_row and "seconds" in mat:
      gpu_row["model_ratio"] = gpu_row["model_seconds"] / mat["seconds"]
  if "seconds" in ours and mat.get("time_source") not in (None, ours["time_source"]):
    # the materialised loss's time from the same source as the fused one's
    mat["seconds"], mat["time_source"] = _seconds({**mat, "optimal_seconds": None}, target, True)
  if "seconds" in ours and "seconds" in mat:
    row["time_ratio"] = ours["seconds"] / mat["seconds"]
    row["temp_ratio"] = ours["temp_bytes"] / max(mat["temp_bytes"], 1)
  return row


def _progress(target: str, row: dict[str, Any]) -> None:
  print(f"  [{target}] {_line(row)}", file=sys.stderr, flush=True)


def worker(args: argparse.Namespace) -> int:
  import jax

  if TARGETS[args.worker]["kind"] == "tpu":
    jax.config.update("jax_platforms", "cpu")  # the compile-only TPU client needs no devices
  dev = _device(args.worker)
  cases = _cases(args)
  shapes = QUICK_ROW_SHAPES if args.quick else ROW_SHAPES
  fused_shape = QUICK_FUSED_SHAPE if args.quick else FUSED_SHAPE
  records = _row_records(args.worker, dev, shapes, cases)
  policy = [c for c in cases if c.startswith("fused_policy")]
  others = [c for c in cases if c not in policy]
  records += _fused_records(args.worker, dev, fused_shape, others, args.chunk)
  if policy:
    policy_shape = QUICK_POLICY_SHAPE if args.quick else POLICY_SHAPE
    records += _fused_records(args.worker, dev, policy_shape, policy, args.chunk)
  payload = {"target": args.worker, "device_kind": dev.device_kind, "jax": jax.__version__}
  Path(args.worker_out).write_text(json.dumps(payload | {"records": records}, indent=1) + "\n")
  return 0


# ----------------------------------------------------------------------------- the parent


def _cases(args: argparse.Namespace) -> list[str]:
  every = [*ROW_CASES, *FUSED_CASES]
  if not args.cases:
    return every
  chosen = [c.strip() for c in args.cases.split(",") if c.strip()]
  unknown = [c for c in chosen if c not in every]
  if unknown:
    raise SystemExit(f"bench_accel: unknown case(s) {unknown}; available: {every}")
  return chosen


def venv_python(kind: str, jax_version: str, root: Path = REPO) -> Path:
  """The interpreter of ``<root>/.venv-accel-<kind>`` (``root``: the repository), created with
  ``jax[<extra>]==jax_version`` on first use (or when the version changed)."""
  venv = root / f".venv-accel-{kind}"
  python = venv / "bin" / "python"
  stamp = venv / f".installed-jax-{jax_version}"
  if not stamp.exists():
    print(f"bench_accel: creating {venv} (jax[{VENV_EXTRA[kind]}]=={jax_version})", flush=True)
    if not python.exists():
      subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    spec = f"jax[{VENV_EXTRA[kind]}]=={jax_version}"
    subprocess.run([str(python), "-m", "pip", "install", "-q", spec, "numpy"], check=True)
    stamp.touch()
  return python


def _worker_env(target: str) -> dict[str, str]:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE), env.get("PYTHONPATH", "")])
  cfg = TARGETS[target]
  if cfg["kind"] == "tpu":
    env.update(TPU_ACCELERATOR_TYPE=cfg["accel"], TPU_WORKER_HOSTNAMES="localhost")
    env.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only: no chip to share
  else:
    env.update(JAX_PLATFORMS="cpu")
  env.setdefault("XLA_FLAGS", "")
  return env


def _temperature(row: dict[str, Any]) -> str:
  """``T=1`` or ``T=2`` (a row case with a temperature), else ``""``."""
  t = row.get("temperature")
  return "" if t is None else f"T={t:g}"


def _ptxas_text(report, prefix: str) -> str:
  """:func:`ptxas`'s report, a kernel a clause (its name without ``prefix``), or ``n/a``."""
  kernels = (
    f"{k.get('kernel', '?').removeprefix(prefix)}: {k['threads']} threads,"
    f" {k['registers']} registers, {k['spill_bytes']} B spilled"
    for k in report
  )
  return ", ".join(kernels) or "n/a"


def _line(row: dict[str, Any]) -> str:
  shape = "x".join(str(s) for s in row["shape"])
  what = f"{row['case']:30} {shape:>18} {row['dtype'][:4]:4} {_temperature(row):4}"
  if row["kind"] == "row":
    ours = row.get("kldiv_jax", {})
    if "time_ratio" not in row:
      return f"{what} error: {row.get('kldiv_jax', {}).get('error') or row.get('naive', {}).get('error')}"
    text = (
      f"{what} time {fmt_ratio(row['time_ratio']):>5}x naive  HBM {fmt_ratio(row['hbm_ratio']):>5}x"
      f" floor (naive {fmt_ratio(row['naive_hbm_ratio']):>5}x)  temp {fmt_bytes(ours['temp_bytes']):>7}"
      f" (naive {fmt_bytes(row['naive']['temp_bytes']):>7})  {ours['seconds'] * 1e3:8.3f} ms"
    )
    if "kldiv_jax_gpu" in row:
      gpu = row["kldiv_jax_gpu"]
      text += "\n    gpu kernels: " + (
        f"error {gpu['error']}"
        if "error" in gpu
        else f"{gpu['kernel_calls']} Triton call(s), HBM {fmt_ratio(gpu['hbm_ratio'])}x floor"
        f" (XLA's count {fmt_ratio(gpu['bytes'] / row['floor_bytes'])}x + the calls' operands"
        f" and results), time {fmt_ratio(gpu['time_ratio'])}x naive"
        f" ({fmt_ratio(gpu['time_ratio_to_xla'])}x XLA's), temp {fmt_bytes(gpu['temp_bytes'])},"
        f" {gpu['seconds'] * 1e3:.3f} ms; ptxas: {_ptxas_text(gpu['ptxas'], 'kldiv_jax_gpu_')}"
      )
    return text
  fused = row.get("fused", {})
  if "time_ratio" not in row:
    return f"{what} chunk {row['chunk']}: error: {fused.get('error') or row['materialised'].get('error')}"
  return _gpu_head_text(row) + (
    f"{what} chunk {row['chunk']:>5}  time {fmt_ratio(row['time_ratio']):>5}x materialised  "
    f"temp {fmt_bytes(fused['temp_bytes']):>7} (materialised "
    f"{fmt_bytes(row['materialised']['temp_bytes'])})  intensity {fused['chunk_intensity']:.0f}"
    f" (weights {fused.get('weight_intensity', 0):.0f})"
    f"  {fused['seconds'] * 1e3:8.2f} ms"
    + (
      f"  vs default: time {fmt_ratio(row['vs_default']['time'])}x,"
      f" temp {fmt_ratio(row['vs_default']['temp'])}x"
      if "vs_default" in row
      else ""
    )
  )


def _gpu_head_text(row: dict[str, Any]) -> str:
  """The opt-in fused-head kernels of a fused row (``GPU_FUSED_CASES``), on a line of their
  own above the row's: compiled, temp, and the compute-bound model against the materialised
  loss (XLA counts none of a Triton call's flops or bytes)."""
  text = ""
  for name, (backward, matmuls, skip) in GPU_HEAD_BACKWARDS.items():
    backward += "" if skip is None else f", skip < {skip:g}"
    gpu = row.get(name)
    if gpu is None:
      continue
    if "error" in gpu:
      text += f"gpu kernels ({backward} backward): error {gpu['error']}\n  "
      continue
    model = f"{gpu['model_ratio']:.2f}x" if "model_ratio" in gpu else "?"
    report = _ptxas_text(gpu.get("ptxas", ()), "kldiv_jax_gpu_head_")
    text += (
      f"gpu kernels ({row['case']}, {backward} backward): compiled in {gpu['compile_s']:.1f}s,"
      f" temp {fmt_bytes(gpu['temp_bytes'])}; XLA counts {gpu['flops'] / 1e9:.1f} GFLOP "
      f"{fmt_bytes(gpu['bytes'])} outside the Triton calls; model"
      f" ({gpu.get('matmuls', matmuls)} matmuls at peak)"
      f" {gpu['model_seconds'] * 1e3:.2f} ms = {model} materialised; ptxas: {report}\n  "
    )
  return text


def check_targets(target: str, records: list[dict[str, Any]], full_size: bool) -> list[dict]:
  """The issue's targets on one platform: PASS/FAIL rows (``value <= limit``)."""
  out = []
  for r in records:
    name = f"{r['case']} {'x'.join(map(str, r['shape']))} {r['dtype']} {_temperature(r)}".strip()
    if r["case"] in UNCHECKED or (r["case"].endswith(LOGITS_F32) and "time_ratio" in r):
      continue
    if r["kind"] == "row" and "time_ratio" in r:
      heavy = r["naive_hbm_ratio"] > HEAVY_NAIVE
      limit = ROW_TIME_TARGET_HEAVY if heavy else ROW_TIME_TARGET
      out.append(target_row(f"{name}: time / naive", limit, r["time_ratio"]))
      out.append(target_row(f"{name}: HBM / floor", ROW_HBM_TARGET, r["hbm_ratio"]))
      out.append(target_row(f"{name}: temp / [N, V] f32", ROW_TEMP_TARGET, r["temp_ratio"]))
    elif r["kind"] == "fused" and "time_ratio" in r:
      limit = POLICY_TIME_TARGET if r["case"] == "fused_policy" else FUSED_TIME_TARGET
      out.append(target_row(f"{name}: time / materialised", limit, r["time_ratio"]))
      if target in FUSED_TEMP_TARGET:
        limit = FUSED_TEMP_TARGET[target] / 2**30
        out.append(target_row(f"{name}: temp GiB", limit, r["fused"]["temp_bytes"] / 2**30))
      # The guard: a default chunk is weight-bandwidth-bound when its flops (XLA's count)
      # per byte of the weight traffic it must move (the heads' reads, the float32 weight
      # gradient's read and write) are below the chip's flops / bandwidth. The chunk's
      # intensity over all its bytes (the logits' passes too) is reported beside it.
      balance = TARGETS[target]["peak"] / TARGETS[target]["bw"]
      value = balance / r["fused"]["weight_intensity"]
      out.append(target_row(f"{name}: chip balance / chunk weight intensity", 1.0, value))
    elif "time_ratio" not in r:
      out.append({"target": f"{name}: compiled", "limit": None, "value": None, "pass": False})
    for gpu in [k for k in dict.fromkeys(("kldiv_jax_gpu", *GPU_HEAD_BACKWARDS)) if k in r]:
      # the opt-in GPU kernels compile for the chip (no estimate)
      ok = "error" not in r[gpu]
      what = "gpu kernels" + (f" ({gpu[14:].replace('_', ' ')} backward)" if gpu[14:] else "")
      out.append({"target": f"{name}: {what} compiled", "limit": None, "value": None})
      out[-1]["pass"] = ok
      if gpu == "kldiv_jax_gpu" and "hbm_ratio" in r[gpu]:
        # XLA's count with the Triton calls' operands and results added
        label = f"{name}: opt-in gpu kernels, HBM / floor (calls' bytes added)"
        row = target_row(label, ROW_HBM_TARGET, r[gpu]["hbm_ratio"])  # reported: not the default
        out.append(row | {"pass": None, "detail": "opt-in, reported, not a target"})
  for row in out:
    row["indicative"] = not full_size
  return out


def parser() -> argparse.ArgumentParser:
  p = _harness.parser(__doc__, quick="small sizes: a smoke test")
  p.add_argument(
    "--targets", default="v5e,v6e,h100", help=f"comma-separated (available: {','.join(TARGETS)})"
  )
  p.add_argument("--cases", default=None, help="comma-separated cases (default: all)")
  p.add_argument("--chunk", type=int, default=None, help="fused chunk (default: the library's)")
  p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
  return p


def main(argv: Sequence[str] | None = None) -> int:
  args = parser().parse_args(argv)
  if args.worker:
    return worker(args)
  targets = [t.strip() for t in args.targets.split(",") if t.strip()]
  unknown = [t for t in targets if t not in TARGETS]
  if unknown:
    parser().error(f"unknown target(s) {unknown}; available: {list(TARGETS)}")
  _cases(args)
  jax_version = importlib.metadata.version("jax")
  args.out.mkdir(parents=True, exist_ok=True)
  results: dict[str, Any] = {
    "section": "accel",
    "note": "XLA's compile-only estimates (deviceless), not measurements",
    "settings": {"quick": args.quick, "cases": args.cases, "chunk": args.chunk},
    "jax": jax_version,
    "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    "targets": {},
  }
  ok = True
  for target in targets:
    kind = TARGETS[target]["kind"]
    python = venv_python(kind, jax_version)
    part = args.out / f"accel-{target}.part.json"
    cmd = [str(python), str(Path(__file__).resolve()), "--worker", target]
    cmd += ["--worker-out", str(part)]
    cmd += ["--quick"] if args.quick else []
    cmd += ["--cases", args.cases] if args.cases else []
    cmd += ["--chunk", str(args.chunk)] if args.chunk else []
    print(f"\n=== {target} ({kind}, compile-only) ===", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=_worker_env(target))
    if proc.returncode != 0:
      print(f"bench_accel: the {target} worker failed (exit {proc.returncode})")
      ok = False
      continue
    payload = json.loads(part.read_text())
    part.unlink()
    payload["seconds"] = time.perf_counter() - start
    payload["checks"] = check_targets(target, payload["records"], not args.quick)
    results["targets"][target] = payload
    print(f"{target}: {payload['device_kind']}, jax {payload['jax']} (XLA estimates)")
    for row in payload["records"]:
      print("  " + _line(row))
    if target in CHECKED_TARGETS:
      print_targets(payload["checks"], args.quick)
  name = "accel-quick.json" if args.quick else "accel.json"
  (args.out / name).write_text(json.dumps(results, indent=1) + "\n")
  print(f"\nresults in {args.out / name}")
  return 0 if ok else 1


if __name__ == "__main__":
  raise SystemExit(main())
