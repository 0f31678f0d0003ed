"""Smoke tests of the benchmark suite (``benchmarks/run.py``) on tiny sizes."""

import argparse
import importlib
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"

RECORD_KEYS = {
  "elements",
  "shape",
  "dtype",
  "log_target",
  "reduction",
  "op",
  "contender",
  "kind",
  "median_ms",
  "times_ms",
  "ns_per_element",
  "repeats",
  "temp_bytes",
  "output_bytes",
  "ratio_vs_where",
  "ratio_vs_optax",
}


@pytest.fixture(scope="module")
def core_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench")
  cmd = [
    sys.executable,
    str(BENCH / "run.py"),
    "--quick",
    "--sections",
    "core",
    "--sizes",
    "10",
    "--repeats",
    "2",
    "--out",
    str(out),
    "--dtypes",
    "float32",
    "--reductions",
    "batchmean",
    "--log-target",
    "true",
    "--no-torch",  # torch's import alone takes seconds
  ]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return out, proc.stdout, json.loads((out / "core.json").read_text())


def test_core_json_has_expected_keys(core_run):
  out, _, result = core_run
  assert result["section"] == "core"
  machine = result["machine"]
  for key in ("cpu_model", "cpu_cores", "backend", "device_kind", "versions"):
    assert machine[key] not in (None, "")
  assert {"jax", "jaxlib", "optax"} <= set(machine["versions"])
  assert result["settings"]["sizes"] == [1024]
  assert (out / "core.png").stat().st_size > 0


def test_core_records_cover_every_op_and_contender(core_run):
  _, _, result = core_run
  records = result["records"]
  assert all(RECORD_KEYS <= set(r) for r in records)
  seen = {(r["log_target"], r["op"], r["contender"]) for r in records}
  for lt in (True,):
    for op in ("fwd", "vg_x", "vg_xt"):
      for name in ("kldiv_jax", "where_guarded", "optax"):
        assert (lt, op, name) in seen
    for name in ("limit_read2", "limit_read2_write1", "limit_transcendental"):
      assert (lt, "fwd", name) in seen
  for r in records:
    assert len(r["times_ms"]) == 2 and r["median_ms"] > 0
    if r["contender"] != "torch_cpu":
      assert r["temp_bytes"] is not None and r["output_bytes"] is not None
    if r["contender"] == "where_guarded":
      assert r["ratio_vs_where"] == pytest.approx(1.0)


def test_core_prints_table_and_targets(core_run):
  _, stdout, result = core_run
  assert "k/where" in stdout and "Targets at float32" in stdout
  rows = result["targets"]["rows"]
  assert result["targets"]["flagship"] is False
  assert {r["target"] for r in rows} >= {"fwd / where_guarded", "vg_x / optax"}
  assert all(r["pass"] in (True, False, None) for r in rows)


@pytest.mark.torch
def test_torch_contender_runs_every_op(torch):
  """The torch contender itself: live only (without torch the benchmark skips it)."""
  sys.path.insert(0, str(BENCH))
  try:
    import bench_core
  finally:
    sys.path.remove(str(BENCH))
  x, t, g = bench_core.make_data((4, 16), "bfloat16", False, seed=0)
  for reduction in ("batchmean", "none"):
    thunks = bench_core.torch_thunks(torch, x, t, g, "bfloat16", reduction, False)
    loss = thunks["fwd"]()
    assert loss.dtype == torch.bfloat16 and torch.isfinite(loss).all()
    _, grads = thunks["vg_xt"]()
    assert len(grads) == 2 and grads[0].shape == (4, 16)


def _record(lt, op, name, ms, temp=0):
  return {
    "dtype": "float32",
    "reduction": "batchmean",
    "kind": "contender",
    "shape": [4096, 8192],
    "elements": 2**25,
    "log_target": lt,
    "op": op,
    "contender": name,
    "median_ms": ms,
    "temp_bytes": temp,
  }


def test_targets_pass_and_fail_at_the_flagship():
  sys.path.insert(0, str(BENCH))
  try:
    import bench_core
  finally:
    sys.path.remove(str(BENCH))
  records = []
  for op in ("fwd", "vg_x", "vg_xt"):
    records += [
      _record(False, op, "kldiv_jax", 10.0, temp=8),
      _record(False, op, "where_guarded", 50.0, temp=16),
      _record(False, op, "optax", 9.5, temp=8),
      _record(False, op, "torch_cpu", 30.0),
    ]
  targets = bench_core.evaluate_targets(records)
  assert targets["flagship"] is True
  verdict = {r["target"]: r["pass"] for r in targets["rows"]}
  assert verdict["fwd / where_guarded"] is True  # 0.2 <= 0.4
  assert verdict["fwd / optax"] is True  # 1.05 <= 1.1
  assert verdict["torch fwd+bwd / vg_x (speed-up)"] is False  # 3x < 4x
  assert verdict["XLA temp bytes fwd / where_guarded"] is True
  assert bench_core.shape_for(2**25) == (4096, 8192)


def test_every_section_follows_the_protocol(monkeypatch):
  """Each section is ``main(argv) -> int``, and run.py's docstring names it."""
  monkeypatch.syspath_prepend(str(BENCH))
  import run

  for name in run.available_sections():
    main = importlib.import_module(f"bench_{name}").main
    assert list(inspect.signature(main).parameters) == ["argv"], name
    assert f"``{name}``" in run.__doc__, name
  assert run.section_argv(
    "llm", argparse.Namespace(out="x", quick=True, repeats=2, sizes="10"), ["--no-torch"]
  ) == ["--out", "x", "--quick", "--repeats", "2"]


def test_llm_section_runs_and_reports_its_targets(tmp_path):
  """The llm section at --quick sizes: every target is reported with a measured ratio."""
  sys.path.insert(0, str(BENCH))
  try:
    import bench_llm
  finally:
    sys.path.remove(str(BENCH))
  assert bench_llm.main(["--quick", "--repeats", "1", "--out", str(tmp_path)]) == 0
  result = json.loads((tmp_path / "llm.json").read_text())
  assert len(result["targets"]) == 7
  assert all(t["value"] is not None and t["value"] > 0 for t in result["targets"])
  assert result["settings"]["quick"] is True


def test_device_section_times_a_case_and_compares_values(monkeypatch, tmp_path):
  """bench_device (the accelerator cases run for real) on CPU at --quick sizes, one case at
  T = 1 and T = 2: both contenders timed, their temps and their values recorded, the values
  equal (and different between the temperatures: each ran at its own)."""
  monkeypatch.syspath_prepend(str(BENCH))
  import bench_device

  argv = ["--quick", "--cases", "jsd", "--repeats", "1", "--out", str(tmp_path)]
  assert bench_device.main(argv) == 0
  rows = json.loads((tmp_path / "device.json").read_text())["records"]
  assert [(r["case"], r["temperature"]) for r in rows] == [("jsd", 1.0), ("jsd", 2.0)]
  for row in rows:
    assert row["time_ratio"] > 0 and row["floor_tb_per_s"] > 0
    assert row["kldiv_jax"]["temp_bytes"] < row["naive"]["temp_bytes"]
    naive = row["naive"]["value"]
    assert abs(row["kldiv_jax"]["value"] - naive) <= 1e-5 * naive
  at_1, at_2 = (r["naive"]["value"] for r in rows)
  assert abs(at_1 - at_2) > 1e-3 * at_2


def test_accel_fused_temp_is_the_looped_program(monkeypatch):
  """bench_accel unrolls the fused losses' loops to count flops and bytes (XLA counts a loop
  body once), then reads the temp of the program users run: looped. The library's kernels
  are jitted, their traces cached by shapes, and at N = 2 chunks the unrolled trace was
  reused (H100, N = 8192, V = 65536: 4.06 GiB of temp reported for the fused distillation,
  2.31 GiB in the looped program). Outside ``_unrolled_loops`` the chunk loop is back."""
  monkeypatch.syspath_prepend(str(BENCH))
  import bench_accel
  import jax
  import jax.numpy as jnp

  import kldiv_jax as kd

  c, h, v = 8, 4, 16
  h2, w = jnp.ones((2 * c, h)), jnp.ones((h, v))
  y = jnp.zeros((2 * c,), jnp.int32)

  def jaxpr(hidden, labels):
    def loss(hidden, w):
      return jnp.sum(kd.fused_token_log_probs(hidden, w, labels, chunk_size=c))

    return str(jax.make_jaxpr(jax.value_and_grad(loss, (0, 1)))(hidden, w))

  # Two chunks: the chunk loops (forward and backward) are scans of length 2, unrolled
  # (unroll=2) inside the context and looped (unroll=1) outside it.
  with bench_accel._unrolled_loops():
    assert "unroll=2" in jaxpr(h2, y)
  looped = jaxpr(h2, y)
  assert "length=2" in looped and "unroll=2" not in looped


def test_accel_section_parses_and_is_opt_in(monkeypatch):
  """bench_accel's CLI parses without its environments, run.py runs it only when named, and
  its checks flag a weight-bandwidth-bound fused chunk and a row kernel above the floor."""
  monkeypatch.syspath_prepend(str(BENCH))
  import bench_accel
  import run

  args = bench_accel.parser().parse_args(["--quick", "--targets", "v5e", "--cases", "kl_div"])
  assert args.quick and args.targets == "v5e" and bench_accel._cases(args) == ["kl_div"]
  assert "accel" in run.available_sections()
  assert run.OPT_IN == ("accel", "device", "tunix", "uld")
  row = {"case": "tvd", "kind": "row", "shape": [8, 4], "dtype": "float32"}
  row |= {"time_ratio": 0.9, "naive_hbm_ratio": 4.0, "hbm_ratio": 2.0, "temp_ratio": 0.0}
  fused = {"case": "fused_topk", "kind": "fused", "shape": [8, 2, 4], "dtype": "bfloat16"}
  fused |= {"time_ratio": 1.0, "fused": {"temp_bytes": 0, "weight_intensity": 100.0}}
  verdict = {
    c["target"].split(": ")[1]: c["pass"]
    for c in bench_accel.check_targets("v5e", [row, fused], True)
  }
  assert verdict == {
    "time / naive": False,  # naive moves 4x the floor: at most 0.8x
    "HBM / floor": False,
    "temp / [N, V] f32": True,
    "time / materialised": True,
    "temp GiB": True,
    "chip balance / chunk weight intensity": False,  # 197e12 / 819e9 = 240 flops per byte > 100
  }


def test_accel_counts_the_triton_calls_bytes(monkeypatch):
  """XLA's cost analysis counts no bytes of a Triton custom call: bench_accel adds each call's
  results and operands (their shapes in the optimized module's text, layouts in braces), once
  each, and no other custom call's; the opt-in kernels' HBM ratio is reported beside the
  targets (not one of them: the default path is)."""
  monkeypatch.syspath_prepend(str(BENCH))
  import bench_accel

  hlo = "\n".join(
    [
      "  %p = f32[4096,8192]{1,0} parameter(0)",
      "  %c = (f32[1,4096]{1,0}, bf16[1,4096]{1,0}) custom-call(%a, %b, %d),"
      ' custom_call_target="__gpu$xla.gpu.triton", operand_layout_constraints={f32[1]{0},'
      " f32[4096,8192]{1,0}, bf16[4096,8192]{1,0}}, api_version=API_VERSION_TYPED_FFI",
      '  %o = f32[8]{0} custom-call(%p), custom_call_target="other",'
      " operand_layout_constraints={f32[4096,8192]{1,0}}",
    ]
  )
  want = 4096 * 4 + 4096 * 2 + 4 + 4096 * 8192 * (4 + 2)
  assert bench_accel.kernel_bytes(hlo) == (1, want)
  row = {"case": "jsd", "kind": "row", "shape": [8, 4], "dtype": "float32"}
  row |= {"time_ratio": 0.5, "naive_hbm_ratio": 4.0, "hbm_ratio": 2.3, "temp_ratio": 0.0}
  row["kldiv_jax_gpu"] = {"hbm_ratio": 5 / 3}
  checks = {
    c["target"].split(": ", 1)[1]: c["pass"] for c in bench_accel.check_targets("h100", [row], True)
  }
  assert checks["HBM / floor"] is False and checks["gpu kernels compiled"] is True
  assert checks["opt-in gpu kernels, HBM / floor (calls' bytes added)"] is None  # reported
  (reported,) = [
    c for c in bench_accel.check_targets("h100", [row], True) if "opt-in" in c["target"]
  ]
  assert reported["value"] == 5 / 3


def test_accel_logits_f32_cases_report_their_cost_and_are_not_targets(monkeypatch):
  """bench_accel's ``+logits_f32`` cases (the fused losses with ``logits_dtype=float32``):
  one per fused loss, their time and temp over the default fused loss's row of the same
  shape and chunk, and not among the targets (their compile is)."""
  monkeypatch.syspath_prepend(str(BENCH))
  import bench_accel

  base = [c for c in bench_accel.FUSED_CASES if not c.endswith(bench_accel.LOGITS_F32)]
  assert {c + bench_accel.LOGITS_F32 for c in base} <= set(bench_accel.FUSED_CASES)
  row = lambda case, seconds, temp: {  # noqa: E731
    "case": case, "kind": "fused", "shape": [8, 2, 4], "dtype": "bfloat16", "chunk": 4,
    "time_ratio": 1.0, "fused": {"seconds": seconds, "temp_bytes": temp, "weight_intensity": 1.0},
  }  # fmt: skip
  default, option = row("fused_topk", 2.0, 100), row("fused_topk+logits_f32", 3.0, 150)
  bench_accel.with_default(option, [default])
  assert option["vs_default"] == {"time": 1.5, "temp": 1.5}
  assert bench_accel.check_targets("v5e", [option], True) == []
  failed = {k: v for k, v in option.items() if k != "time_ratio"}
  assert [c["target"] for c in bench_accel.check_targets("v5e", [failed], True)] == [
    "fused_topk+logits_f32 8x2x4 bfloat16: compiled"
  ]


def test_accel_fused_head_kernels_are_reported_and_their_compile_checked(monkeypatch):
  """bench_accel's rows of the fused token log-probs on the CUDA target carry the opt-in
  fused-head kernels, one entry per backward: each one's compile is a check (no estimate: XLA
  counts no flops of a Triton call), and the report prints their temp and the model's ratio."""
  monkeypatch.syspath_prepend(str(BENCH))
  import bench_accel

  assert set(bench_accel.GPU_HEAD_BACKWARDS) == {
    "kldiv_jax_gpu", "kldiv_jax_gpu_atomic", "kldiv_jax_gpu_atomic_skip"
  }  # fmt: skip
  gpu = {"compile_s": 1.0, "temp_bytes": 2**30, "flops": 1e9, "bytes": 2e9}
  gpu |= {"model_seconds": 0.04, "model_ratio": 1.5}
  row = {"case": "fused_token_log_probs", "kind": "fused", "shape": [8, 2, 4], "chunk": 4}
  row |= {"dtype": "bfloat16", "time_ratio": 1.0, "materialised": {"temp_bytes": 1}}
  row |= {"fused": {"seconds": 1.0, "temp_bytes": 1, "weight_intensity": 1e9}}
  row |= {"chunk_intensity": 1.0, "kldiv_jax_gpu": gpu, "kldiv_jax_gpu_atomic": {"error": "x"}}
  row["fused"]["chunk_intensity"] = 1.0
  checks = {c["target"]: c["pass"] for c in bench_accel.check_targets("h100", [row], True)}
  name = "fused_token_log_probs 8x2x4 bfloat16"
  assert checks[f"{name}: gpu kernels compiled"] is True
  assert checks[f"{name}: gpu kernels (atomic backward) compiled"] is False
  text = bench_accel._line(row)
  assert "owned backward): compiled in 1.0s, temp" in text and "= 1.50x materialised" in text
  assert "gpu kernels (atomic backward): error x" in text


def test_uld_section_reports_time_temp_and_its_target(monkeypatch, tmp_path):
  """bench_uld on CPU at --quick sizes: every contender timed (value and value_and_grad, as
  ratios to jnp.sort's), its temp measured, and the temp target checked."""
  monkeypatch.syspath_prepend(str(BENCH))
  import bench_uld

  assert bench_uld.main(["--quick", "--repeats", "1", "--out", str(tmp_path)]) == 0
  result = json.loads((tmp_path / "uld.json").read_text())
  names = ["jnp.sort", "uld_loss", "topk k=64", "topk k=1024", "kl (same vocab)"]
  for op in ("value", "value_and_grad"):
    assert list(result["time"][op]) == names
    assert result["time"][op]["jnp.sort"]["ratio"] == pytest.approx(1.0)
    assert all(result["memory"][n][op]["temp_bytes"] is not None for n in names)
  (target,) = result["targets"]
  assert target["value"] is not None and target["pass"] is True


def test_uld_fused_section_reports_time_and_temp(monkeypatch, tmp_path):
  """bench_uld --fused at --quick sizes: the fused form and the materialised one timed
  (value_and_grad, after their values and gradients are checked to agree), as ratios to the
  materialised, with their temps."""
  monkeypatch.syspath_prepend(str(BENCH))
  import bench_uld

  argv = ["--fused", "--quick", "--repeats", "1", "--out", str(tmp_path)]
  assert bench_uld.main(argv) == 0
  result = json.loads((tmp_path / "uld-fused.json").read_text())
  assert list(result["cpu"]) == ["materialised", "fused"]
  assert result["cpu"]["materialised"]["ratio"] == pytest.approx(1.0)
  assert all(r["temp_bytes"] is not None for r in result["cpu"].values())


class _FakeCompiled:
  """A compiled step whose memory_analysis() reports ``peak`` bytes (XLA's peak)."""

  def __init__(self, peak):
    self.peak = peak

  def memory_analysis(self):
    return argparse.Namespace(
      argument_size_in_bytes=1, output_size_in_bytes=1, alias_size_in_bytes=0,
      temp_size_in_bytes=self.peak - 2, generated_code_size_in_bytes=0,
      peak_memory_in_bytes=self.peak,
    )  # fmt: skip


@pytest.mark.parametrize(
  ("base_gib", "per_batch_gib", "fail_above", "expected"),
  [
    (2.0, 1.0, None, 14),  # linear: (16 - 2) / 1 = 14
    (2.0, 0.3, None, 46),  # linear: (16 - 2) / 0.3 = 46.7
    (2.0, 1.0, 9, 9),  # XLA cannot fit above 9 (a compile error), whatever the line says
    (17.0, 1.0, None, 0),  # not even one sequence
  ],
)
def test_tunix_max_batch_search(monkeypatch, base_gib, per_batch_gib, fail_above, expected):
  """bench_tunix's largest micro-batch on a 16 GiB v5e: a compile error or a peak above the
  chip's memory is "does not fit"; the answer is the closed form of a linear peak (or the
  compile limit), found in a handful of compiles."""
  monkeypatch.syspath_prepend(str(BENCH))
  import bench_tunix

  compiles = []

  class Setup:
    target, name = "v5e", "fake"

    def measure(self, step, variant, batch, seq):
      compiles.append(batch)
      if fail_above is not None and batch > fail_above:
        raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm")
      compiled = _FakeCompiled(int((base_gib + per_batch_gib * batch) * 2**30))
      return bench_tunix.memory(compiled) | {"flops": 1e12 * batch, "bytes": 1e9 * batch}

  found = bench_tunix.max_batch(Setup(), "grpo", "stock", 4096, {})
  assert found["max_batch"] == expected
  assert len(compiles) == len(set(compiles)) <= 8
  assert sorted(int(b) for b in found["probes"]) == sorted(compiles)


@pytest.mark.parametrize(
  ("tokens", "chunk", "body_and_tail"), [(3840, 1024, 1 + 0.75), (4096, 1024, 1)]
)
def test_tunix_chunk_loop_counted_once_per_chunk(monkeypatch, tokens, chunk, body_and_tail):
  """bench_tunix's fused step counted in full: XLA counts the loop's body (one full chunk) and
  the uneven last chunk once each; the estimate adds the other full chunks, so the loss's
  flops are those of ``tokens`` (``tokens / chunk`` chunks' worth), not one chunk more."""
  monkeypatch.syspath_prepend(str(BENCH))
  import bench_tunix

  per_chunk, rest = 1e12, 5e12  # the loss's flops per full chunk; the rest of the step's
  looped = {"flops": rest + body_and_tail * per_chunk, "bytes": 1.0}
  info = {"chunk": chunk, "chunks": -(-tokens // chunk), "full_chunks": tokens // chunk}
  out = bench_tunix.unrolled(looped, info | {"flops": per_chunk, "bytes": 0.0}, "v5e")
  assert out["flops_unrolled"] == pytest.approx(rest + tokens / chunk * per_chunk)
  assert out["seconds"] == pytest.approx(out["flops_unrolled"] / bench_tunix.TARGETS["v5e"]["peak"])


def test_tunix_section_parses_and_tabulates(monkeypatch):
  """bench_tunix's CLI parses without its environments and its table shows a step that XLA
  could not fit as OOM, the peak saved over the float32 logits and the largest micro-batches."""
  monkeypatch.syspath_prepend(str(BENCH))
  import bench_tunix

  args = bench_tunix.parser().parse_args(["--targets", "v5e", "--no-max-batch", "--seq", "4096"])
  assert not args.max_batch and args.seq == "4096" and args.batch == 8
  assert args.variants == "kldiv_jax,stock"
  case = {"target": "v5e", "model": "qwen3_0p6b", "step": "grpo", "seq": 4096, "layers": 2}
  step = case | {"kind": "step", "batch": 8, "saved_over_logits": 1.25, "time_ratio": 0.9}
  step["stock"] = {"error": "XlaRuntimeError: RESOURCE_EXHAUSTED: Ran out of memory in hbm"}
  step["kldiv_jax"] = {"peak_bytes": 3 * 2**30, "xla_peak_bytes": 12 * 2**30, "seconds": 0.5}
  largest = [case | {"kind": "max_batch", "variant": v, "max_batch": b} for v, b in
             (("stock", 3), ("kldiv_jax", 11))]  # fmt: skip
  table = bench_tunix.table([step, *largest]).splitlines()
  assert len(table) == 3
  cells = [c.strip() for c in table[2].strip("|").split("|")]
  assert cells[5:9] == ["OOM", "12.0", "1.25", "—"]
  assert cells[-3:] == ["0.900", "3", "11"]
  # Without a time at B = 8 (stock did not compile): the ratio at the largest micro-batch of
  # the searches where both compiled.
  del step["time_ratio"]
  largest[0]["probes"] = {"1": {"seconds": 2.0}, "2": {"seconds": 4.0}, "4": {"error": "OOM"}}
  largest[1]["probes"] = {"1": {"seconds": 1.0}, "2": {"seconds": 3.0}, "8": {"seconds": 9.0}}
  cells = [c.strip() for c in bench_tunix.table([step, *largest]).splitlines()[2].split("|")]
  assert cells[-4] == "0.750 (B=2)"
