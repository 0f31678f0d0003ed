"""kldiv_jax inside Tunix: the fused losses from the model's hidden states, never its logits.

``import kldiv_jax.tunix`` (``pip install 'kldiv_jax[tunix]'``) registers the policy loss
``"kldiv_jax"`` with Tunix; ``import kldiv_jax`` alone imports neither Tunix nor Flax.
Guide: :doc:`/tunix`.

- RL: ``GRPOConfig(policy_loss_fn="kldiv_jax", ...)`` or :class:`PolicyLossConfig`
  (:func:`kldiv_jax.fused_policy_loss`), and :func:`use_fused_log_probs` for the rollout,
  old-policy and reference log-probs (:func:`kldiv_jax.fused_token_log_probs`).
- Distillation: :class:`FusedLogitStrategy` (:func:`kldiv_jax.fused_distillation_loss`) and
  :class:`FusedTopKStrategy` (:func:`kldiv_jax.fused_topk_distillation_loss`).
- Models: :func:`hidden_states` and :func:`lm_head` of every Tunix 0.1.7 family (Gemma,
  Gemma 3, Qwen 2, Qwen 3, Llama 3, Gemma 4).
"""

from kldiv_jax._tunix_distill import FusedLogitStrategy as FusedLogitStrategy
from kldiv_jax._tunix_distill import FusedTopKStrategy as FusedTopKStrategy
from kldiv_jax._tunix_distill import TeacherOutput as TeacherOutput
from kldiv_jax._tunix_distill import model_forward as model_forward
from kldiv_jax._tunix_distill import next_token_labels as next_token_labels
from kldiv_jax._tunix_distill import next_token_mask as next_token_mask
from kldiv_jax._tunix_distill import topk_teacher as topk_teacher
from kldiv_jax._tunix_models import Head as Head
from kldiv_jax._tunix_models import hidden_states as hidden_states
from kldiv_jax._tunix_models import lm_head as lm_head
from kldiv_jax._tunix_rl import MaterializedLogitsWarning as MaterializedLogitsWarning
from kldiv_jax._tunix_rl import PolicyLossConfig as PolicyLossConfig
from kldiv_jax._tunix_rl import per_token_logps as per_token_logps
from kldiv_jax._tunix_rl import policy_loss_fn as policy_loss_fn
from kldiv_jax._tunix_rl import policy_loss_options as policy_loss_options
from kldiv_jax._tunix_rl import use_fused_log_probs as use_fused_log_probs

__all__ = [
  "FusedLogitStrategy",
  "FusedTopKStrategy",
  "Head",
  "MaterializedLogitsWarning",
  "PolicyLossConfig",
  "TeacherOutput",
  "hidden_states",
  "lm_head",
  "model_forward",
  "next_token_labels",
  "next_token_mask",
  "per_token_logps",
  "policy_loss_fn",
  "policy_loss_options",
  "topk_teacher",
  "use_fused_log_probs",
]
