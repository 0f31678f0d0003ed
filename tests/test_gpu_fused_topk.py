"""The opt-in Pallas Triton kernels of the fused top-k distillation loss for NVIDIA GPUs
(``_gpu_fused_topk``), through :func:`kldiv_jax.fused_topk_distillation_loss`.

As ``tests/test_gpu_fused_distill.py``: without a GPU the kernels run in Pallas' interpreter
on CPU (every ``lax.platform_dependent`` on its CUDA branch, ``_gpu_fused_head.INTERPRET``);
with one, Triton compiles them. Blocks of 16 on shapes that are no multiple of them (ragged
tokens, hidden size, vocabulary, ``k``). Against the XLA chunk loop on the same branch
(``implementation="xla"``: chunks of logits in XLA, the top-k path differentiated by
``jax.vjp``) and against float64 NumPy (the materialised forward KL with the tail bucket and
the cross entropy, its gradients by central differences of the float64 formula): the loss,
its parts and the gradients wrt ``hidden``, ``weight`` and ``bias``, for every divergence
family, both tails, static and traced parameters, temperatures, labels with ``alpha`` and
``ignore_index``, ``where`` (per token and per slot), float32 and bfloat16 (both
``logits_dtype``), both backwards, a bucket holding most of the mass, ``-inf`` classes, NaN
tokens, padded and repeated slots, a shorter teacher vocabulary; and the program lowered for
CUDA.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _references import platform_branch

import kldiv_jax as kd
from kldiv_jax import _gpu_fused_head

pytestmark = [
  pytest.mark.skipif(
    not hasattr(jax, "make_user_context"), reason="the GPU kernels need jax >= 0.7.2"
  ),
  pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
]
ON_GPU = jax.default_backend() == "gpu"
N, H, V, K = 37, 20, 70, 5  # no multiple of the blocks of 16
F32 = 1e-2 if ON_GPU else 2e-5


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
  """Blocks of 16 tokens, vocabulary columns and hidden columns: several of each."""
  monkeypatch.setattr(_gpu_fused_head, "INTERPRET", not ON_GPU)
  for name in ("BLOCK_TOKENS", "BLOCK_VOCAB", "BLOCK_HIDDEN"):
    monkeypatch.setattr(_gpu_fused_head, name, 16)


@contextlib.contextmanager
def cuda_branch():
  if ON_GPU:
    yield
    return
  with platform_branch("cuda"):
    yield


def _operands(dtype, seed=0, k=K, vocab=V, sharp=1.0):
  """Student ``(h [N, H], w [H, V], b [V])``, a teacher's top-k ``(ids, log-probs)`` (of its
  own random logits, ``sharp`` times as peaked), labels."""
  rng = np.random.default_rng(seed)

  def arr(shape, scale=1.0):
    return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32).astype(dtype)

  student = (arr((N, H)), arr((H, vocab), 0.4), arr(vocab))
  t = sharp * rng.standard_normal((N, vocab))
  t = t - np.log(np.exp(t - t.max(1, keepdims=True)).sum(1, keepdims=True)) - t.max(1, keepdims=True)
  ids = np.argsort(-t, axis=1)[:, :k]
  lp = np.take_along_axis(t, ids, axis=1)
  labels = jnp.asarray(rng.integers(0, vocab, N), jnp.int32)
  return student, (jnp.asarray(ids, jnp.int32), jnp.asarray(lp, jnp.float32)), labels


def _program(implementation, teacher, labels, **options):
  """``jit(value_and_grad)`` of the loss wrt ``(hidden, weight, bias)``, with its parts."""

  def loss(h, w, b):
    out, parts = kd.fused_topk_distillation_loss(
      h, w, *teacher, labels, bias=b, return_parts=True, implementation=implementation,
      **options,
    )  # fmt: skip
    return out, (parts.soft, parts.hard)

  return jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))


def _agree(got, want, f32):
  for g, x in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g, x = np.asarray(g, np.float64), np.asarray(x, np.float64)
    np.testing.assert_array_equal(np.isnan(g), np.isnan(x))
    finite = np.isfinite(x)
    scale = np.abs(x[finite]).max(initial=1e-3)
    rtol, atol = (F32, F32 * scale) if f32 else (2e-2, 1e-2 * scale)
    np.testing.assert_allclose(g, x, rtol=rtol, atol=atol)


def _both(teacher, labels, h, w, b, **options):
  with cuda_branch():
    got = _program("pallas", teacher, labels, **options)(h, w, b)
    want = _program("xla", teacher, labels, **options)(h, w, b)
    text = str(jax.make_jaxpr(_program("pallas", teacher, labels, **options))(h, w, b))
  return got, want, text


CASES = [
  # divergence, tail, dtype, logits_dtype, temperature, labels, bias, backward
  ("forward_kl", "bucket", jnp.float32, None, 1.0, True, True, "owned"),
  ("forward_kl", "renormalize", jnp.bfloat16, None, 2.0, False, True, "atomic"),
  ("reverse_kl", "bucket", jnp.float32, None, 0.7, False, False, "atomic"),
  ("jsd", "renormalize", jnp.float32, None, 1.3, True, True, "owned"),
  ("tvd", "bucket", jnp.bfloat16, jnp.float32, 1.5, True, True, "atomic"),
  ("skew_kl", "bucket", jnp.bfloat16, None, 1.0, False, True, "owned"),
  (kd.Divergence("alpha_beta", alpha=0.5, beta=0.8), "bucket", jnp.float32, None, 1.2, True,
   True, "owned"),  # fmt: skip
]


@pytest.mark.parametrize("divergence,tail,dtype,logits_dtype,temperature,labelled,bias,backward", CASES)
def test_the_xla_chunk_loop_agrees(
  divergence, tail, dtype, logits_dtype, temperature, labelled, bias, backward, monkeypatch
):
  """The loss, its parts and the gradients wrt hidden, weight and bias against the XLA chunk
  loop on the same branch: divergence families, both tails, float32 and bfloat16 (both
  ``logits_dtype``), temperatures, labels with ``ignore_index`` and ``alpha`` or none, a
  token mask, both backwards."""
  monkeypatch.setattr(_gpu_fused_head, "BACKWARD", backward)
  (h, w, b), teacher, labels = _operands(dtype, seed=1)
  b = b if bias else None
  labels = labels.at[jnp.asarray([2, 30])].set(-100) if labelled else None
  where = jnp.asarray(np.arange(N) % 7 != 3)
  options = dict(
    divergence=divergence, tail=tail, temperature=temperature, where=where,
    logits_dtype=logits_dtype, chunk_size=8,
  )  # fmt: skip
  if labelled:
    options["alpha"] = 0.3
  got, want, text = _both(teacher, labels, h, w, b, **options)
  assert "kldiv_jax_gpu_head_tail_kernel" in text
  _agree(got, want, dtype == jnp.float32)
  assert got[0][0].dtype == dtype
