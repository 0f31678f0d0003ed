"""The one-pass statistics of the KL family and of alpha-beta on NVIDIA GPUs, as a primitive.

:data:`ONE_PASS_SUMS` computes a one-pass form's sums (:func:`kldiv_jax._online_kl.online_kl_sums`:
both sides' maxes and sums of exponentials and the weighted log-ratio sums; or
:func:`kldiv_jax._online_ab.online_ab_sums` at static ``alpha, beta > 0``) from one read of
the logits: in a program lowered for CUDA with the opt-in switch on, the statistics kernel of
:mod:`kldiv_jax._gpu_rows` over its grid of row blocks x column splits, the per-split
partials combined in XLA (:func:`triton_one_pass_sums`); elsewhere, and for operands the
kernel does not take, the XLA pass (:func:`xla_one_pass_sums`). The engine calls
:func:`one_pass_sums` when :func:`~kldiv_jax._platform.gpu_kernels_for` its
``implementation``. Its derivatives (second and higher: the engine's rule gives the first)
are those of the two-pass sums, and under ``vmap`` the rows of the batch are stacked.
"""

import functools

import jax
import jax.numpy as jnp
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from kldiv_jax._gpu_rows import (
  Kind,
  _call,
  _launch,
  _lower,
  _num_sums,
  _one_pass_form,
  _reduce_splits,
  _stats_kernel,
  takes,
)
from kldiv_jax._numerics import max_shift
from kldiv_jax._platform import stacked_rows
from kldiv_jax._rows import scaled


def triton_one_pass_sums(
  kind: Kind, caps, z, y, temperature, *masks, grid=None, setting=True, interpret=False
):
  """A one-pass form's sums (:func:`kldiv_jax._online_kl.online_kl_sums`' or
  :func:`kldiv_jax._online_ab.online_ab_sums`') of the scaled logits ``soft_cap(z) / T``,
  ``soft_cap(y) / T`` (with ``masks``) in one Triton kernel: ``(mu, su, mv, sv, *sums)``,
  ``[rows, 1]`` each. ``grid``: a :func:`layout` (tests); ``setting``: the switch's value
  (``True`` or a layout); ``interpret``: Pallas' interpreter."""
  scalars = jnp.reshape(temperature, (1,)).astype(jnp.float32)
  num = 4 + _num_sums(kind)
  kernel = functools.partial(_stats_kernel, caps=caps, kind=kind)
  launch = _launch(z.shape, setting, grid)
  parts = _call(kernel, num, z, y, scalars, masks, launch, interpret=interpret)
  inf = -jnp.inf
  init = (inf, 0, inf, 0) + (0,) * (num - 4)
  mu, su, mv, sv, *sums = _reduce_splits(parts, init, _one_pass_form(kind)[1])
  return (max_shift(mu), su, max_shift(mv), sv, *sums)


# ---------------------------------------------------------------------------- ONE_PASS_SUMS


def _scaled(caps, z, y, temperature, masks):
  u, _ = scaled(z, temperature, masks, caps[0])
  v, _ = scaled(y, temperature, masks, caps[1])
  return u, v


def xla_one_pass_sums(kind: Kind, caps, z, y, temperature, *masks):
  """:data:`ONE_PASS_SUMS` as XLA fusions (every platform but CUDA, and what the kernel does
  not take): the scaled logits' ``online_kl_sums`` or ``online_ab_sums``."""
  return tuple(_one_pass_form(kind)[2](*_scaled(caps, z, y, temperature, masks)))


def one_pass_sums(kind: Kind, caps, z, y, temperature, masks, gpu: bool | tuple = True) -> tuple:
  """``(mu, su, mv, sv, *sums)`` of a one-pass form (``("kl",)``: ``gv, gu`` of
  :func:`~kldiv_jax._online_kl.online_kl_sums`; ``("ab", alpha, beta)``: ``G, H, T`` of
  :func:`~kldiv_jax._online_ab.online_ab_sums`) for the scaled logits of ``z`` and ``y``:
  the Triton kernel in a program lowered for CUDA, the XLA pass elsewhere. For the engine
  when :func:`~kldiv_jax._platform.gpu_kernels_for` its ``implementation`` (on one device);
  ``gpu``: that setting (``True`` or a layout)."""
  kind, caps = tuple(kind), tuple(caps)
  if jax.sharding.get_abstract_mesh().manual_axes:  # inside jax.shard_map, as row_sums
    return xla_one_pass_sums(kind, caps, z, y, temperature, *masks)
  return _one_pass_sums(kind, caps, gpu, z, y, temperature, *masks)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2))
def _one_pass_sums(kind, caps, setting, *args):
  return tuple(ONE_PASS_SUMS.bind(*args, kind=kind, caps=caps, setting=setting))


@_one_pass_sums.defjvp
def _one_pass_sums_jvp(kind, caps, setting, primals, tangents):
  # Second and higher derivatives only, as online_kl_sums' and online_ab_sums': the
  # two-pass sums' (the maxes are constants there).
  def two_pass(z, y, temperature, *masks):
    return _one_pass_form(kind)[3](*_scaled(caps, z, y, temperature, masks))

  _, out = jax.jvp(two_pass, primals, tangents)
  return _one_pass_sums(kind, caps, setting, *primals), out


def _abstract(z, *avals, kind, caps, setting):
  return [ShapedArray((z.shape[0], 1), avals[1].dtype) for _ in range(4 + _num_sums(kind))]


def one_pass_cuda_lowering(ctx, *args, kind, caps, setting, interpret: bool = False):
  """The CUDA lowering of :data:`ONE_PASS_SUMS`: the Triton kernel where it takes the
  operands, else the XLA pass."""
  z, y, temperature, *masks = ctx.avals_in
  fn = xla_one_pass_sums
  if takes(z, y, temperature, masks):
    fn = functools.partial(triton_one_pass_sums, setting=setting, interpret=interpret)
  return _lower(lambda *a: fn(kind, caps, *a), ctx, args)


def _batched(args, dims, *, kind, caps, setting):
  """Under ``vmap``: the rows of the batch stacked into one call when only the logits are
  batched, otherwise (masks, a batched temperature) the XLA pass mapped."""
  z, y, temperature, *masks = args
  num = 4 + _num_sums(kind)
  if masks or any(d is not None for d in dims[2:]):
    out = jax.vmap(functools.partial(xla_one_pass_sums, kind, caps), in_axes=dims)(*args)
    return out, (0,) * num
  size = next(x.shape[d] for x, d in zip((z, y), dims[:2]) if d is not None)
  zs, ys = stacked_rows(z, dims[0], size), stacked_rows(y, dims[1], size)
  out = ONE_PASS_SUMS.bind(zs, ys, temperature, kind=kind, caps=caps, setting=setting)
  return [o.reshape(size, -1, 1) for o in out], [0] * num


def _xla(*args, kind, caps, setting):
  return xla_one_pass_sums(kind, caps, *args)


ONE_PASS_SUMS = Primitive("kldiv_jax_gpu_one_pass_sums")
ONE_PASS_SUMS.multiple_results = True
ONE_PASS_SUMS.def_impl(_xla)
ONE_PASS_SUMS.def_abstract_eval(_abstract)
ONE_PASS_XLA_LOWERING = mlir.lower_fun(_xla, multiple_results=True)
mlir.register_lowering(ONE_PASS_SUMS, ONE_PASS_XLA_LOWERING)
mlir.register_lowering(ONE_PASS_SUMS, one_pass_cuda_lowering, platform="cuda")
batching.primitive_batchers[ONE_PASS_SUMS] = _batched
