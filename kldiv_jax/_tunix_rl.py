"""Tunix's RL learners on the fused path: the registered policy loss and the log-prob passes.

``policy_loss_fn="kldiv_jax"`` (registered on import) computes :func:`kldiv_jax.fused_policy_loss`
from the policy's hidden states and head; :func:`per_token_logps` is Tunix's
``common.compute_per_token_logps`` (same signature, same numbers) through
:func:`kldiv_jax.fused_token_log_probs`, and :func:`use_fused_log_probs` puts it where Tunix's
learners call it (the rollout/old-policy, actor and reference passes).
"""

# pyright: reportMissingImports=false
# (flax and tunix: the `tunix` extra; `make typecheck` runs where it is not installed.)

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from typing import Any, cast

import jax
import jax.numpy as jnp
from flax import nnx
from tunix.rl import common, function_registry
from tunix.rl.grpo.grpo_learner import GRPOConfig

from kldiv_jax._fused_tokens import fused_token_log_probs
from kldiv_jax._policy import fused_policy_loss
from kldiv_jax._tunix_models import Head, hidden_states, linear_inputs, lm_head

NAME = "kldiv_jax"

# Tunix's configuration -> policy_loss's options, in one place.
# loss_agg_mode -> aggregation ("sequence-mean-token-scale": normalizer sequences * length).
AGGREGATIONS = {
  "token-mean": "token-mean",
  "sequence-mean-token-mean": "seq-mean-token-mean",
  "seq-mean-token-sum": "seq-mean-token-sum",
  "sequence-mean-token-sum-norm": "seq-mean-token-sum",
  "sequence-mean-token-scale": "seq-mean-token-sum",
}
KL_ESTIMATORS = {"kl": "k1", "mse_kl": "k2", "low_var_kl": "k3"}  # kl_loss_mode
SURROGATES = {"grpo": "ppo", "gspo-token": "gspo-token"}  # loss_algo


@dataclasses.dataclass(kw_only=True)
class PolicyLossConfig(GRPOConfig):
  """Tunix's ``GRPOConfig`` with ``policy_loss_fn="kldiv_jax"`` and policy_loss's own options.

  ``surrogate``: any of :func:`kldiv_jax.policy_loss`'s (``None``: from ``loss_algo``);
  ``policy_loss_options``: any other keyword of :func:`kldiv_jax.fused_policy_loss`
  (``clip_high``, ``dual_clip``, ``kl_clip``, ``entropy_coef``, ``chunk_size``, ...), applied
  last.
  """

  policy_loss_fn: str = NAME
  surrogate: str | None = None
  policy_loss_options: dict[str, Any] = dataclasses.field(default_factory=dict)


def _temperature(temperature) -> float:
  # Tunix divides the logits by the temperature unless it is 0 or 1.
  return 1.0 if temperature in (0.0, 1.0) else temperature


def completion_states(
  model, prompt_tokens, completion_tokens, pad_id, eos_id, *, images=None, segment_ids=None,
  segment_positions=None,
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
  """The hidden states that predict each completion token, and those tokens, ``[B, K]``.

  Laid out as Tunix's ``compute_per_token_logps`` lays out its log-probs: the completion's
  ``K`` tokens, or with packing (``segment_ids``) the whole row with a zero hidden state in
  front (Tunix's log-prob there is 0, and no loss counts it).
  """
  tokens, positions, attention_mask, pad_segments = common.process_ids(
    prompt_tokens, completion_tokens, pad_id, eos_id, segment_ids, segment_positions
  )
  kwargs: dict[str, Any] = {}
  if _takes_segment_ids(model):  # as Tunix: packing ids, else the non-pad mask
    if segment_ids is not None:
      kwargs["segment_ids"] = segment_ids
    elif pad_segments is not None:
      kwargs["segment_ids"] = pad_segments
  if images is not None:
    kwargs["images"] = images
  hidden = hidden_states(
    model, tokens, positions=positions, attention_mask=attention_mask, **kwargs
  )
  keep = tokens.shape[1] - 1 if segment_ids is not None else completion_tokens.shape[1]
  hidden, ids = hidden[:, -keep - 1 : -1], tokens[:, -keep:]
  if segment_ids is not None:
    hidden = jnp.pad(hidden, ((0, 0), (1, 0), (0, 0)))
    ids = jnp.pad(ids, ((0, 0), (1, 0)))
  return hidden, ids


def _takes_segment_ids(model) -> bool:
  try:
    params = inspect.signature(model.__call__).parameters.values()
  except (TypeError, ValueError):  # pragma: no cover
    return False
  return any(p.name == "segment_ids" or p.kind == p.VAR_KEYWORD for p in params)


@functools.partial(
  jax.jit, static_argnames=("pad_id", "eos_id", "stop_gradient", "return_logits", "temperature")
)
def _fused_logps(
  graphdef, state, prompt_tokens, completion_tokens, pad_id, eos_id, images=None,
  stop_gradient=True, return_logits=False, segment_ids=None, segment_positions=None,
  temperature=1.0,
):  # fmt: skip
  del return_logits
  model = nnx.merge(graphdef, state)
  hidden, ids = completion_states(
    model, prompt_tokens, completion_tokens, pad_id, eos_id, images=images,
    segment_ids=segment_ids, segment_positions=segment_positions,
  )  # fmt: skip
  head = lm_head(model)
  h, w = linear_inputs(hidden, head)
  log_probs = fused_token_log_probs(
    h, w, ids, bias=head.bias, softcap=head.softcap, temperature=_temperature(temperature)
  )
  log_probs = cast(jax.Array, log_probs).astype(jnp.float32)
  if segment_ids is not None:
    log_probs = log_probs.at[:, 0].set(0.0)
  return jax.lax.stop_gradient(log_probs) if stop_gradient else log_probs


_STOCK = common.compute_per_token_logps


class MaterializedLogitsWarning(UserWarning):
  """A Tunix call asked for the ``[B, L, V]`` logits, which the fused path never builds."""


def per_token_logps(
  graphdef, state, prompt_tokens, completion_tokens, pad_id, eos_id, images=None,
  stop_gradient=True, return_logits=False, segment_ids=None, segment_positions=None,
  temperature=1.0,
):  # fmt: skip
  """Tunix's ``common.compute_per_token_logps`` through :func:`kldiv_jax.fused_token_log_probs`.

  The same signature and the same log-probabilities ``[B, K]`` (packed: ``[B, L]``, 0 in
  front), from the model's hidden states and head, chunked over the vocabulary: no
  ``[B, L, V]`` logits, float32 or otherwise. ``return_logits=True`` (Tunix's own policy
  losses ask for them, for the entropy) cannot be served without the logits: it warns
  (:class:`MaterializedLogitsWarning`) and runs Tunix's own function.
  """
  if return_logits:
    warnings.warn(
      "kldiv_jax.tunix.per_token_logps: return_logits=True materialises the [B, L, V] logits"
      " (Tunix's own function runs); the policy losses that ask for them are Tunix's own:"
      f" use policy_loss_fn={NAME!r} for the fused path.",
      MaterializedLogitsWarning,
      stacklevel=2,
    )
    return _STOCK(
      graphdef, state, prompt_tokens, completion_tokens, pad_id, eos_id, images=images,
      stop_gradient=stop_gradient, return_logits=True, segment_ids=segment_ids,
      segment_positions=segment_positions, temperature=temperature,
    )  # fmt: skip
  return _fused_logps(
    graphdef, state, prompt_tokens, completion_tokens, pad_id, eos_id, images=images,
    stop_gradient=stop_gradient, segment_ids=segment_ids,
    segment_positions=segment_positions, temperature=temperature,
  )  # fmt: skip


class use_fused_log_probs:  # a class used as a function (and a context manager)
  """Put :func:`per_token_logps` where Tunix's learners call ``compute_per_token_logps``.

  Tunix's RL cluster (the actor's old-policy pass), its inference worker (the reference
  pass) and its vanilla and SGLang-JAX rollouts (the rollout's own log-probs) look up
  ``tunix.rl.common.compute_per_token_logps`` at each call; this replaces it, for good
  (``use_fused_log_probs()``) or for a block (``with use_fused_log_probs(): ...``). A vLLM
  rollout computes its log-probs in vLLM and is unaffected.
  """

  def __init__(self):
    self._previous = common.compute_per_token_logps
    common.compute_per_token_logps = per_token_logps

  def __enter__(self) -> use_fused_log_probs:
    return self

  def __exit__(self, *exc) -> None:
    common.compute_per_token_logps = self._previous


def policy_loss_options(algo_config, train_example) -> dict[str, Any]:
  """:func:`kldiv_jax.fused_policy_loss`'s options from Tunix's configuration and example.

  A ``GRPOConfig`` (or :class:`PolicyLossConfig`) maps as Tunix's ``"grpo"`` loss reads it;
  a ``PPOConfig`` (no ``loss_agg_mode``) as its ``"ppo"`` loss does: token-mean, clips
  ``epsilon_low``/``epsilon_high``/``epsilon_c``, the ``kl`` estimator weighted by
  ``kl_coef`` (0 unless set), ``entropy_coef``.
  """
  ex = train_example
  mask = ex.completion_mask.astype(bool)
  if getattr(algo_config, "kl_clamp_value", None) is not None:
    raise ValueError(
      "kldiv_jax.tunix: kl_clamp_value clamps Tunix's KL estimate; pass"
      " policy_loss_options={'kl_clip': ...} (a bound on the log-ratio) instead."
    )
  ppo = not hasattr(algo_config, "loss_agg_mode")  # Tunix's PPOConfig
  mode = getattr(algo_config, "loss_agg_mode", "token-mean")
  if mode not in AGGREGATIONS:
    raise ValueError(
      f"kldiv_jax.tunix: loss_agg_mode must be one of {sorted(AGGREGATIONS)}; got {mode!r}."
    )
  normalizer = None
  if mode == "sequence-mean-token-scale":
    sequences = jnp.maximum(jnp.sum(jnp.any(mask, axis=-1)), 1)
    normalizer = sequences * mask.shape[-1]
  surrogate = getattr(algo_config, "surrogate", None)
  surrogate = surrogate or SURROGATES[getattr(algo_config, "loss_algo", "grpo")]
  clip_low = getattr(algo_config, "epsilon_low", None) or algo_config.epsilon
  clip_high = getattr(algo_config, "epsilon_high", None) or algo_config.epsilon
  if ppo:
    beta, kl_estimator = getattr(algo_config, "kl_coef", 0.0), "k1"
  else:
    beta, kl_estimator = algo_config.beta, KL_ESTIMATORS[algo_config.kl_loss_mode]
  options: dict[str, Any] = dict(
    surrogate=surrogate,
    clip_low=clip_low,
    clip_high=clip_high,
    dual_clip=getattr(algo_config, "epsilon_c", None),
    aggregation=AGGREGATIONS[mode],
    normalizer=normalizer,
    where=mask,
    segment_ids=ex.segment_ids,  # packed rows: 1, 2, ... per sequence, 0 padding
    ref_log_probs=ex.ref_per_token_logps,
    beta=beta or 0.0,
    kl_estimator=kl_estimator,
    entropy_coef=getattr(algo_config, "entropy_coef", None) or 0.0,
    temperature=_temperature(getattr(algo_config, "temperature", 1.0)),
  )
  if ex.sampler_is_weights is not None:
    if ex.old_per_token_logps is None:
      raise ValueError(
        "kldiv_jax.tunix: sampler_is_weights needs old_per_token_logps (the weights are"
        " min(pi_old / pi_sampler, threshold)); the example has none."
      )
    # Tunix hands over min(pi_old / pi_sampler, threshold), > 0 on the completion: the
    # log-probs that give those weights back, unclamped.
    old = jax.lax.stop_gradient(ex.old_per_token_logps.astype(jnp.float32))
    weights = jnp.where(mask, ex.sampler_is_weights, 1.0).astype(jnp.float32)
    options |= dict(rollout_log_probs=old - jnp.log(weights), rollout_bounds=(None, None))
  return options | dict(getattr(algo_config, "policy_loss_options", None) or {})


def policy_loss_fn(model, train_example, algo_config, pad_id, eos_id, head: Head | None = None,
                   **kwargs):  # fmt: skip
  """Tunix's policy loss signature; :func:`kldiv_jax.fused_policy_loss` inside.

  Registered as ``"kldiv_jax"``: ``GRPOConfig(policy_loss_fn="kldiv_jax", ...)`` or
  :class:`PolicyLossConfig`. Returns ``(loss, aux)`` with Tunix's metric names.
  """
  del kwargs
  ex = train_example
  options = policy_loss_options(algo_config, ex)
  hidden, ids = completion_states(
    model, ex.prompt_ids, ex.completion_ids, pad_id, eos_id,
    segment_ids=ex.segment_ids, segment_positions=ex.segment_positions,
  )  # fmt: skip
  head = lm_head(model) if head is None else head
  h, w = linear_inputs(hidden, head)
  loss, m = fused_policy_loss(
    h, w, ids, ex.old_per_token_logps, ex.advantages, bias=head.bias, softcap=head.softcap,
    **options,
  )  # fmt: skip
  aux = {
    "pg_loss": m.pg_loss,
    "pg_clipfrac": m.clip_low + m.clip_high,
    "pg_clipfrac_lower": m.clip_dual,
    "ppo_kl": m.approx_kl,
    "kl": m.kl,
    "entropy": m.entropy,
    "loss/entropy": m.entropy,  # the name Tunix's "ppo" loss logs it under
    "is_ratio/mean": m.ratio_mean,
    "is_ratio/min": m.ratio_min,
    "is_ratio/max": m.ratio_max,
  }
  return loss, aux


function_registry.register_policy_loss_fn(NAME)(policy_loss_fn)
