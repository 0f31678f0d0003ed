"""Sampled tokens' log-probabilities and entropy for RL: from logits and from the LM head.

Each figure is a ratio of two contenders measured side by side in one process
(``benchmarks/README.md`` lists them): ``logits`` (``token_log_probs`` against
``log_softmax`` + gather + entropy), ``tunix`` (with a k3 penalty, against Tunix's
``selective_log_softmax`` and ``compute_kl_divergence(method="low_var_kl")`` of
``tunix/rl/common.py``, github.com/google/tunix, ported verbatim), ``fused``
(``fused_token_log_probs`` against the materialised logits) and ``policy``
(``fused_policy_loss``, clip-higher PPO with an entropy bonus, against ``policy_loss`` of the
materialised logits and against ``fused_token_log_probs`` + ``policy_loss``; time at the
memory shape with ``--policy-full-time``). The targets are the ``TARGETS`` table.
``--quick``: small shapes, a smoke test.
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from _harness import (
  f32,
  grad_memory,
  parser,
  print_memory,
  print_targets,
  print_times,
  ratio_targets,
  save,
  start,
  time_grads,
)

import kldiv_jax

LOGITS_SHAPE, QUICK_LOGITS_SHAPE = (4096, 8192), (256, 1024)
FUSED_MEMORY_SHAPE, QUICK_FUSED_MEMORY_SHAPE = (8192, 1024, 65536), (512, 64, 4096)
FUSED_TIME_SHAPE, QUICK_FUSED_TIME_SHAPE = (2048, 1024, 32768), (128, 32, 1024)
TUNIX_SHAPE, QUICK_TUNIX_SHAPE = (2048, 32768), (128, 4096)
EPS_LOW, EPS_HIGH, ENTROPY_COEF = 0.2, 0.28, 0.01

# (target, limit, a, b): a's time over b's (their compiled temp bytes where it says temp).
TARGETS = (
  ("token_log_probs time / log_softmax (logits)", 0.6, "token_log_probs", "log_softmax"),
  ("token_log_probs + k3 time / Tunix (no entropy)", 1.0, "token_log_probs + k3", "Tunix"),
  ("fused temp / log_softmax + gather", 0.05, "fused", "log_softmax + gather"),
  ("fused time / materialised", 1.1, "fused", "materialised"),
  ("fused policy temp / materialised policy", 0.05, "fused policy", "materialised policy"),
  ("fused policy time / materialised policy", 1.05, "fused policy", "materialised policy"),
)


def straightforward(logits, ids):
  """log_softmax + gather + entropy, as RL code writes them."""
  lp = jax.nn.log_softmax(logits)
  picked = jnp.take_along_axis(lp, ids[:, None], axis=-1)[:, 0]
  entropy = -jnp.sum(jnp.exp(lp) * lp, axis=-1)
  return jnp.sum(picked) + 0.01 * jnp.sum(entropy)


def ours(logits, ids):
  lp, entropy = kldiv_jax.token_log_probs(logits, ids, return_entropy=True)
  return jnp.sum(lp) + 0.01 * jnp.sum(entropy)


def tunix_selective_log_softmax(logits, input_ids):
  """Tunix's ``selective_log_softmax`` (``tunix/rl/common.py``), verbatim."""
  target_logits = (
    jnp.take_along_axis(logits, input_ids[..., None], axis=-1).squeeze(-1).astype(jnp.float32)
  )
  normalizer = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
  return target_logits - normalizer


def tunix_low_var_kl(per_token_logps, ref_per_token_logps):
  """Tunix's ``compute_kl_divergence(method="low_var_kl")`` (``tunix/rl/common.py``)."""
  per_token_logps = per_token_logps.astype(jnp.float32)
  ref_per_token_logps = ref_per_token_logps.astype(jnp.float32)
  diff = ref_per_token_logps - per_token_logps
  return jnp.exp(diff) - diff - 1


def tunix(logits, ids, ref_lp):
  return jnp.sum(tunix_low_var_kl(tunix_selective_log_softmax(logits, ids), ref_lp))


def ours_k3(logits, ids, ref_lp):
  lp = kldiv_jax.token_log_probs(logits, ids)
  return jnp.sum(kldiv_jax.kl_estimate(lp, ref_lp, estimator="k3"))


def fused(h, w, ids):
  lp, entropy = kldiv_jax.fused_token_log_probs(h, w, ids, return_entropy=True)
  return jnp.sum(lp) + 0.01 * jnp.sum(entropy)


def materialised(h, w, ids):
  return ours(h @ w, ids)


def materialised_plain(h, w, ids):
  lp = jax.nn.log_softmax(h @ w)
  return jnp.sum(jnp.take_along_axis(lp, ids[:, None], axis=-1))


POLICY_OPTIONS = dict(clip_low=EPS_LOW, clip_high=EPS_HIGH, entropy_coef=ENTROPY_COEF)


def policy_fused(h, w, ids, old, adv):
  return kldiv_jax.fused_policy_loss(h, w, ids, old, adv, **POLICY_OPTIONS)[0]


def policy_materialised(h, w, ids, old, adv):
  lp, entropy = kldiv_jax.token_log_probs(h @ w, ids, return_entropy=True)
  return kldiv_jax.policy_loss(lp, old, adv, entropy=entropy, **POLICY_OPTIONS)[0]


def policy_token_log_probs(h, w, ids, old, adv):
  lp, entropy = kldiv_jax.fused_token_log_probs(h, w, ids, return_entropy=True)
  return kldiv_jax.policy_loss(lp, old, adv, entropy=entropy, **POLICY_OPTIONS)[0]


POLICY = {
  "fused policy": policy_fused,
  "materialised policy": policy_materialised,
  "fused_token_log_probs policy": policy_token_log_probs,
}


def head(k, shape):
  """Hidden states ``N(0, 1)``, a head ``N(0, 4 / H)`` and token ids."""
  n, hd, v = shape
  h = jax.random.normal(k[0], (n, hd))
  return h, jax.random.normal(k[1], (hd, v)) / hd**0.5 * 2, jax.random.randint(k[2], (n,), 0, v)


def main(argv: Sequence[str] | None = None) -> int:
  p = parser(__doc__, repeats="timed calls per contender (default 5)")
  p.add_argument(
    "--policy-full-time",
    action="store_true",
    help="time the policy losses at N=8192, H=1024, V=65536 (minutes per call on 2 cores)",
  )
  args = p.parse_args(argv)
  q, repeats = args.quick, args.repeats or 5
  machine = start("rl")
  k = jax.random.split(jax.random.key(0), 3)
  n, v = QUICK_LOGITS_SHAPE if q else LOGITS_SHAPE
  logits = 3 * jax.random.normal(k[0], (n, v))
  ids = jax.random.randint(k[1], (n,), 0, v)
  fns = {"token_log_probs": ours, "log_softmax": straightforward}
  logits_times = time_grads(fns, (logits, ids), repeats)
  n, v = QUICK_TUNIX_SHAPE if q else TUNIX_SHAPE
  logits = 3 * jax.random.normal(k[0], (n, v))
  ids = jax.random.randint(k[1], (n,), 0, v)
  # The reference policy's log-probabilities: those of nearby logits (a fixed input).
  ref_lp = tunix_selective_log_softmax(logits + 0.3 * jax.random.normal(k[2], (n, v)), ids)
  fns = {"token_log_probs + k3": ours_k3, "Tunix": tunix}
  tunix_times = time_grads(fns, (logits, ids, ref_lp), 2 * repeats)
  del logits, ref_lp
  time_shape = QUICK_FUSED_TIME_SHAPE if q else FUSED_TIME_SHAPE
  fns = {"fused": fused, "materialised": materialised}
  fused_times = time_grads(fns, head(k, time_shape), max(3, repeats // 2), (0, 1))
  n, hd, v = memory_shape = QUICK_FUSED_MEMORY_SHAPE if q else FUSED_MEMORY_SHAPE
  abstract = (f32(n, hd), f32(hd, v), jax.ShapeDtypeStruct((n,), jnp.int32))
  memory = {
    "fused": grad_memory(fused, *abstract, argnums=(0, 1)),
    "log_softmax + gather": grad_memory(materialised_plain, *abstract, argnums=(0, 1)),
  }
  for name, fn in POLICY.items():
    memory[name] = grad_memory(fn, *abstract, f32(n), f32(n), argnums=(0, 1))
  policy_shape = memory_shape if args.policy_full_time else time_shape
  h, w, ids = head(k, policy_shape)
  lp = kldiv_jax.token_log_probs(h @ w, ids)  # old log-probs near the policy's: ratios near 1
  old = lp + 0.1 * jax.random.normal(k[0], (policy_shape[0],))
  adv = jax.random.normal(k[1], (policy_shape[0],))
  del lp
  policy_times = time_grads(POLICY, (h, w, ids, old, adv), max(3, repeats // 2), (0, 1))
  times = logits_times | tunix_times | fused_times | policy_times
  targets = ratio_targets(TARGETS, times, memory)
  print_times(
    f"\nvalue_and_grad time, median of {repeats} (round-robin)",
    logits_times | tunix_times | fused_times,
  )
  print_times("policy losses, N={} H={} V={}:".format(*policy_shape), policy_times)
  print_memory("\ncompiled temp, N={} H={} V={}:".format(*memory_shape), memory)
  print_targets(targets, q)
  result = {"section": "rl", "machine": machine, "settings": {"quick": q, "repeats": repeats}}
  result |= {"logits_times": logits_times, "tunix_times": tunix_times, "fused_times": fused_times}
  result |= {"policy_times": policy_times, "policy_time_shape": list(policy_shape)}
  save(
    result | {"memory_shape": list(memory_shape), "memory": memory, "targets": targets}, args.out
  )
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
