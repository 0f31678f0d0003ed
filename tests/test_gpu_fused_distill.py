"""The opt-in Pallas Triton kernels of the fused distillation loss for NVIDIA GPUs
(``_gpu_fused_distill``), through :func:`kldiv_jax.fused_distillation_loss`.

As ``tests/test_gpu_fused_head.py``: without a GPU the kernels run in Pallas' interpreter on
CPU (every ``lax.platform_dependent`` on its CUDA branch, ``_gpu_fused_head.INTERPRET``);
with one, Triton compiles them. Blocks of 16 on shapes that are no multiple of them (ragged
tokens, hidden sizes of both sides, vocabulary). Against the XLA chunk loop on the same
branch (``implementation="xla"``, another code path: chunks of logits in XLA and the
engine's ``custom_jvp`` differentiated by ``jax.vjp``) and against float64 NumPy (the
materialised forward KL and cross entropy, their gradients in closed form): the loss, its
parts and the gradients wrt ``hidden``, ``weight`` and ``bias``, for one-pass and two-pass
divergences, static and traced parameters, temperatures, labels with ``alpha`` and
``ignore_index``, ``where``, float32 and bfloat16 (both ``logits_dtype``), both backwards,
``-inf`` classes, NaN tokens and labels out of range, ``jax_enable_x64`` and ``vmap``; and
the program lowered for CUDA.
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
from kldiv_jax import _gpu_fused_distill, _gpu_fused_head

pytestmark = GPU_KERNEL_MARKS
N, H, HT, V = 37, 20, 40, 70  # no multiple of the blocks of 16


small_blocks = _gpu_programs.small_blocks(
  _gpu_fused_distill
)  # several blocks of 16 on these shapes


def _operands(dtype, seed=0, vocab=V, teacher_vocab=V):
  """Student ``(h [N, H], w [H, V], b)``, teacher ``(h_T [N, HT], w_T, b_T)``, labels."""
  rng = np.random.default_rng(seed)
  arr = normal_arrays(rng, dtype)
  student = (arr((N, H)), arr((H, vocab), 0.4), arr(vocab))
  teacher = (arr((N, HT)), arr((HT, teacher_vocab), 0.3), arr(teacher_vocab))
  labels = jnp.asarray(rng.integers(0, min(vocab, teacher_vocab), N), jnp.int32)
  return student, teacher, labels


def _program(implementation, teacher, labels, **options):
  """``jit(value_and_grad)`` of the loss wrt ``(hidden, weight, bias)``, with its parts."""
  return loss_and_parts_program(
    lambda h, w, b: kd.fused_distillation_loss(
      h, w, teacher[0], teacher[1], labels, bias=b, target_bias=teacher[2],
      return_parts=True, implementation=implementation, **options,
    )
  )  # fmt: skip


CASES = [
  # divergence, dtype, logits_dtype, temperature, labels, bias, backward
  ("forward_kl", jnp.float32, None, 1.0, True, True, "owned"),
  ("reverse_kl", jnp.bfloat16, None, 2.0, False, True, "atomic"),
  ("jsd", jnp.float32, None, 0.7, True, False, "owned"),
  ("tvd", jnp.bfloat16, jnp.float32, 1.3, True, True, "atomic"),
  ("skew_reverse_kl", jnp.float32, None, 1.5, False, True, "atomic"),
  ("skew_kl", jnp.bfloat16, None, 1.0, True, True, "owned"),
  (kd.Divergence("alpha_beta", alpha=0.5, beta=0.8), jnp.float32, None, 1.2, True, True, "owned"),
]


@pytest.mark.parametrize("divergence,dtype,logits_dtype,temperature,labelled,bias,backward", CASES)
def test_the_xla_chunk_loop_agrees(
  divergence, dtype, logits_dtype, temperature, labelled, bias, backward, monkeypatch
):
  """The loss, its parts and the gradients wrt hidden, weight and bias against the XLA chunk
  loop on the same branch: one-pass (the KL family, alpha-beta) and two-pass divergences
  (JSD, TVD, skew), float32 and bfloat16 (both ``logits_dtype``), temperatures, labels with
  ``ignore_index`` and ``alpha`` or none, a token mask, both backwards."""
  monkeypatch.setattr(_gpu_fused_head, "BACKWARD", backward)
  (h, w, b), teacher, labels = _operands(dtype, seed=1)
  if not bias:
    b, teacher = None, (*teacher[:2], None)
  labels = labels.at[jnp.asarray([2, 30])].set(-100) if labelled else None
  where = jnp.asarray(np.arange(N) % 7 != 3)
  options = dict(
    divergence=divergence, temperature=temperature, where=where, alpha=0.3,
    logits_dtype=logits_dtype, chunk_size=8,
  )  # fmt: skip
  if not labelled:
    del options["alpha"]
  program = lambda impl: _program(impl, teacher, labels, **options)  # noqa: E731
  got, want, text = pallas_and_xla(program, h, w, b)
  assert "kldiv_jax_gpu_head" in text
  agree(got, want, dtype == jnp.float32)
  assert got[1][0].dtype == dtype


def test_against_float64():
  """Forward KL at ``T = 2`` with the cross entropy (``alpha = 0.4``, ``ignore_index``)
  against the float64 materialised loss: the mean, the parts (sums over the tokens) and the gradients in closed form
  (``alpha T^2 (q - p) / T + (1 - alpha) (softmax(z) - onehot)``, averaged over the tokens)."""
  (h, w, b), (th, tw, tb), labels = _operands(jnp.float32, seed=2)
  labels = labels.at[5].set(-100)
  t, alpha = 2.0, 0.4
  with cuda_branch():
    (loss, (soft, hard)), grads = _program(
      "pallas", (th, tw, tb), labels, temperature=t, alpha=alpha
    )(h, w, b)
  f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
  z = f64(h) @ f64(w) + f64(b)
  y = f64(th) @ f64(tw) + f64(tb)

  def log_softmax(x):
    m = x.max(1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(1, keepdims=True))

  keep = np.asarray(labels) != -100
  lq, lp = log_softmax(z / t), log_softmax(y / t)
  kl = (np.exp(lp) * (lp - lq)).sum(1)
  l1 = log_softmax(z)
  safe = np.where(keep, np.asarray(labels), 0)
  ce = -l1[np.arange(N), safe]
  count = keep.sum()
  want_soft = t * t * kl[keep].sum() / count
  want_hard = ce[keep].sum() / count
  dz = alpha * t * t * (np.exp(lq) - np.exp(lp)) / t + (1 - alpha) * (np.exp(l1) - np.eye(V)[safe])
  dz = np.where(keep[:, None], dz, 0.0) / count
  want_grads = (dz @ f64(w).T, f64(h).T @ dz, dz.sum(0))
  np.testing.assert_allclose(float(soft), want_soft * count, rtol=F32)  # parts: sums
  np.testing.assert_allclose(float(hard), want_hard * count, rtol=F32)
  np.testing.assert_allclose(float(loss), alpha * want_soft + (1 - alpha) * want_hard, rtol=F32)
  for got, want in zip(grads, want_grads):
    np.testing.assert_allclose(f64(got), want, rtol=5 * F32, atol=F32 * np.abs(want).max())


def test_traced_parameters_and_heads_of_other_widths():
  """A traced temperature and a traced divergence parameter (JSD's ``beta`` under ``jit``:
  its two-pass form; symmetric KL's ``lam``: its one-pass form), and a student head longer
  than the teacher's (``teacher_vocab_size``: the shared classes, the rest with zero
  gradient), no bias on the teacher."""
  (h, w, b), (th, tw, _), labels = _operands(jnp.float32, seed=3, vocab=V + 9)

  def program(implementation):
    def loss(h, w, b, t, x):
      out = 0.0
      for divergence in (kd.Divergence("jsd", beta=x), kd.Divergence("symmetric_kl", lam=x)):
        out = out + kd.fused_distillation_loss(
          h, w, th, tw, labels, bias=b, temperature=t, divergence=divergence,
          teacher_vocab_size=V, implementation=implementation,
        )  # fmt: skip
      return out

    return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))

  args = (h, w, b, jnp.float32(1.4), jnp.float32(0.3))
  got, want, text = pallas_and_xla(program, *args)
  # Both through the kernels; only JSD's (two-pass) with a class-sums kernel.
  stats, sums = (text.count(f"kldiv_jax_gpu_head_{k}_kernel") for k in ("stats", "sums"))
  assert stats == 2 * sums > 0
  np.testing.assert_array_equal(np.asarray(got[1][1])[:, V:], 0.0)
  agree(got, want, True)


def test_a_float32_teacher_beside_a_bf16_student():
  """Each side of one dtype (not both of the same): a float32 teacher's logits are rounded to
  the bf16 student's, as in the chunk loop (TVD, no labels)."""
  (h, w, b), (th, tw, tb), _ = _operands(jnp.bfloat16, seed=7)
  teacher = tuple(x.astype(jnp.float32) for x in (th, tw, tb))
  program = lambda impl: _program(impl, teacher, None, divergence="tvd")  # noqa: E731
  got, want, text = pallas_and_xla(program, h, w, b)
  assert "kldiv_jax_gpu_head" in text
  agree(got, want, False)


def test_inf_nan_and_labels_out_of_range():
  """``-inf`` bias entries on either side (classes without mass; a label on a student's
  ``-inf`` class: ``+inf``), a NaN hidden state on each side and a traced label out of range
  give the XLA chunk loop's values and gradients, NaN where it has NaN."""
  (h, w, b), (th, tw, tb), labels = _operands(jnp.float32, seed=4)
  b = b.at[jnp.asarray([3, 17, 69])].set(-jnp.inf)
  tb = tb.at[jnp.asarray([5, 17, 40])].set(-jnp.inf)
  th = th.at[11, 3].set(jnp.nan)
  teacher = (th, tw, tb)

  def run(implementation, h, labels, **options):
    with cuda_branch():
      return _program(implementation, teacher, labels, chunk_size=8, **options)(h, w, b)

  for divergence in ("forward_kl", "jsd", "tvd"):
    got = run("pallas", h, labels, divergence=divergence, temperature=1.5)
    want = run("xla", h, labels, divergence=divergence, temperature=1.5)
    agree(got, want, True)
  # The teacher's NaN token: NaN loss and weight gradient, the other tokens' rows finite.
  gh = np.asarray(got[1][0])
  assert np.isnan(gh[11]).all() and np.isfinite(np.delete(gh, 11, 0)).all()
  # A student's NaN token, a label on a -inf class, a label out of range (traced).
  h2 = h.at[20, 0].set(jnp.nan)
  for bad in (labels.at[4].set(17), labels.at[9].set(V + 3)):
    got = run("pallas", h2, bad, divergence="reverse_kl")
    want = run("xla", h2, bad, divergence="reverse_kl")
    agree(got, want, True)


def test_x64_and_vmap():
  """Under ``jax_enable_x64`` float32 operands take the kernels (int32 indices beside int64
  Python ints) with the XLA chunk loop's values, parts and gradients, dtypes included; and
  ``vmap`` over sequences (batched kernel calls) too."""
  (h, w, b), teacher, labels = _operands(jnp.float32, seed=6)
  with enable_x64(), cuda_branch():
    program = _program("pallas", teacher, labels, divergence="jsd", temperature=1.2)
    got = program(h, w, b)
    want = _program("xla", teacher, labels, divergence="jsd", temperature=1.2)(h, w, b)
    assert "kldiv_jax_gpu_head" in str(jax.make_jaxpr(program)(h, w, b))
  for g, x in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == x.dtype
  agree(got, want, True)
  hb, thb, yb = h[:36].reshape(3, 12, H), teacher[0][:36].reshape(3, 12, HT), labels[:36]

  def grads(implementation):
    def loss(h, w, th, y):
      return kd.fused_distillation_loss(
        h, w, th, teacher[1], y, divergence="reverse_kl", implementation=implementation
      )

    return jax.jit(jax.vmap(jax.grad(loss, (0, 1)), (0, None, 0, 0)))

  got, want, text = pallas_and_xla(grads, hb, w, thb, yb.reshape(3, 12))
  assert "kldiv_jax_gpu_head" in text
  agree(got, want, True)


def test_the_cuda_program_holds_the_kernels(monkeypatch):
  """Lowered for CUDA: ``"pallas"`` (per call or process-wide) puts the fused-head kernels in
  the program of the gradient (statistics, dh, dW; a class-sums kernel for a two-pass
  divergence; one backward kernel with ``BACKWARD="atomic"``); the default and ``"xla"``
  hold no Triton call; the options the kernels leave out (soft-caps, label smoothing, the
  z-loss, mixed dtypes, float64) keep the chunk loop (whose engine may run the row kernels
  of ``_gpu_rows`` with ``"pallas"``, but no fused-head kernel)."""
  monkeypatch.setattr(_gpu_fused_head, "INTERPRET", False)
  (h, w, _), (th, tw, _), labels = _operands(jnp.bfloat16, seed=5)

  def calls(implementation=None, h=h, w=w, th=th, tw=tw, **options):
    """``(Triton calls, fused-head kernels)`` in the program."""

    def loss(h, w):
      out = kd.fused_distillation_loss(
        h, w, th, tw, labels, implementation=implementation, **options
      )
      return out.astype(jnp.float32)

    return kernel_counts(cuda_text(jax.grad(loss, (0, 1)), h, w))

  assert calls("pallas") == (3, 3)  # statistics, dh, dW
  assert calls("pallas", divergence="jsd") == (4, 4)  # and the class sums
  monkeypatch.setattr(_gpu_fused_head, "BACKWARD", "atomic")
  assert calls("pallas", divergence="tvd") == (3, 3)  # statistics, class sums, atomic
  monkeypatch.setattr(_gpu_fused_head, "BACKWARD", "owned")
  assert calls() == (0, 0) and calls("xla") == (0, 0)
  for options in (dict(softcap=30.0), dict(target_softcap=30.0), dict(label_smoothing=0.1),
                  dict(z_loss=1e-4)):  # fmt: skip
    assert calls("pallas", **options)[1] == 0, options
  assert calls("pallas", w=w.astype(jnp.float32))[1] == 0  # mixed dtypes
  previous = kd.set_implementation("pallas")
  try:
    assert calls() == (3, 3)
  finally:
    kd.set_implementation(previous)
  with enable_x64():
    f64 = [x.astype(jnp.float64) for x in (h, w, th, tw)]
    assert calls("pallas", *f64)[1] == 0
