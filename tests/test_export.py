"""``jax.export``: every public loss lowers for CPU, CUDA and TPU, each with its own code path.

The per-row statistics of the logit kernels run over blocks of rows on CPU and
in one piece elsewhere (``kldiv_jax._platform.map_rows``). The choice is staged
out with ``lax.platform_dependent`` and made when the program is lowered, so
a module exported (or compiled ahead of time) on a CPU machine for a GPU or a
TPU holds the GPU/TPU path, and one exported for several platforms holds both.

For each public loss, ``jax.jit`` of the loss and of its ``value_and_grad``,
unsharded and with ``axis_name`` (inside ``jax.shard_map``; the ``multidevice``
test, on 4 of 8 simulated devices), this file exports a module for each of
``cpu``, ``cuda`` and ``tpu`` and checks that the CPU module holds the row
loop (its name scope :data:`kldiv_jax._platform.ROW_BLOCKS_SCOPE` and a
``stablehlo.while``) exactly for the losses built on the row kernels, and
that the CUDA and TPU modules never do. A module exported for all three is
serialized, deserialized and run on CPU (the ``value_and_grad`` program, whose
outputs hold the value too): it gives the jitted program's numbers, bit for bit.

The inputs have more rows than one CPU block holds, so that the CPU path is a
loop: the check on the CPU module is what shows that the others can fail.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _public_calls import PUBLIC_CALLS, PublicCall, inputs, missing_calls
from _references import DEFAULT_CODEGEN, TOLERANCES, enable_x64, platform_branch
from jax import export
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import kldiv_jax as kd
from kldiv_jax import _platform
from kldiv_jax._fused_chunks import FUSED_CHUNK_SCOPE, FUSED_GRAD_W_SCOPE, platform_chunk_size
from kldiv_jax._platform import ROW_BLOCKS_SCOPE

PLATFORMS = ("cpu", "cuda", "tpu")
# 512 rows of 1024 classes: four CPU blocks (128 rows each); two chunks of 256
# tokens in the fused losses (each chunk two blocks).
ROWS, VOCAB, HIDDEN, K = 512, 1024, 16, 8
CHUNK = 256


class Loss:
  """``fn(*args)`` of the named inputs; ``rows``: whether it is built on the row kernels."""

  def __init__(self, fn, names, argnums, rows):
    self.fn, self.names, self.argnums, self.rows = fn, names, argnums, rows


def _data(rows: int = ROWS) -> dict[str, np.ndarray]:
  return inputs(rows, VOCAB, HIDDEN, K, seed=0, scale=2.0)


def _chunk(call: PublicCall) -> dict:
  return {"chunk_size": CHUNK} if call.chunked else {}


# Variants beside the public calls: the fused loss without labels at T = 2 (no hard term),
# and the log-probabilities without the entropy (a kernel without a row loop, nor axis_name).
VARIANTS = {
  "fused_distillation_loss T=2": dataclasses.replace(
    PUBLIC_CALLS["fused_distillation_loss"],
    inputs=PUBLIC_CALLS["fused_distillation_loss"].inputs[:4],
    options={"temperature": 2.0},
  ),
  "token_log_probs alone": dataclasses.replace(
    PUBLIC_CALLS["token_log_probs"], options={}, rows=False, axis_name=False, output=lambda out: out
  ),
}
CALLS = {**PUBLIC_CALLS, **VARIANTS}


def _losses() -> dict[str, Loss]:
  return {
    name: Loss(call.positional(**_chunk(call)), call.roles, call.argnums, call.rows)
    for name, call in CALLS.items()
  }


DATA = _data()
LOSSES = _losses()


def test_every_public_call_is_listed():
  """Each callable of ``kldiv_jax.__all__`` has its entry in ``_public_calls.PUBLIC_CALLS``,
  so that every suite built on that list runs it."""
  assert missing_calls() == set()


def _programs(loss: Loss):
  """``{"jit": ..., "value_and_grad": ...}``: the jitted loss and its value and gradients."""
  total = lambda *a: jnp.sum(loss.fn(*a))  # noqa: E731
  return {
    "jit": jax.jit(loss.fn),
    "value_and_grad": jax.jit(jax.value_and_grad(total, argnums=loss.argnums)),
  }


# The program whose artefact is serialized and run: its outputs hold the loss's value too
# (compiling each program twice more for ``jit`` alone would double the file's time).
ROUND_TRIP = "value_and_grad"


def _holds_row_loop(text: str) -> bool:
  return ROW_BLOCKS_SCOPE in text


def _check_paths(name, mode, exported_by_platform, rows):
  for platform, exported in exported_by_platform.items():
    text = exported.mlir_module()
    if platform == "cpu" and rows:
      assert _holds_row_loop(text) and "stablehlo.while" in text, (
        f"{name} ({mode}): the CPU module lacks the CPU row loop"
      )
    else:
      assert not _holds_row_loop(text), (
        f"{name} ({mode}): the {platform} module holds the CPU row loop"
      )


def _round_trip(program, args, mesh=None):
  """``program`` exported for every platform, serialized, deserialized, run on CPU."""
  exported = export.export(program, platforms=PLATFORMS)(*args)
  assert exported.platforms == PLATFORMS
  restored = export.deserialize(exported.serialize())
  assert restored.platforms == PLATFORMS
  # Both compiled as XLA compiles by default (DEFAULT_CODEGEN), as a user's are: under the
  # suite's faster flags (no LLVM optimisation with XLA:CPU's former loop emitters, together)
  # the two modules' fusions, the same ops with a constant folded in one and not the other,
  # emit a transcendental 1 ulp apart (the top-k tail's log1p: 25 of the 8192 gradient
  # entries of fused_topk_distillation_loss); by default they are the same program, bit for bit.
  got = jax.jit(restored.call).lower(*args).compile(DEFAULT_CODEGEN)(*args)
  want = program.lower(*args).compile(DEFAULT_CODEGEN)(*args)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  # Both paths are in the module for all platforms: the runtime picks.
  return exported


@pytest.mark.filterwarnings("ignore:The function convex_kl_divergence is deprecated")
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_each_platform_holds_its_own_path(name):
  loss = LOSSES[name]
  args = tuple(DATA[n] for n in loss.names)
  for mode, program in _programs(loss).items():
    per_platform = {p: export.export(program, platforms=(p,))(*args) for p in PLATFORMS}
    _check_paths(name, mode, per_platform, loss.rows)
    if mode == ROUND_TRIP:
      both = _round_trip(program, args)
      # The module for all platforms holds the CPU row loop where the CPU one does (another
      # platform's branch may hold one too, never taken: token_log_probs alone nests the
      # row statistics' own platform switch inside its accelerator branch).
      assert _holds_row_loop(both.mlir_module()) or not loss.rows


# -- axis_name ------------------------------------------------------------------------------------

# The losses that take ``axis_name``, and their inputs' specs over the "vocab" axis: logits
# split over their classes, LM heads and biases over their vocabulary, the rest replicated.
CLASSES, HEAD, ROWWISE = P(None, "vocab"), P(None, "vocab"), P()
ROLE_SPECS = {"s": CLASSES, "t": CLASSES, "w": HEAD, "tw": HEAD, "b": P("vocab"), "tb": P("vocab")}
SHARDED = {
  name: tuple(ROLE_SPECS.get(r, ROWWISE) for r in call.roles)
  for name, call in CALLS.items()
  if call.axis_name
}


@pytest.mark.multidevice
@pytest.mark.parametrize("name", sorted(SHARDED))
def test_each_platform_holds_its_own_path_with_axis_name(cpu_devices, name):
  """The same, inside ``jax.shard_map`` with the classes over 4 devices."""
  mesh = jax.sharding.Mesh(np.array(cpu_devices[:4]), ("vocab",))
  specs, call = SHARDED[name], CALLS[name]
  base = LOSSES[name]
  local = call.positional(axis_name="vocab", **_chunk(call))
  fn = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P())
  loss = Loss(fn, base.names, base.argnums, base.rows)
  args = tuple(jax.device_put(DATA[n], NamedSharding(mesh, s)) for n, s in zip(base.names, specs))
  for mode, program in _programs(loss).items():
    per_platform = {p: export.export(program, platforms=(p,))(*args) for p in PLATFORMS}
    _check_paths(name, mode, per_platform, loss.rows)
    assert all(e.nr_devices == 4 for e in per_platform.values())
    if mode == ROUND_TRIP and not OLD_MULTI_PLATFORM_SHARD_MAP:
      _round_trip(program, args)


# jax 0.7: lowering ``jax.shard_map`` for several platforms at once fails in
# MLIR's verifier ("'func.call' op using value defined outside the region")
# when the body holds a ``lax.platform_dependent``; one platform at a time
# works, as does the unsharded program. Fixed in later jax (0.10 passes).
OLD_MULTI_PLATFORM_SHARD_MAP = jax.__version_info__ < (0, 8)


# -- the fused losses' default chunk --------------------------------------------------------------

# A vocabulary large enough that the CPU default (2**22 logits: 16 tokens) and the accelerator
# default (2**27 logits, at least 1024 and at most 4096 tokens: all 256 here) differ; lowered,
# never run.
FUSED_TOKENS, FUSED_VOCAB, FUSED_HIDDEN = 256, 1 << 18, 8
FUSED_DEFAULTS = {
  "fused_distillation_loss": (
    lambda h, w, th, tw: kd.fused_distillation_loss(h, w, th, tw),
    "hwhw",
  ),
  "fused_topk_distillation_loss": (
    lambda h, w, i, lp: kd.fused_topk_distillation_loss(h, w, i, lp),
    "hwil",
  ),
  "fused_token_log_probs": (lambda h, w, y: jnp.sum(kd.fused_token_log_probs(h, w, y)), "hwy"),
}


def _fused_chunks(text: str) -> set[int]:
  return {int(c) for c in re.findall(FUSED_CHUNK_SCOPE + r"(\d+)", text)}


def _fused_grad_w(text: str) -> set[str]:
  return set(re.findall(FUSED_GRAD_W_SCOPE + r"([0-9a-z]+)", text))


def test_fused_default_chunk_per_platform_at_a_large_vocabulary():
  """N = 16384, V = 2**17 (bench-accel's size): 2**22 logits per chunk on CPU, 2**28 on GPUs
  (their fusions pass the chunk's logits through HBM: more tokens amortise the heads), 2**27
  on TPU (a 16 GiB v5e; at least 1024 tokens)."""
  chunks = [platform_chunk_size(16384, 1 << 17, p) for p in ("cpu", "cuda", "rocm", "tpu")]
  assert chunks == [32, 2048, 2048, 1024]


@pytest.mark.parametrize(
  "vocab, tpu, gpu",
  [
    (32768, 4096, 4096),  # 2**27 / V tokens on TPU, at most 4096
    (151936, 1024, 2048),  # Qwen 3: 2**27 / V is 883 (512 as a power of two); the floors
    (262144, 1024, 2048),  # Gemma 3: 512 by 2**27 / V; the floors (2**28, 2**29 logits)
    (1 << 19, 512, 512),  # past 262144 the floor gives way to 2**28 logits
    (1 << 20, 256, 256),
  ],
)
def test_fused_default_chunk_has_a_floor_of_tokens(vocab, tpu, gpu):
  """The tokens per chunk amortise the heads' bytes (~14 per head element for 8 C H V flops,
  whatever V): on TPU at least 1024 tokens while that is at most 2**28 logits; on GPUs 2**28
  logits and at least 2048 tokens while V <= 262144."""
  assert platform_chunk_size(16384, vocab, "tpu") == tpu
  assert platform_chunk_size(16384, vocab, "cuda") == gpu
  assert platform_chunk_size(16384, vocab, "rocm") == gpu
  assert platform_chunk_size(300, vocab, "tpu") == min(tpu, 300)  # within [1, num_tokens]
  assert platform_chunk_size(300, vocab, "cuda") == min(gpu, 300)


@pytest.mark.parametrize("name", sorted(FUSED_DEFAULTS))
def test_fused_default_chunk_is_chosen_per_platform(name):
  """``chunk_size=None``: the CPU module chunks 16 tokens at a time, the CUDA and TPU modules
  the accelerator default (every token here), and a module for all three holds both; the
  weight gradient is updated in blocks of 4096 columns on CPU, whole elsewhere (the token
  log-probs' backward, with fewer tokens than columns, over chunks of the columns there)."""
  fn, kinds = FUSED_DEFAULTS[name]
  n, v, h = FUSED_TOKENS, FUSED_VOCAB, FUSED_HIDDEN
  shapes = {"h": ((n, h), jnp.float32), "w": ((h, v), jnp.float32), "y": ((n,), jnp.int32)}
  shapes |= {"i": ((n, K), jnp.int32), "l": ((n, K), jnp.float32)}
  args = [jax.ShapeDtypeStruct(*shapes[k]) for k in kinds]
  program = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
  cpu, accel = platform_chunk_size(n, v, "cpu"), platform_chunk_size(n, v, "tpu")
  assert (cpu, accel) == (16, 256)
  blocked, whole = {"4096"}, {"columns" if name == "fused_token_log_probs" else "whole"}
  for platforms, want, grad_w in [
    (("cpu",), {cpu}, blocked),
    (("cuda",), {accel}, whole),
    (("tpu",), {accel}, whole),
  ]:
    text = export.export(program, platforms=platforms)(*args).mlir_module()
    assert _fused_chunks(text) == want, platforms
    assert _fused_grad_w(text) == grad_w, platforms
  text = export.export(program, platforms=PLATFORMS)(*args).mlir_module()
  assert _fused_chunks(text) == {cpu, accel}
  # The token log-probs' CPU branch holds the token chunks' own choice of both, too.
  both = blocked | whole | ({"whole"} if name == "fused_token_log_probs" else set())
  assert _fused_grad_w(text) == both


def test_fused_default_chunk_on_tpu_at_qwen3_vocabulary_is_lowered():
  """At Qwen 3's V = 151936 and 4096 tokens the TPU module chunks 1024 tokens at a time
  (2**27 logits alone would give 512), the CUDA module 2048 (2**28 logits alone: 1024)."""
  n, v, h = 4096, 151936, 8
  args = [jax.ShapeDtypeStruct((n, h), jnp.bfloat16), jax.ShapeDtypeStruct((h, v), jnp.bfloat16)]
  args.append(jax.ShapeDtypeStruct((n,), jnp.int32))
  fn = lambda h, w, y: jnp.sum(kd.fused_token_log_probs(h, w, y))  # noqa: E731
  program = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
  for platforms, want in ((("tpu",), 1024), (("cuda",), 2048)):
    text = export.export(program, platforms=platforms)(*args).mlir_module()
    assert _fused_chunks(text) == {want}, platforms


# -- jax_enable_x64 -------------------------------------------------------------------------------

# Row counts: one row, a few, many, and one more than a CPU block of VOCAB classes (the CPU
# path loops over two blocks, the last one shifted back). The fused losses' chunk (CHUNK rows)
# holds all of them, so they go through the same paths.
X64_ROWS = (1, 7, 123, _platform._BLOCK_ELEMENTS // VOCAB + 1)
X64_DATA = {rows: _data(rows) for rows in X64_ROWS}
# The fused losses are ``custom_vjp`` functions: reverse mode only.
REVERSE_ONLY = {name for name, call in CALLS.items() if call.reverse_only}


def _argnums(name):
  argnums = LOSSES[name].argnums
  return argnums if isinstance(argnums, tuple) else (argnums,)


def _x64_program(name):
  """The loss, its gradients wrt ``argnums`` and (``custom_jvp`` losses) a ``jvp`` of the
  total, over a list of argument sets."""
  loss, argnums = LOSSES[name], _argnums(name)

  def results(*args):
    total = lambda *a: jnp.sum(loss.fn(*a))  # noqa: E731
    out = {"value": loss.fn(*args), "grads": jax.grad(total, argnums=argnums)(*args)}
    if name not in REVERSE_ONLY:
      i = argnums[0]
      along = lambda x: total(*args[:i], x, *args[i + 1 :])  # noqa: E731
      # Not along ones: a shift of the logits, to which most losses are blind (a jvp of 0).
      x = args[i]
      tangent = jnp.cos(jnp.arange(x.size, dtype=x.dtype)).reshape(x.shape)
      out["jvp"] = jax.jvp(along, (x,), (tangent,))[1]
    return out

  return lambda sets: [results(*a) for a in sets]


def _x64_inputs(name, cases):
  """The argument sets of ``cases`` (pairs of input dtype and row count)."""

  def cast(a, dtype):
    return np.asarray(a, dtype) if np.issubdtype(a.dtype, np.floating) else np.asarray(a)

  names = LOSSES[name].names
  return [tuple(cast(X64_DATA[r][n], dtype) for n in names) for dtype, r in cases]


def _check_x64(name, row_counts, numbers, want=None):
  """Under x64: the dtypes of every dtype and row count (traced); then the ``numbers`` cases
  compiled and run with x64 on: finite gradients, the same numbers as ``want`` (by default
  the same cases compiled and run with x64 off). Returns the x64-on results per case."""
  program, argnums = _x64_program(name), _argnums(name)
  # The cases run below have their dtypes checked there: traced only once.
  cases = [(d, r) for d in (jnp.float32, jnp.bfloat16) for r in row_counts if (d, r) not in numbers]
  inputs = _x64_inputs(name, cases)
  with enable_x64(True):
    shapes = jax.eval_shape(program, inputs)  # traces value, grad and jvp of every case
  for (dtype, rows), args, got in zip(cases, inputs, shapes, strict=True):
    # The dtype contract: the value in the inputs' dtype, each gradient in its input's.
    where = f"{name}, {jnp.dtype(dtype).name}, {rows} rows"
    assert got["value"].dtype == dtype, where
    for g, i in zip(got["grads"], argnums, strict=True):
      assert g.dtype == args[i].dtype, where
  inputs = _x64_inputs(name, numbers)
  with enable_x64(True):
    on = jax.tree.map(np.asarray, jax.jit(program)(inputs))
  if want is None:
    want = dict(zip(numbers, jax.tree.map(np.asarray, jax.jit(program)(inputs)), strict=True))
  for (dtype, rows), args, got in zip(numbers, inputs, on, strict=True):
    rtol, atol = TOLERANCES[jnp.dtype(dtype).name]
    where = f"{name}, {jnp.dtype(dtype).name}, {rows} rows"
    assert got["value"].dtype == dtype, where
    for g, i in zip(got["grads"], argnums, strict=True):
      assert g.dtype == args[i].dtype and np.isfinite(g.astype(np.float32)).all(), where
    for key in got:
      leaves = zip(jax.tree.leaves(got[key]), jax.tree.leaves(want[dtype, rows][key]), strict=True)
      for g, w in leaves:
        np.testing.assert_allclose(
          g.astype(np.float64), w.astype(np.float64), rtol, atol, err_msg=f"{where}: {key}"
        )
  return want


@pytest.mark.filterwarnings("ignore:The function convex_kl_divergence is deprecated")
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_x64_float32_and_bfloat16_inputs(name):
  """Under ``jax_enable_x64``, float32 and bfloat16 inputs: the value, ``grad`` and ``jvp``
  keep the inputs' dtypes at every row count, are finite and equal those computed with x64
  off; on the CPU row loop and on the other platforms' single pass."""
  # The other losses have no row loop: one row count is their every path.
  rows = X64_ROWS if LOSSES[name].rows else X64_ROWS[1:2]
  # Numbers: float32 at the most rows (the CPU loop's shifted last block, where it has one),
  # bfloat16 at the fewest; against the same cases with x64 off.
  most = (jnp.float32, rows[-1])
  off = _check_x64(name, rows, [most, (jnp.bfloat16, rows[0])])
  if LOSSES[name].rows:
    # The single pass at the same most rows, against the CPU loop's numbers with x64 off.
    with platform_branch():  # the other platforms' code (GPU, TPU), run on CPU
      _check_x64(name, X64_ROWS[1::2], [most], want=off)
