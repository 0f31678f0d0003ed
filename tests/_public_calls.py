"""The public calls and their traits: the one list every "all public functions" suite runs.

Adding a public function means adding one :class:`PublicCall` to :data:`PUBLIC_CALLS`
(``test_export.py`` fails while a callable of ``kldiv_jax.__all__`` has none): the export,
x64, determinism, hostile-argument, hostile-value and vocabulary-parallel suites then take
it from here. An entry names the function's array arguments and the kind of data each one
takes (a *role*, a key of :func:`inputs`), a valid set of options, and its traits (built on
the row kernels, takes ``axis_name``, reverse-mode only, which arguments are differentiated,
which one holds token ids). Suites add their own variants (another option, another mesh) on
top; they never list the public functions again.
"""

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import kldiv_jax as kd


def _kl_div_loss(input, target, *, reduction="mean", log_target=False):  # noqa: A002 - torch's name
  """:class:`kldiv_jax.KLDivLoss` as a function: the module built, then called."""
  return kd.KLDivLoss(reduction=reduction, log_target=log_target)(input, target)


def _first(out):
  return out[0]


def _stack(out):
  return jnp.stack(out)


def _identity(out):
  return out


@dataclasses.dataclass(frozen=True)
class PublicCall:
  """One public function, a valid call of it and its traits.

  ``inputs``: ``(argument, role)`` pairs, passed as keywords in this order (``role`` a key
  of :func:`inputs`); ``options``: the call's other keywords; ``output``: the array checked
  (the value of a function that returns a tuple). Traits: ``argnums``, the positions in
  ``inputs`` that are differentiated; ``rows``, built on the row kernels (the CPU row
  loop); ``axis_name``, takes ``axis_name`` (vocabulary parallelism); ``reverse_only``, a
  ``jax.custom_vjp`` (no ``jvp``); ``chunked``, takes ``chunk_size``; ``ids``, the argument
  holding class or token ids (``None``: none).
  """

  name: str
  fn: Callable[..., Any]
  inputs: tuple[tuple[str, str], ...]
  argnums: tuple[int, ...] = (0,)
  options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  rows: bool = False
  axis_name: bool = False
  reverse_only: bool = False
  chunked: bool = False
  ids: str | None = None
  output: Callable[[Any], Any] = _identity

  @property
  def args(self) -> tuple[str, ...]:
    """The array arguments' names, in order."""
    return tuple(a for a, _ in self.inputs)

  @property
  def roles(self) -> tuple[str, ...]:
    """The data each array argument takes (keys of :func:`inputs`), in order."""
    return tuple(r for _, r in self.inputs)

  def positional(self, **changes) -> Callable[..., Any]:
    """``f(*arrays)``: the call on the arrays of :attr:`inputs`, in order, with ``changes``
    to the options; returns :attr:`output`."""
    args, options = self.args, {**self.options, **changes}

    def f(*arrays):
      return self.output(self.fn(**dict(zip(args, arrays, strict=True)), **options))

    return f

  def __call__(self, data: Mapping[str, Any], **changes) -> Any:
    """The call on ``data`` (role -> array), options updated by ``changes`` (which may also
    replace an input)."""
    kwargs = {a: data[r] for a, r in self.inputs}
    return self.output(self.fn(**{**kwargs, **self.options, **changes}))

  def optional(self) -> tuple[str, ...]:
    """The arguments that take ``None`` (a ``None`` default, or ``None`` in the annotation:
    ``policy_loss``'s ``old_log_probs``)."""
    # eval_str: the annotations are strings (postponed); ``Axis`` is ``int | ... | None``.
    params = inspect.signature(self.fn, eval_str=True).parameters
    return tuple(k for k, p in params.items() if p.default is None or "None" in str(p.annotation))


_LOGITS = (("logits", "s"), ("target_logits", "t"))
_TOPK = (("logits", "s"), ("topk_indices", "idx"), ("topk_log_probs", "topk_lp"))
_HEADS = (("hidden", "h"), ("weight", "w"))

PUBLIC_CALLS: dict[str, PublicCall] = {
  c.name: c
  for c in (
    # torch
    PublicCall(
      "kl_div", kd.kl_div, (("input", "log_q"), ("target", "p")), options={"reduction": "sum"}
    ),
    PublicCall(
      "KLDivLoss",
      _kl_div_loss,
      (("input", "log_q"), ("target", "log_p")),
      options={"reduction": "sum", "log_target": True},
    ),
    PublicCall("kl_div_pointwise", kd.kl_div_pointwise, (("input", "log_q"), ("target", "p"))),
    # optax
    PublicCall("kl_divergence", kd.kl_divergence, (("log_predictions", "log_q"), ("targets", "p"))),
    PublicCall(
      "kl_divergence_with_log_targets",
      kd.kl_divergence_with_log_targets,
      (("log_predictions", "log_q"), ("log_targets", "log_p")),
      argnums=(0, 1),
    ),
    PublicCall(
      "generalized_kl_divergence",
      kd.generalized_kl_divergence,
      (("log_predictions", "log_q"), ("targets", "p")),
    ),
    PublicCall(
      "convex_kl_divergence",
      kd.convex_kl_divergence,
      (("log_predictions", "log_q"), ("targets", "p")),
    ),
    # logits: the divergence engine
    PublicCall(
      "kl_div_from_logits",
      kd.kl_div_from_logits,
      _LOGITS,
      argnums=(0, 1),
      options={"temperature": 2.0},
      rows=True,
      axis_name=True,
    ),
    PublicCall(
      "generalized_jsd",
      kd.generalized_jsd,
      _LOGITS,
      argnums=(0, 1),
      options={"beta": 0.3, "temperature": 2.0},
      rows=True,
      axis_name=True,
    ),
    PublicCall(
      "divergence_from_logits",
      kd.divergence_from_logits,
      _LOGITS,
      argnums=(0, 1),
      options={"divergence": "skew_kl"},
      rows=True,
      axis_name=True,
    ),
    PublicCall(
      "distillation_loss",
      kd.distillation_loss,
      (("student_logits", "s"), ("teacher_logits", "t"), ("labels", "labels")),
      argnums=(0, 1),
      options={"temperature": 2.0, "alpha": 0.3, "beta": 0.4, "normalizer": 3.0},
      rows=True,
      axis_name=True,
      ids="labels",
    ),
    # With the entropy: the row kernel (without it, a kernel without a row loop).
    PublicCall(
      "token_log_probs",
      kd.token_log_probs,
      (("logits", "s"), ("token_ids", "labels")),
      options={"return_entropy": True},
      rows=True,
      axis_name=True,
      ids="token_ids",
      output=_stack,
    ),
    # top-k teachers
    PublicCall(
      "divergence_from_topk",
      kd.divergence_from_topk,
      _TOPK,
      argnums=(0, 2),
      options={"divergence": "reverse_kl"},
      rows=True,
      axis_name=True,
      ids="topk_indices",
    ),
    PublicCall(
      "kl_div_from_topk",
      kd.kl_div_from_topk,
      _TOPK,
      options={"tail": "bucket", "temperature": 2.0},
      rows=True,
      axis_name=True,
      ids="topk_indices",
    ),
    # fused LM heads: jax.custom_vjp, chunked over tokens
    PublicCall(
      "fused_distillation_loss",
      kd.fused_distillation_loss,
      (
        *_HEADS,
        ("target_hidden", "th"),
        ("target_weight", "tw"),
        ("labels", "labels"),
        ("bias", "b"),
        ("target_bias", "tb"),
      ),
      argnums=(0, 1),
      options={"temperature": 2.0, "beta": 0.4, "normalizer": 3.0},
      rows=True,
      axis_name=True,
      reverse_only=True,
      chunked=True,
      ids="labels",
    ),
    PublicCall(
      "fused_topk_distillation_loss",
      kd.fused_topk_distillation_loss,
      (*_HEADS, ("topk_indices", "idx"), ("topk_log_probs", "topk_lp"), ("labels", "labels")),
      argnums=(0, 1),
      options={"label_smoothing": 0.1},  # the cross entropy's (see test_distill_ce_options)
      rows=True,
      axis_name=True,
      reverse_only=True,
      chunked=True,
      ids="labels",
    ),
    PublicCall(
      "fused_token_log_probs",
      kd.fused_token_log_probs,
      (*_HEADS, ("token_ids", "labels")),
      argnums=(0, 1),
      rows=True,
      axis_name=True,
      reverse_only=True,
      chunked=True,
      ids="token_ids",
    ),
    # RL
    PublicCall(
      "kl_estimate",
      kd.kl_estimate,
      (("log_probs", "lp"), ("ref_log_probs", "ref_lp")),
      argnums=(0, 1),
      options={"estimator": "k3"},
    ),
    PublicCall(
      "distillation_advantages",
      kd.distillation_advantages,
      (("student_log_probs", "lp"), ("teacher_log_probs", "ref_lp")),
    ),
    PublicCall("sequence_sum", kd.sequence_sum, (("values", "lp"),)),
    PublicCall("sequence_mean", kd.sequence_mean, (("values", "lp"),)),
    PublicCall(
      "policy_loss",
      kd.policy_loss,
      (
        ("log_probs", "lp"),
        ("old_log_probs", "ref_lp"),
        ("advantages", "adv"),
        ("ref_log_probs", "ref_lp"),
      ),
      options={"beta": 0.1},
      output=_first,
    ),
    PublicCall(
      "fused_policy_loss",
      kd.fused_policy_loss,
      (*_HEADS, ("token_ids", "labels"), ("old_log_probs", "ref_lp"), ("advantages", "adv")),
      argnums=(0, 1),
      rows=True,
      axis_name=True,
      reverse_only=True,
      chunked=True,
      ids="token_ids",
      output=_first,
    ),
    # across tokenizers (ULD and GOLD's hybrid; here both sides of one vocabulary size)
    PublicCall(
      "uld_loss",
      kd.uld_loss,
      (("student_logits", "s"), ("teacher_logits", "t")),
      argnums=(0, 1),
      options={"student_temperature": 2.0, "reduction": "sum"},
      reverse_only=True,  # over positions: the chunked sort's jax.custom_vjp
    ),
    PublicCall(
      "gold_loss",
      kd.gold_loss,
      (("student_logits", "s"), ("teacher_logits", "t")),
      argnums=(0, 1),
      options={"student_ids": np.array([0, 1]), "teacher_ids": np.array([1, 0]), "beta": 0.3},
    ),
    # ULD from each side's top k (a vocabulary of one size here; k below it)
    PublicCall(
      "uld_loss_from_topk",
      kd.uld_loss_from_topk,
      (("student_logits", "s"), ("teacher_logits", "t")),
      argnums=(0, 1),
      options={"k": 3, "student_temperature": 2.0, "reduction": "sum"},
    ),
    # the same from hidden states and LM heads, chunked over tokens (jax.custom_vjp)
    PublicCall(
      "fused_uld_loss_from_topk",
      kd.fused_uld_loss_from_topk,
      (
        *_HEADS,
        ("target_hidden", "th"),
        ("target_weight", "tw"),
        ("bias", "b"),
        ("target_bias", "tb"),
      ),
      argnums=(0, 1),
      options={"k": 3, "student_temperature": 2.0, "reduction": "sum"},
      reverse_only=True,
      chunked=True,
    ),
    # closed forms
    PublicCall(
      "gaussian_kl",
      kd.gaussian_kl,
      (("mean", "mean"), ("log_var", "log_var")),
      argnums=(0, 1),
      options={"prior_mean": 0.5, "prior_log_var": 0.1},
    ),
  )
}

# The public callables that are not a loss of float arrays: classes of results and specs, the
# process-wide setting, the label shift (integer ids in, no derivative: tests/test_distill.py),
# the rollout rejection mask (a bool mask out, no derivative: tests/test_rollout_rejection.py),
# the host helpers of cross-tokenizer distillation and the span merge, whose groups are
# positions in one layout (tests/test_uld.py).
NOT_CALLS = frozenset(
  {"DistillationParts", "Divergence", "DivergenceMetric", "PolicyMetrics"}
  | {"set_implementation", "shift_labels", "rollout_rejection_mask"}
  | {"align_tokens", "matched_vocabulary", "merge_spans"}
)


def missing_calls() -> set[str]:
  """The callables of ``kldiv_jax.__all__`` that :data:`PUBLIC_CALLS` lacks."""
  return set(kd.__all__) - NOT_CALLS - set(PUBLIC_CALLS)


def inputs(
  batch: int | tuple[int, ...], vocab: int, hidden: int, k: int, *, seed: int, scale: float = 1.0
) -> dict[str, np.ndarray]:
  """Seeded float32 data of every role, for a batch of ``batch`` tokens (an int or a shape).

  Logits ``s``/``t`` ``[*batch, vocab]`` (scale ``scale``), the student's log-probabilities
  ``log_q``, the teacher's ``log_p`` and ``p``; ``labels`` ``[*batch]``; the teacher's
  top-``k`` ``idx``/``topk_lp``; hidden states ``h``/``th`` ``[*batch, hidden]``, heads
  ``w``/``tw`` ``[hidden, vocab]`` and biases ``b``/``tb`` ``[vocab]``; per-token
  log-probabilities ``lp``/``ref_lp`` and advantages ``adv`` ``[*batch]``; Gaussian
  ``mean``/``log_var`` ``[*batch, 8]``.
  """
  shape = (batch,) if isinstance(batch, int) else tuple(batch)
  rng = np.random.default_rng(seed)
  f32 = lambda *s, scale=1.0: (scale * rng.normal(size=s)).astype(np.float32)  # noqa: E731
  s, t = f32(*shape, vocab, scale=scale), f32(*shape, vocab, scale=scale)
  log_p = np.asarray(jax.nn.log_softmax(t))
  idx = np.argsort(-t, axis=-1)[..., :k].astype(np.int32)
  out = {"s": s, "t": t, "log_p": log_p, "p": np.exp(log_p), "idx": idx}
  out["log_q"] = np.asarray(jax.nn.log_softmax(s))
  out["topk_lp"] = np.take_along_axis(log_p, idx, axis=-1)
  out["labels"] = rng.integers(0, vocab, size=shape).astype(np.int32)
  out.update(h=f32(*shape, hidden), w=f32(hidden, vocab), th=f32(*shape, hidden))
  out.update(tw=f32(hidden, vocab, scale=2.0), b=f32(vocab), tb=f32(vocab))
  out.update(lp=f32(*shape, scale=0.5) - 2.0, ref_lp=f32(*shape, scale=0.5) - 2.0)
  out.update(adv=f32(*shape), mean=f32(*shape, 8), log_var=f32(*shape, 8, scale=0.3))
  return out
