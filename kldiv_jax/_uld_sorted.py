"""ULD's sorted-probability distance on rows of logits, in bounded memory.

The Universal Logit Distillation distance (Boizard et al., 2024) between a student row
``z_s [V_s]`` and a teacher row ``z_t [V_t]``: each side's softmax sorted in descending
order, the shorter zero-padded to ``L = max(V_s, V_t)``, the absolute differences summed,

.. math::

   D = \\sum_{i=1}^{L} |a_{(i)} - b_{(i)}|, \\qquad
   \\frac{\\partial D}{\\partial p_j} = \\operatorname{sign}\\big(a_{(r_j)} - b_{(r_j)}\\big),

``r_j`` the rank of entry ``j`` in its own side's sort (ties: the stable order, lower index
first, as ``torch.sort(stable=True)``; ``sign(0) = 0``).

The cost is the sort. Sorting ``[N, V]`` at once holds the probabilities, the sort's
``(values, permutation)`` pairs and the teacher's sorted row (about four ``[N, V]`` arrays)
and autodiff of ``jnp.sort`` keeps the permutation for the backward pass. Here the rows go
through in chunks (:data:`CHUNK_ELEMENTS` elements a side), a :func:`jax.custom_vjp` sorts
each side once, pairing the values with ``iota`` to get the permutation, and scatters the
sorted signs back into the original order as ``int8`` (a quarter of a float32 array per
side): the only ``[N, V]`` residuals. The backward pass recomputes the softmax from the
logits, ``dz = p (g - <p, g>) / T``. Without a gradient the sort has no ``iota`` and
nothing is kept.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from kldiv_jax._fused_chunks import chunks

# Elements of one side's chunk ``[rows, V]``: at most 2**23 (32 MiB of float32; at
# V = 151936, 55 rows) and at most an eighth of the rows: a chunk's sort holds about eight
# ``[rows, V]`` arrays of 4 bytes (both sides' values and orders, the differences, the
# scatter), so its temporaries stay within one ``[N, V]`` float32 array at any ``N``.
CHUNK_ELEMENTS = 2**23
CHUNKS_AT_LEAST = 8


def chunk_rows(rows: int, vocab: int) -> int:
  """Rows per chunk: at most ``CHUNK_ELEMENTS // vocab`` and ``ceil(rows / 8)``, at least 1."""
  return max(1, min(-(-rows // CHUNKS_AT_LEAST), CHUNK_ELEMENTS // max(vocab, 1)))


def probabilities(z: jax.Array, t) -> jax.Array:
  """``softmax(z / t)`` over the last axis; a row without a finite logit has no mass (0)."""
  z = z / t
  m = jnp.max(z, axis=-1, keepdims=True)
  m = lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
  e = jnp.exp(z - m)
  s = jnp.sum(e, axis=-1, keepdims=True)
  # Times the reciprocal, not divided: XLA:CPU then compiles the derivative alike in a module
  # exported for several platforms and in a plain jit (bit for bit; tests/test_export.py).
  return e * (1.0 / jnp.where(s > 0, s, 1.0))


def _pad(x, length):
  return jnp.pad(x, ((0, 0), (0, length - x.shape[-1])))


def _descending(p, with_order: bool):
  """``p`` sorted in descending order along the last axis (stable), and the order."""
  if not with_order:
    return -lax.sort(-p, dimension=-1, is_stable=True), None
  iota = lax.broadcasted_iota(jnp.int32, p.shape, p.ndim - 1)
  neg, order = lax.sort((-p, iota), dimension=-1, is_stable=True, num_keys=1)
  return -neg, order


def _masked(z, keep):
  """The rows ``keep`` holds; the others selected away (0) before the softmax."""
  return jnp.where(keep[:, None], z, 0.0)


def _rows_value(zs, zt, ts, tt, keep):
  """Per-row distance of a chunk, no gradient."""
  a, _ = _descending(probabilities(_masked(zs, keep), ts), False)
  b, _ = _descending(probabilities(_masked(zt, keep), tt), False)
  length = max(a.shape[-1], b.shape[-1])
  return jnp.sum(jnp.abs(_pad(a, length) - _pad(b, length)), axis=-1)


def _unsort(signs, order):
  """``out[r, order[r, i]] = signs[r, i]``: the sorted signs in the original order (int8)."""
  rows = lax.broadcasted_iota(jnp.int32, order.shape, 0)
  return jnp.zeros(order.shape, jnp.int8).at[rows, order].set(signs, unique_indices=True)


def _rows_value_signs(zs, zt, ts, tt, keep, sides):
  """Per-row distance of a chunk and ``dD/dp`` of the ``sides`` differentiated (``(student,
  teacher)`` bools), int8 in the original order (``None`` for the other)."""
  a, order_s = _descending(probabilities(_masked(zs, keep), ts), sides[0])
  b, order_t = _descending(probabilities(_masked(zt, keep), tt), sides[1])
  vs, vt = a.shape[-1], b.shape[-1]
  length = max(vs, vt)
  diff = _pad(a, length) - _pad(b, length)
  sign = jnp.sign(diff).astype(jnp.int8)
  sign_s = None if order_s is None else _unsort(sign[:, :vs], order_s)
  sign_t = None if order_t is None else _unsort(-sign[:, :vt], order_t)
  return jnp.sum(jnp.abs(diff), axis=-1), sign_s, sign_t


def _over_chunks(fn, arrays, carry, vocab):
  """``carry = fn(start, chunk of each of arrays, carry)`` over row chunks of ``vocab``."""
  rows = arrays[0].shape[0]

  def part(start, _, cut, carry):
    return fn(start, *cut(arrays), carry)

  return chunks(rows, chunk_rows(rows, vocab), part, carry)


def _put(buffer, rows, start):
  return None if buffer is None else lax.dynamic_update_slice_in_dim(buffer, rows, start, 0)


@jax.custom_vjp
def sorted_distance(zs, zt, ts, tt, keep):
  """ULD's distance per row ``[rows]`` of logits ``zs [rows, V_s]``, ``zt [rows, V_t]`` (the
  compute dtype) at temperatures ``ts``, ``tt`` (scalars of that dtype), the rows ``keep``
  holds (bool ``[rows]``; the others are computed on zeros: a NaN there reaches nothing);
  see the module."""
  vocab = max(zs.shape[-1], zt.shape[-1])

  def fn(start, s, t, k, out):
    return _put(out, _rows_value(s, t, ts, tt, k), start)

  return _over_chunks(fn, (zs, zt, keep), jnp.zeros(zs.shape[:1], zs.dtype), vocab)


def _sorted_distance_fwd(zs, zt, ts, tt, keep):
  # symbolic_zeros: each argument comes with whether it is differentiated (``perturbed``);
  # a side that is not (a stopped teacher) needs neither its signs nor its gradient.
  sides = (zs.perturbed or ts.perturbed, zt.perturbed or tt.perturbed)
  zs, zt, ts, tt, keep = (x.value for x in (zs, zt, ts, tt, keep))
  vocab = max(zs.shape[-1], zt.shape[-1])

  def fn(start, s, t, k, carry):
    value, sign_s, sign_t = carry
    v, gs, gt = _rows_value_signs(s, t, ts, tt, k, sides)
    return _put(value, v, start), _put(sign_s, gs, start), _put(sign_t, gt, start)

  signs = tuple(jnp.zeros(z.shape, jnp.int8) if on else None for z, on in zip((zs, zt), sides))
  init = (jnp.zeros(zs.shape[:1], zs.dtype), *signs)
  value, sign_s, sign_t = _over_chunks(fn, (zs, zt, keep), init, vocab)
  return value, (zs, zt, ts, tt, keep, sign_s, sign_t)


def _softmax_vjp(z, t, sign, ct):
  """``(dz, dt)`` of ``sum(ct * <sign, softmax(z / t)>)``: ``du = p (g - <p, g>)``, ``u = z/t``."""
  u = z / t
  p = probabilities(z, t)
  g = ct[:, None] * sign.astype(z.dtype)
  du = p * (g - jnp.sum(p * g, axis=-1, keepdims=True))
  safe_u = jnp.where(p > 0, u, 0.0)  # du is 0 where p is: no 0 * -inf
  return du / t, -jnp.sum(du * safe_u) / t


def _side_grad(z, t, keep, sign, ct):
  """One side's ``(dz, dt)``, a chunk of rows at a time (the softmax recomputed per chunk)."""
  if sign is None:
    return None, None

  def fn(start, zc, kc, sc, cc, carry):
    dz, dt = carry
    dzc, dtc = _softmax_vjp(_masked(zc, kc), t, sc, jnp.where(kc, cc, 0.0))
    return _put(dz, dzc, start), dt + dtc

  init = (jnp.zeros(z.shape, z.dtype), jnp.zeros((), z.dtype))
  dz, dt = _over_chunks(fn, (z, keep, sign, ct), init, z.shape[-1])
  return dz, dt.astype(jnp.result_type(t))


def _sorted_distance_bwd(res, ct):
  zs, zt, ts, tt, keep, sign_s, sign_t = res
  if isinstance(ct, SymbolicZero):
    ct = jnp.zeros(zs.shape[:1], zs.dtype)
  dzs, dts = _side_grad(zs, ts, keep, sign_s, ct)
  dzt, dtt = _side_grad(zt, tt, keep, sign_t, ct)
  return dzs, dzt, dts, dtt, None


sorted_distance.defvjp(_sorted_distance_fwd, _sorted_distance_bwd, symbolic_zeros=True)


def uld_rows(zs: jax.Array, zt: jax.Array, ts, tt, keep: jax.Array) -> jax.Array:
  """:func:`sorted_distance` of logits ``[..., V_s]``, ``[..., V_t]`` (the same leading axes,
  the compute dtype) at temperatures of any static or traced kind, the rows ``keep [...]``
  holds: ``[...]``."""
  lead = zs.shape[:-1]
  zs, zt = zs.reshape(-1, zs.shape[-1]), zt.reshape(-1, zt.shape[-1])
  ts, tt = (jnp.asarray(t).astype(zs.dtype) for t in (ts, tt))
  if zs.shape[0] == 0:
    return jnp.zeros(lead, zs.dtype)
  return sorted_distance(zs, zt, ts, tt, keep.reshape(-1)).reshape(lead)


def sorted_distance_reference(zs, zt, ts, tt):
  """The straightforward form (``jnp.sort`` of all rows at once, autodiff through it): the
  benchmarks' baseline."""
  a = -jnp.sort(-probabilities(zs, ts), axis=-1)
  b = -jnp.sort(-probabilities(zt, tt), axis=-1)
  length = max(a.shape[-1], b.shape[-1])
  return jnp.sum(jnp.abs(_pad(a, length) - _pad(b, length)), axis=-1)
