"""kldiv_jax: Kullback-Leibler divergence losses for JAX.

torch-parity ``kl_div``/``KLDivLoss``, Optax-compatible per-example losses,
with finite values and gradients at zero-probability targets.
"""

import importlib.metadata as _metadata

from kldiv_jax._alignment import align_tokens as align_tokens
from kldiv_jax._alignment import matched_vocabulary as matched_vocabulary
from kldiv_jax._distill import DistillationParts as DistillationParts
from kldiv_jax._distill import distillation_loss as distillation_loss
from kldiv_jax._divergence_api import divergence_from_logits as divergence_from_logits
from kldiv_jax._divergence_spec import Divergence as Divergence
from kldiv_jax._fused_distill import fused_distillation_loss as fused_distillation_loss
from kldiv_jax._fused_distill import fused_topk_distillation_loss as fused_topk_distillation_loss
from kldiv_jax._fused_tokens import fused_token_log_probs as fused_token_log_probs
from kldiv_jax._fused_uld import fused_uld_loss_from_topk as fused_uld_loss_from_topk
from kldiv_jax._gaussian import gaussian_kl as gaussian_kl
from kldiv_jax._gold import gold_loss as gold_loss
from kldiv_jax._implementation import set_implementation as set_implementation
from kldiv_jax._labels import shift_labels as shift_labels
from kldiv_jax._logits import generalized_jsd as generalized_jsd
from kldiv_jax._logits import kl_div_from_logits as kl_div_from_logits
from kldiv_jax._metric import DivergenceMetric as DivergenceMetric
from kldiv_jax._optax import convex_kl_divergence as convex_kl_divergence
from kldiv_jax._optax import generalized_kl_divergence as generalized_kl_divergence
from kldiv_jax._optax import kl_divergence as kl_divergence
from kldiv_jax._optax import kl_divergence_with_log_targets as kl_divergence_with_log_targets
from kldiv_jax._pointwise import kl_div_pointwise as kl_div_pointwise
from kldiv_jax._policy import fused_policy_loss as fused_policy_loss
from kldiv_jax._policy import policy_loss as policy_loss
from kldiv_jax._rl import distillation_advantages as distillation_advantages
from kldiv_jax._rl import kl_estimate as kl_estimate
from kldiv_jax._rl import sequence_mean as sequence_mean
from kldiv_jax._rl import sequence_sum as sequence_sum
from kldiv_jax._rl import token_log_probs as token_log_probs
from kldiv_jax._rollout_rejection import rollout_rejection_mask as rollout_rejection_mask
from kldiv_jax._surrogates import PolicyMetrics as PolicyMetrics
from kldiv_jax._topk import divergence_from_topk as divergence_from_topk
from kldiv_jax._topk import kl_div_from_topk as kl_div_from_topk
from kldiv_jax._torch import KLDivLoss as KLDivLoss
from kldiv_jax._torch import kl_div as kl_div
from kldiv_jax._uld import merge_spans as merge_spans
from kldiv_jax._uld import uld_loss as uld_loss
from kldiv_jax._uld_topk import uld_loss_from_topk as uld_loss_from_topk

try:
  __version__ = _metadata.version("kldiv_jax")
except _metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
  __version__ = "0.0.0"
del _metadata  # dir(kldiv_jax): the public names, dunders and the private modules only

__all__ = [
  "DistillationParts",
  "Divergence",
  "DivergenceMetric",
  "KLDivLoss",
  "PolicyMetrics",
  "align_tokens",
  "convex_kl_divergence",
  "distillation_advantages",
  "distillation_loss",
  "divergence_from_logits",
  "divergence_from_topk",
  "fused_distillation_loss",
  "fused_policy_loss",
  "fused_token_log_probs",
  "fused_topk_distillation_loss",
  "fused_uld_loss_from_topk",
  "gaussian_kl",
  "generalized_jsd",
  "generalized_kl_divergence",
  "gold_loss",
  "kl_div",
  "kl_div_from_logits",
  "kl_div_from_topk",
  "kl_div_pointwise",
  "kl_divergence",
  "kl_divergence_with_log_targets",
  "kl_estimate",
  "matched_vocabulary",
  "merge_spans",
  "policy_loss",
  "rollout_rejection_mask",
  "sequence_mean",
  "sequence_sum",
  "set_implementation",
  "shift_labels",
  "token_log_probs",
  "uld_loss",
  "uld_loss_from_topk",
]
