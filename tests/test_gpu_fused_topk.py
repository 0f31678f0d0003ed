"""The opt-in Pallas Triton kernels of the fused top-k distillation loss for NVIDIA GPUs
(``_gpu_fused_topk``), through :func:`kldiv_jax.fused_topk_distillation_loss`.

As ``tests/test_gpu_fused_distill.py``: without a GPU the kernels run in Pallas' interpreter
on CPU (every ``lax.platform_dependent`` on its CUDA branch, ``_gpu_fused_head.INTERPRET``);
with one, Triton compiles them. Blocks of 16 on shapes that are no multiple of them (ragged
tokens, hidden size, vocabulary, ``k``). Against the XLA chunk loop on the same branch
(``implementation="xla"``: chunks of logits in XLA, the top-k path differentiated by
``jax.vjp``) and against float64 NumPy (the materialised forward KL with the tail bucket and
the cross entropy, its gradients in closed form): the loss, its parts and the gradients wrt
``hidden``, ``weight`` and ``bias``, for every divergence family, both tails, static and
traced parameters, temperatures, labels with ``alpha`` and ``ignore_index``, a token
``where``, float32 and bfloat16 (both ``logits_dtype``), both backwards, a bucket holding
most of the mass, ``-inf`` classes, NaN tokens, padded and repeated slots, a top-k covering
the vocabulary (an empty tail), a shorter teacher vocabulary, ``jax_enable_x64`` and
``vmap``; and the program lowered for CUDA.
"""

import _gpu_programs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _gpu_programs import (
  F32,
  GPU_KERNEL_MARKS,
  agree,
  cuda_branch,
  cuda_text,
  kernel_counts,
  loss_and_parts_program,
  normal_arrays,
  pallas_and_xla,
)
from _references import enable_x64

import kldiv_jax as kd
from kldiv_jax import _gpu_fused_head, _gpu_fused_topk

pytestmark = GPU_KERNEL_MARKS
N, H, V, K = 37, 20, 70, 5  # no multiple of the blocks of 16


small_blocks = _gpu_programs.small_blocks(_gpu_fused_head)  # several blocks of 16 on these shapes


def _operands(dtype, seed=0, k=K, vocab=V, sharp=1.0):
  """Student ``(h [N, H], w [H, V], b [V])``, a teacher's top-k ``(ids, log-probs)`` (of its
  own random logits, ``sharp`` times as peaked), labels."""
  rng = np.random.default_rng(seed)
  arr = normal_arrays(rng, dtype)
  student = (arr((N, H)), arr((H, vocab), 0.4), arr(vocab))
  t = sharp * rng.standard_normal((N, vocab))
  t = (
    t - np.log(np.exp(t - t.max(1, keepdims=True)).sum(1, keepdims=True)) - t.max(1, keepdims=True)
  )
  ids = np.argsort(-t, axis=1)[:, :k]
  lp = np.take_along_axis(t, ids, axis=1)
  labels = jnp.asarray(rng.integers(0, vocab, N), jnp.int32)
  return student, (jnp.asarray(ids, jnp.int32), jnp.asarray(lp, jnp.float32)), labels


def _program(implementation, teacher, labels, **options):
  """``jit(value_and_grad)`` of the loss wrt ``(hidden, weight, bias)``, with its parts."""
  return loss_and_parts_program(
    lambda h, w, b: kd.fused_topk_distillation_loss(
      h, w, *teacher, labels, bias=b, return_parts=True, implementation=implementation,
      **options,
    )
  )  # fmt: skip


def _both(teacher, labels, h, w, b, **options):
  """:func:`pallas_and_xla` of :func:`_program`."""
  program = lambda impl: _program(impl, teacher, labels, **options)  # noqa: E731
  return pallas_and_xla(program, h, w, b)


CASES = [
  # divergence, tail, dtype, logits_dtype, temperature, labels, bias, backward
  ("forward_kl", "bucket", jnp.float32, None, 1.0, True, True, "owned"),
  ("forward_kl", "renormalize", jnp.bfloat16, None, 2.0, False, True, "atomic"),
  ("reverse_kl", "bucket", jnp.float32, None, 0.7, False, False, "atomic"),
  ("jsd", "renormalize", jnp.float32, None, 1.3, True, True, "owned"),
  ("tvd", "bucket", jnp.bfloat16, jnp.float32, 1.5, True, True, "atomic"),
  ("skew_kl", "bucket", jnp.bfloat16, None, 1.0, False, True, "owned"),
  (
    kd.Divergence("alpha_beta", alpha=0.5, beta=0.8),
    "bucket",
    jnp.float32,
    None,
    1.2,
    True,
    True,
    "owned",
  ),
]


@pytest.mark.parametrize(
  "divergence,tail,dtype,logits_dtype,temperature,labelled,bias,backward", CASES
)
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
  agree(got, want, dtype == jnp.float32)
  assert got[0][0].dtype == dtype


def test_against_float64():
  """Forward KL with the tail bucket at ``T = 2`` (a flat teacher: the bucket holds most of
  the mass) with the cross entropy (``alpha = 0.4``, ``ignore_index``) against the float64
  materialised loss, its gradient in closed form: ``d KL / dz_v = (s_v - p_v) / T`` on the
  top-k ids and ``(s_v - p_tail s_v / q_tail) / T`` outside them (``s = softmax(z / T)``)."""
  (h, w, b), (ids, lp), labels = _operands(jnp.float32, seed=2, sharp=0.3)
  labels = labels.at[5].set(-100)
  t, alpha = 2.0, 0.4
  with cuda_branch():
    loss, grads = _program("pallas", (ids, lp), labels, temperature=t, alpha=alpha, tail="bucket")(
      h, w, b
    )
  f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
  z = f64(h) @ f64(w) + f64(b)

  def softmax(x):
    e = np.exp(x - x.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)

  rows, top = np.arange(N)[:, None], np.zeros((N, V), bool)
  top[rows, np.asarray(ids)] = True
  s, p = softmax(z / t), np.zeros((N, V))
  p[rows, np.asarray(ids)] = np.exp(f64(lp))
  q_top, p_tail = s[rows, np.asarray(ids)], 1.0 - np.exp(f64(lp)).sum(1)
  q_tail = 1.0 - q_top.sum(1)
  assert (p_tail > 0.5).all()  # the bucket holds most of the mass
  kl = (p[rows, np.asarray(ids)] * (f64(lp) - np.log(q_top))).sum(1) + p_tail * np.log(
    p_tail / q_tail
  )
  keep = np.asarray(labels) != -100
  safe = np.where(keep, np.asarray(labels), 0)
  ce = -np.log(softmax(z)[np.arange(N), safe])
  count = keep.sum()
  want = (alpha * t * t * kl[keep].sum() + (1 - alpha) * ce[keep].sum()) / count
  d_kl = np.where(top, s - p, s - (p_tail / q_tail)[:, None] * s) / t
  dz = alpha * t * t * d_kl + (1 - alpha) * (softmax(z) - np.eye(V)[safe])
  dz = np.where(keep[:, None], dz, 0.0) / count
  want_grads = (dz @ f64(w).T, f64(h).T @ dz, dz.sum(0))
  np.testing.assert_allclose(float(loss[0]), want, rtol=F32)
  for got, want in zip(grads, want_grads):
    np.testing.assert_allclose(f64(got), want, rtol=5 * F32, atol=F32 * np.abs(want).max())


def test_inf_nan_padding_and_slot_masks():
  """``-inf`` bias entries (on top-k ids and elsewhere), a NaN hidden state, padded slots
  (``-inf`` log-probabilities, a fifth of them), a repeated id, a token ``where``, ``k = 19`` and
  ``tail_floor=0``: the XLA chunk loop's values and gradients, NaN where it has NaN."""
  (h, w, b), (ids, lp), _ = _operands(jnp.float32, seed=4, k=19)
  b = b.at[jnp.asarray([3, 17, 69])].set(-jnp.inf).at[ids[8, 2]].set(-jnp.inf)
  h = h.at[11, 3].set(jnp.nan)
  lp = lp.at[3, 18].set(-jnp.inf).at[9, 10:].set(-jnp.inf)
  ids = ids.at[6, 18].set(ids[6, 0])
  lp = jnp.where(jnp.asarray(np.random.default_rng(0).random((N, 19)) > 0.2), lp, -jnp.inf)
  where = jnp.asarray(np.arange(N) % 5 != 2)
  for divergence, tail, floor in (("forward_kl", "bucket", 0.0), ("reverse_kl", "renormalize",
                                  1e-7), ("jsd", "bucket", 1e-7)):  # fmt: skip
    options = dict(divergence=divergence, tail=tail, tail_floor=floor, where=where, chunk_size=8)
    got, want, text = _both((ids, lp), None, h, w, b, temperature=1.5, **options)
    assert "kldiv_jax_gpu_head_tail_kernel" in text
    agree(got, want, True)
  gh = np.asarray(got[1][0])
  assert np.isnan(gh[11]).all() and np.isfinite(np.delete(gh, 11, 0)).all()


def test_traced_parameters_one_slot_and_a_shorter_teacher():
  """A traced temperature and traced divergence parameters (JSD's ``beta``, alpha-beta's),
  ``k = 1`` with labels, and a student head longer than the teacher's vocabulary
  (``teacher_vocab_size``: its own classes, left out of the cross entropy too, get zero
  gradients)."""
  (h, w, b), (ids, lp), labels = _operands(jnp.float32, seed=3, vocab=V + 9)
  ids = jnp.minimum(ids, V - 1)  # in the teacher's vocabulary (a repeated id is fine)
  labels = jnp.minimum(labels, V - 1)  # the first loss's head: V classes

  def program(implementation):
    def loss(h, w, b, t, x):
      out = kd.fused_topk_distillation_loss(
        h, w[:, :V], ids[:, :1], lp[:, :1], labels, bias=b[:V], temperature=t, tail="bucket",
        divergence=kd.Divergence("alpha_beta", alpha=x, beta=0.7), implementation=implementation,
      )  # fmt: skip
      return out + kd.fused_topk_distillation_loss(
        h, w, ids, lp, labels, bias=b, temperature=t, divergence=kd.Divergence("jsd", beta=x),
        teacher_vocab_size=V, implementation=implementation,
      )  # fmt: skip

    return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))

  args = (h, w, b, jnp.float32(1.4), jnp.float32(0.3))
  got, want, text = pallas_and_xla(program, *args)
  assert "kldiv_jax_gpu_head_tail_kernel" in text
  np.testing.assert_array_equal(np.asarray(got[1][1])[:, V:], 0.0)
  agree(got, want, True)


def test_x64_and_vmap():
  """Under ``jax_enable_x64`` float32 operands take the kernels with the chunk loop's values,
  parts and gradients, dtypes included; and ``vmap`` over sequences."""
  (h, w, b), teacher, labels = _operands(jnp.float32, seed=6)
  with enable_x64(), cuda_branch():
    program = _program("pallas", teacher, labels, divergence="tvd", temperature=1.2)
    got = program(h, w, b)
    want = _program("xla", teacher, labels, divergence="tvd", temperature=1.2)(h, w, b)
    assert "kldiv_jax_gpu_head_tail_kernel" in str(jax.make_jaxpr(program)(h, w, b))
  for g, x in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == x.dtype
  agree(got, want, True)

  def grads(implementation):
    def loss(h, w, ids, lp):
      return kd.fused_topk_distillation_loss(
        h, w, ids, lp, tail="bucket", divergence="reverse_kl", implementation=implementation
      )

    return jax.jit(jax.vmap(jax.grad(loss, (0, 1)), (0, None, 0, 0)))

  args = (h[:36].reshape(3, 12, H), w, *(x[:36].reshape(3, 12, K) for x in teacher))
  got, want, text = pallas_and_xla(grads, *args)
  assert "kldiv_jax_gpu_head_tail_kernel" in text
  agree(got, want, True)


def test_the_cuda_program_holds_the_kernels(monkeypatch):
  """Lowered for CUDA: ``"pallas"`` (per call or process-wide) puts the kernels in the
  program of the gradient (the tail's, dh, dW, with labels or not; one backward kernel with
  ``BACKWARD="atomic"``); the default and ``"xla"`` hold no Triton
  call; the options the kernels leave out (soft-cap, label smoothing, the z-loss, more slots
  than ``MAX_SLOTS``, mixed dtypes, float64) keep the chunk loop."""
  monkeypatch.setattr(_gpu_fused_head, "INTERPRET", False)
  (h, w, _), (ids, lp), labels = _operands(jnp.bfloat16, seed=5)

  short = jnp.minimum(ids, V - 2)  # ids of a teacher vocabulary of V - 1

  def calls(implementation=None, h=h, w=w, labels=None, ids=ids, **options):
    """``(Triton calls, fused-head kernels)`` in the program."""

    def loss(h, w):
      out = kd.fused_topk_distillation_loss(
        h, w, ids, lp, labels, implementation=implementation, **options
      )
      return out.astype(jnp.float32)

    return kernel_counts(cuda_text(jax.grad(loss, (0, 1)), h, w))

  assert calls("pallas") == (3, 3)  # tail, dh, dW
  assert calls("pallas", labels=labels) == (3, 3)  # the cross entropy in the same kernels
  monkeypatch.setattr(_gpu_fused_head, "BACKWARD", "atomic")
  assert calls("pallas", labels=labels) == (2, 2)  # tail, atomic backward
  monkeypatch.setattr(_gpu_fused_head, "BACKWARD", "owned")
  assert calls() == (0, 0) and calls("xla") == (0, 0)
  for options in (dict(softcap=30.0), dict(labels=labels, label_smoothing=0.1),
                  dict(labels=labels, z_loss=1e-4)):  # fmt: skip
    assert calls("pallas", **options)[1] == 0, options
  assert calls("pallas", labels=labels, ids=short, teacher_vocab_size=V - 1)[1] == 3
  assert calls("pallas", w=w.astype(jnp.float32))[1] == 0  # mixed dtypes
  monkeypatch.setattr(_gpu_fused_topk, "MAX_SLOTS", K - 1)
  assert calls("pallas")[1] == 0
  monkeypatch.setattr(_gpu_fused_topk, "MAX_SLOTS", K)
  previous = kd.set_implementation("pallas")
  try:
    assert calls() == (3, 3)
  finally:
    kd.set_implementation(previous)
  with enable_x64():
    assert calls("pallas", h.astype(jnp.float64), w.astype(jnp.float64))[1] == 0


def test_a_top_k_covering_the_vocabulary():
  """``k = V`` (every class a top-k id): the student's tail is empty (the kernel's log-sum-exp
  ``-inf``, its gradient 0), with the bucket's floor and without: the chunk loop's values and
  gradients."""
  (h, w, b), (ids, lp), labels = _operands(jnp.float32, seed=8, k=V)
  for tail, floor in (("bucket", 1e-7), ("bucket", 0.0), ("renormalize", 0.0)):
    options = dict(divergence="reverse_kl", tail=tail, tail_floor=floor, temperature=1.3)
    got, want, text = _both((ids, lp), labels, h, w, b, alpha=0.6, **options)
    assert "kldiv_jax_gpu_head_tail_kernel" in text
    agree(got, want, True)
