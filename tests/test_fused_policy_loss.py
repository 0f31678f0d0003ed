"""fused_policy_loss == policy_loss on the materialised logits: values, metrics, gradients.

The reference materialises ``hidden @ weight + bias``, takes
``token_log_probs(..., return_entropy=True)`` and calls :func:`policy_loss`
(itself checked against verl and TRL in float64 in test_policy.py), both
differentiated wrt hidden, weight and bias; also bf16 heads, the matmuls per chunk, the
default chunk per platform, errors and vocabulary parallelism. The engine underneath
(``fused_token_loss``) is tested in test_fused_token_loss.py.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _references import dot_generals, matmuls_and_casts, vocab_sharded_and_whole
from jax import export

from kldiv_jax import fused_policy_loss, policy_loss, token_log_probs
from kldiv_jax import fused_token_log_probs as kd_fused_token_log_probs
from kldiv_jax._fused_chunks import FUSED_CHUNK_SCOPE, default_chunk_size, platform_chunk_size

B, T, HIDDEN, VOCAB = 3, 5, 6, 24  # N = 15 tokens: chunks of 4 leave a remainder
TOL = {"rtol": 3e-5, "atol": 3e-6}


def _data(rng, dtype=np.float32):
  f = lambda *shape: (1.2 * rng.normal(size=shape)).astype(dtype)  # noqa: E731
  h, w, b = f(B, T, HIDDEN), f(HIDDEN, VOCAB), f(VOCAB)
  ids = rng.integers(0, VOCAB, size=(B, T))
  where = np.ones((B, T), bool)
  where[1, 3:] = False
  # The sampling policy's and the reference's log-probs: those of nearby heads (ratios near 1,
  # some clipped either side).
  z = lambda dw: np.asarray(h, np.float64) @ (w + dw) + b  # noqa: E731
  lp = lambda dw: np.asarray(token_log_probs(z(dw), ids), np.float32)  # noqa: E731
  old, ref = lp(0.3 * rng.normal(size=w.shape)), lp(0.3 * rng.normal(size=w.shape))
  adv = rng.normal(size=B).astype(np.float32)
  return h, w, b, ids, where, old, adv, ref


def _pair(ids, old, adv, temperature=1.0, softcap=None, chunk_size=4, acc=None, fused_ids=None,
          upcast=False, **kw):  # fmt: skip
  """(fused, materialised) value_and_grad wrt hidden, weight and bias (``upcast``: the
  materialised logits ``h @ w + b`` in the inputs' dtype, then float32)."""
  fused_kw = kw | ({} if fused_ids is None else {"ignore_index": -100, "where": None})

  def fused(h, w, b):
    ids_ = ids if fused_ids is None else fused_ids
    return fused_policy_loss(h, w, ids_, old, adv, bias=b, temperature=temperature,
                             softcap=softcap, chunk_size=chunk_size, **fused_kw)  # fmt: skip

  def materialised(h, w, b):
    z = jnp.matmul(h, w, precision=jax.lax.Precision.HIGHEST, preferred_element_type=acc)
    z = z + b[None, None]
    z = z.astype(jnp.float32) if upcast else z
    lp, ent = token_log_probs(z, ids, temperature=temperature, softcap=softcap,
                              return_entropy=True)  # fmt: skip
    return policy_loss(lp, old, adv, entropy=ent, **kw)

  vg = lambda f: jax.value_and_grad(f, (0, 1, 2), has_aux=True)  # noqa: E731
  return vg(fused), vg(materialised)


def _assert_equal(got, want, tol=TOL):
  (loss, metrics), grads = got
  (want_loss, want_metrics), want_grads = want
  np.testing.assert_allclose(loss, want_loss, **tol)
  for field, x, y in zip(metrics._fields, metrics, want_metrics, strict=True):
    np.testing.assert_allclose(x, y, **tol, err_msg=field)
  for x, y in zip(grads, want_grads, strict=True):
    assert x.dtype == y.dtype
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), **tol)


SEGMENTS = np.array([[1, 1, 2, 2, 2], [1, 1, 1, 0, 0], [1, 2, 2, 3, 3]])
CASES = {
  "ppo clip-higher dual-clip, k3, entropy, rollout, soft-cap": dict(
    clip_high=0.28, dual_clip=3.0, beta=0.04, kl_estimator="k3", entropy_coef=0.01,
    rollout_correction="sequence_mask", rollout_bounds=(0.5, 2.0), temperature=0.7, softcap=3.0,
  ),
  "seq-mean-token-mean packed, low_var_kl+": dict(
    aggregation="seq-mean-token-mean", segment_ids=SEGMENTS, beta=0.1,
    kl_estimator="low_var_kl+", kl_clip=20.0, kl_importance_weighted=True, chunk_size=6,
  ),
  "gspo two-pass packed": dict(
    surrogate="gspo", segment_ids=SEGMENTS, entropy_coef=0.01, temperature=1.3
  ),
  "gmpo on-policy, sequence rollout": dict(
    surrogate="gmpo", rollout_correction="sequence_truncate", on_policy=True
  ),
  "cispo seq-mean-token-sum-norm, ignore_index": dict(
    surrogate="cispo", clip_low=0.3, aggregation="seq-mean-token-sum-norm", ignore=True
  ),
  "vespo packed, token_mask rollout": dict(
    surrogate="vespo", vespo_gamma=(1.5, 2.0, 3.0, 0.5), segment_ids=SEGMENTS,
    rollout_correction="token_mask", rollout_bounds=(0.8, 1.25), beta=0.04,
  ),
  "vespo on-policy, token_truncate rollout": dict(
    surrogate="vespo", rollout_correction="token_truncate", on_policy=True,
    aggregation="seq-mean-token-mean",
  ),
  "off-policy mask and top entropy, rollout, packed": dict(
    off_policy_threshold=0.0, top_entropy_fraction=0.4, segment_ids=SEGMENTS, beta=0.02,
    rollout_correction="token_truncate", aggregation="seq-mean-token-mean", entropy_coef=0.01,
  ),
  "top entropy gspo seq-mean-token-sum, ignore_index": dict(
    surrogate="gspo", top_entropy_fraction=0.7, aggregation="seq-mean-token-sum", ignore=True,
  ),
  "off-policy mask on-policy with rollout log-probs": dict(
    off_policy_threshold=-0.05, rollout_correction="token_mask", rollout_bounds=(0.0, 10.0),
    on_policy=True,
  ),
  "clip-cov two-pass packed, a key": dict(
    surrogate="clip-cov", cov_fraction=0.3, cov_bounds=(-2.0, 2.0), segment_ids=SEGMENTS,
    cov_key=jax.random.key(1), clip_high=0.28,
  ),
  "kl-cov seq-mean-token-sum, k2": dict(
    surrogate="kl-cov", cov_fraction=0.2, cov_kl_coef=0.5, aggregation="seq-mean-token-sum",
    beta=0.1, kl_estimator="k2",
  ),
  "ppo rejection, normalised token weights, seq-mean-token-mean": dict(
    rollout_correction="token_mask", rollout_bounds=(0.5, 2.0), rollout_normalize=True,
    rollout_rejection={"sequence_mean_k3": 1.0, "token_k1": (0.2, 5.0)},
    aggregation="seq-mean-token-mean", dual_clip=3.0,
  ),
  "gpg on-policy rejection, a normalizer, packed": dict(
    surrogate="gpg", rollout_correction="token_truncate", on_policy=True, normalizer=7.0,
    rollout_rejection={"token_k1": (0.5, 2.0), "sequence_max_k2": 1.0},
    aggregation="seq-mean-token-sum", segment_ids=SEGMENTS, entropy_coef=0.01,
  ),
  "gpg on-policy, normalised sequence weights": dict(
    surrogate="gpg", rollout_correction="sequence_truncate", rollout_normalize=True,
    on_policy=True,
  ),
}  # fmt: skip
TRACED = ("clip_low", "clip_high", "dual_clip", "beta", "entropy_coef", "temperature")
TRACED += ("off_policy_threshold",)


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_policy_loss_on_materialised_logits(rng, case):
  """Each surrogate family and option group over 15 tokens with a padding mask, chunks not
  dividing them; the scalar options traced (one compilation)."""
  h, w, b, ids, where, old, adv, ref = _data(rng)
  kw = dict(CASES[case], where=where)
  if kw.pop("on_policy", False):
    old = None
  if kw.pop("ignore", False):  # the padding as an id (fused) rather than a mask
    kw["fused_ids"] = np.where(where, ids, -100)
  if kw.get("beta"):
    kw["ref_log_probs"] = ref
  if "rollout_correction" in kw:
    kw["rollout_log_probs"] = ref  # an inference engine's log-probs, near the old ones
  scalars = {k: kw.pop(k) for k in TRACED if k in kw}

  @jax.jit
  def both(scalars):
    fused, materialised = _pair(ids, old, adv, **kw, **scalars)
    return fused(h, w, b), materialised(h, w, b)

  got, want = both(scalars)
  _assert_equal(got, want)
  if "rollout_rejection" in kw:  # some tokens, not all, rejected
    assert 0 < got[0][1].rejected < 1 and 0 < got[0][1].tokens < where.sum()
  else:
    assert got[0][1].tokens == where.sum()


@pytest.mark.parametrize("surrogate", ["ppo", "gspo"])
def test_bf16_head(rng, surrogate):
  """bf16 hidden and weight: the materialised loss of the same inputs' bf16 logits ``h @ w +
  b``, log-probs in float32 (one pass and two): the loss and metrics to float32 rounding,
  gradients in bf16 (the logits' cotangent rounded to bf16 before the matmuls, as
  autodiff's), the loss in the per-token arrays' float32."""
  h, w, b, ids, where, old, adv, _ = _data(rng)
  h, w, b = (jnp.asarray(x, jnp.bfloat16) for x in (h, w, b))
  opts = dict(where=where, entropy_coef=0.01, surrogate=surrogate)
  fused, materialised = _pair(ids, old, adv, upcast=True, **opts)
  (got, got_grads), (want, want_grads) = jax.jit(fused)(h, w, b), jax.jit(materialised)(h, w, b)
  assert got[0].dtype == jnp.float32
  _assert_equal((got, ()), (want, ()), {"rtol": 1e-5, "atol": 1e-6})
  for x, y in zip(got_grads, want_grads, strict=True):
    assert x.dtype == y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), atol=2e-2)


@pytest.mark.parametrize("surrogate", ["ppo", "gspo"])
def test_bf16_head_logits_and_gradient_in_bf16(rng, surrogate):
  """bf16 inputs: the chunks' logits and their gradient pass between the matmuls in bf16, as
  the materialised loss's (XLA:GPU writes them to HBM; in float32 they made the fused loss
  1.5x the materialised one on an H100, benchmarks/bench_accel.py): every matmul takes bf16
  operands, and each chunk's float32-accumulated logits are converted to bf16."""
  h, w, b, ids, _, old, adv, _ = _data(rng)
  h, w, b = (jnp.asarray(x, jnp.bfloat16) for x in (h, w, b))

  def loss(h, w, b):
    return fused_policy_loss(h, w, ids, old, adv, bias=b, surrogate=surrogate, chunk_size=4)[0]

  jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, (0, 1, 2)))(h, w, b).jaxpr
  dots, to_bf16 = matmuls_and_casts(jaxpr, jnp.bfloat16)
  assert dots and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
  assert (4, VOCAB) in to_bf16 and (3, VOCAB) in to_bf16  # a full chunk and the last one


@pytest.mark.parametrize("surrogate", ["ppo", "gspo"])
def test_bf16_head_float32_logits(rng, surrogate):
  """bf16 hidden and weight with ``logits_dtype=jnp.float32``: the materialised loss of the
  same inputs' float32 logits ``h @ w + b`` (unrounded; one pass and two), the loss and
  metrics to float32 rounding, the gradients to their bf16 rounding."""
  h, w, b, ids, where, old, adv, _ = _data(rng)
  h, w, b = (jnp.asarray(x, jnp.bfloat16) for x in (h, w, b))
  opts = dict(where=where, entropy_coef=0.01, surrogate=surrogate)
  fused, _ = _pair(ids, old, adv, logits_dtype=jnp.float32, **opts)
  _, materialised = _pair(ids, old, adv, acc=jnp.float32, **opts)
  (got, got_grads), (want, want_grads) = jax.jit(fused)(h, w, b), jax.jit(materialised)(h, w, b)
  _assert_equal((got, ()), (want, ()), {"rtol": 1e-5, "atol": 1e-6})
  for x, y in zip(got_grads, want_grads, strict=True):
    assert x.dtype == y.dtype == jnp.bfloat16
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    np.testing.assert_allclose(x, y, rtol=2**-7, atol=1e-3 * np.abs(y).max())


def test_bad_logits_dtype(rng):
  h, w, _, ids, _, old, adv, _ = _data(rng)
  for bad in (jnp.bfloat16, "float", 32):
    with pytest.raises(ValueError, match="fused_policy_loss: logits_dtype must be None"):
      fused_policy_loss(h, w, ids, old, adv, logits_dtype=bad)
    with pytest.raises(ValueError, match="fused_token_log_probs: logits_dtype must be None"):
      kd_fused_token_log_probs(h, w, ids, logits_dtype=bad)


@pytest.mark.parametrize(
  ("surrogate", "dots", "kw"),
  [("ppo", 3, {}), ("gspo", 4, {}), ("vespo", 4, {}), ("ppo", 4, {"off_policy_threshold": 0.1}),
   ("ppo", 4, {"top_entropy_fraction": 0.5})],
)  # fmt: skip
def test_three_matmuls_token_level_four_sequence_level(rng, surrogate, dots, kw):
  """value_and_grad: the token-level loss's one pass has three matmuls per chunk (logits,
  grad_hidden, grad_weight); the two passes of GSPO, VESPO and TRL's masks one and three."""
  h, w, b, ids, _, old, adv, _ = _data(rng)

  def loss(h, w, b):
    return fused_policy_loss(h, w, ids, old, adv, bias=b, surrogate=surrogate, chunk_size=5, **kw)[
      0
    ]

  assert dot_generals(jax.make_jaxpr(jax.value_and_grad(loss, (0, 1, 2)))(h, w, b).jaxpr) == dots


def test_default_chunk_per_platform():
  """chunk_size=None: the engine's CPU chunk (2**24 logits) in a CPU module, the accelerator
  chunk of platform_chunk_size on CUDA/TPU."""
  n, hd, v = 256, 8, 1 << 17
  args = [jax.ShapeDtypeStruct(s, d) for s, d in [((n, hd), jnp.float32), ((hd, v), jnp.float32),
          ((n,), jnp.int32), ((n,), jnp.float32)]]  # fmt: skip

  def loss(h, w, ids, x):
    return fused_policy_loss(h, w, ids, x, x)[0]

  program = jax.jit(jax.value_and_grad(loss, (0, 1)))
  cpu, accel = default_chunk_size(n, v, 1 << 24), platform_chunk_size(n, v, "tpu")
  assert (cpu, accel) == (128, 256)
  for platforms, want in [(("cpu",), {cpu}), (("cuda",), {accel}), (("tpu",), {accel})]:
    text = export.export(program, platforms=platforms)(*args).mlir_module()
    assert {int(c) for c in re.findall(FUSED_CHUNK_SCOPE + r"(\d+)", text)} == want, platforms


@pytest.mark.parametrize(
  "kw",
  [
    dict(surrogate="grpo"),
    dict(aggregation="seq-mean"),
    dict(clip_low=-0.1),
    dict(surrogate="cispo-cap"),
    dict(rollout_correction="token"),
    dict(kl_in_loss=1),
    dict(segment_ids=np.ones((B,), np.int32)),
  ],
)
def test_bad_options_raise_as_policy_loss(rng, kw):
  """The shared parse: the same error as policy_loss's, naming fused_policy_loss."""
  h, w, _, ids, *_ = _data(rng)
  x = np.zeros((B, T), np.float32)
  with pytest.raises((TypeError, ValueError)) as want:
    policy_loss(x, x, x, **kw)
  message = str(want.value).replace("policy_loss:", "fused_policy_loss:", 1)
  with pytest.raises(type(want.value), match=re.escape(message)):
    fused_policy_loss(h, w, ids, x, x, **kw)


@pytest.mark.multidevice
def test_vocab_parallel_equals_unsharded(cpu_devices):
  """axis_name: the head split over 8 devices, token-level and GSPO, soft-cap and temperature."""
  h, w, b, ids, where, old, adv, ref = _data(np.random.default_rng(3))
  mesh = jax.sharding.Mesh(np.array(cpu_devices), ("vocab",))
  for surrogate in ("ppo", "gspo"):

    def loss(h, w, b, axis_name=None, surrogate=surrogate):
      return fused_policy_loss(
        h, w, ids, old, adv, bias=b, surrogate=surrogate, where=where, ref_log_probs=ref,
        beta=0.04, entropy_coef=0.01, temperature=1.3, softcap=4.0, chunk_size=4,
        axis_name=axis_name,
      )  # fmt: skip

    got, want = vocab_sharded_and_whole(loss, mesh, h, w, b)
    _assert_equal(got, want)


@pytest.mark.multidevice
def test_vocab_parallel_bf16_float32_logits(cpu_devices):
  """axis_name with bf16 heads and ``logits_dtype=jnp.float32``: the unsharded call's value and
  gradients (to their bf16 rounding)."""
  h, w, b, ids, where, old, adv, _ = _data(np.random.default_rng(4))
  h, w, b = (jnp.asarray(x, jnp.bfloat16) for x in (h, w, b))
  mesh = jax.sharding.Mesh(np.array(cpu_devices), ("vocab",))

  def loss(h, w, b, axis_name=None):
    return fused_policy_loss(h, w, ids, old, adv, bias=b, where=where, entropy_coef=0.01,
                             chunk_size=4, axis_name=axis_name, logits_dtype=jnp.float32)  # fmt: skip

  (got, got_grads), (want, want_grads) = vocab_sharded_and_whole(loss, mesh, h, w, b)
  _assert_equal((got, ()), (want, ()))
  for x, y in zip(got_grads, want_grads, strict=True):
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    np.testing.assert_allclose(x, y, rtol=2**-7, atol=1e-3 * np.abs(y).max())
