"""Sampled tokens' log-probabilities and entropy for RL: from logits and from the LM head.

Each figure is a ratio of two contenders measured side by side in one process,
``jax.value_and_grad`` of ``sum(log_probs) + 0.01 * sum(entropy)``:

* ``logits``: ``token_log_probs(logits, ids, return_entropy=True)`` against
  ``jax.nn.log_softmax`` + gather + the entropy ``-sum(p log p)`` with autodiff,
  wrt the logits, float32 ``(4096, 8192)``: time (jitted, round-robin median).
  Target: at most 0.6x.
* ``tunix``: the log-probabilities alone with a k3 penalty, as GRPO computes
  them: ``kl_estimate(token_log_probs(logits, ids), ref_lp, estimator="k3")``
  against Tunix's own code (``selective_log_softmax`` and
  ``compute_kl_divergence(method="low_var_kl")`` of ``tunix/rl/common.py``,
  github.com/google/tunix, ported verbatim), summed, wrt the logits, float32
  ``(2048, 32768)``: time (jitted, round-robin median of twice the repeats)
  and compiled temp. Target: at most 1.0x (no slower than what JAX users write).
* ``fused``: ``fused_token_log_probs(hidden, weight, ids, return_entropy=True)``
  against ``token_log_probs`` of the materialised ``hidden @ weight`` wrt
  hidden and weight: XLA's compiled temp memory at N=8192, H=1024, V=65536
  (target: at most 0.05x of ``log_softmax`` + gather on the materialised
  logits) and time at N=2048, H=1024, V=32768 (target: at most 1.1x).
* ``policy``: GRPO/DAPO's token-level PPO clipped surrogate (clip-higher) with
  an entropy bonus, token-mean, from the LM head: ``fused_policy_loss`` (the
  gradient computed in the forward pass, three matmuls per chunk) against
  ``policy_loss`` of the materialised logits (``hidden @ weight`` ->
  ``token_log_probs`` -> ``policy_loss``, ``value_and_grad``) and against
  ``fused_token_log_probs`` + ``policy_loss`` (four matmuls): compiled
  temp at N=8192, H=1024, V=65536 (target: at most 0.05x of the materialised
  loss's) and time at N=2048, H=1024, V=32768, or at the memory shape with
  ``--policy-full-time`` (target: at most 1.05x).

``--quick`` uses small shapes (a smoke test: the targets are not meaningful there).

  python benchmarks/bench_rl.py
  python benchmarks/bench_rl.py --quick
"""

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from _harness import (
  compile_jax,
  describe_machine,
  fmt_bytes,
  fmt_ms,
  fmt_ratio,
  machine_info,
  median_ms,
  memory_stats,
  ratio,
  round_robin,
  write_json,
)

import kldiv_jax

HERE = Path(__file__).resolve().parent
LOGITS_SHAPE, QUICK_LOGITS_SHAPE = (4096, 8192), (256, 1024)
FUSED_MEMORY_SHAPE, QUICK_FUSED_MEMORY_SHAPE = (8192, 1024, 65536), (512, 64, 4096)
FUSED_TIME_SHAPE, QUICK_FUSED_TIME_SHAPE = (2048, 1024, 32768), (128, 32, 1024)
TUNIX_SHAPE, QUICK_TUNIX_SHAPE = (2048, 32768), (128, 4096)
LOGITS_TARGET, TUNIX_TARGET, MEMORY_TARGET, TIME_TARGET = 0.6, 1.0, 0.05, 1.1
POLICY_MEMORY_TARGET, POLICY_TIME_TARGET = 0.05, 1.05
EPS_LOW, EPS_HIGH, ENTROPY_COEF = 0.2, 0.28, 0.01


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


def _time(contenders, args, repeats):
  thunks, info = {}, {}
  for name, fn in contenders.items():
    thunks[name], info[name] = compile_jax(fn, *args)
    thunks[name]()
  times = round_robin(thunks, repeats, warmup=0)
  return {n: {"median_ms": median_ms(times[n]), **info[n]} for n in contenders}


def main(argv: Sequence[str] | None = None, *, default_out: Path | None = None) -> dict[str, Any]:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--quick", action="store_true")
  p.add_argument("--repeats", type=int, default=None)
  p.add_argument("--out", type=Path, default=None)
  p.add_argument(
    "--policy-full-time",
    action="store_true",
    help="time the policy losses at N=8192, H=1024, V=65536 (minutes per call on 2 cores)",
  )
  args = p.parse_args(argv)
  q, repeats = args.quick, args.repeats or 5
  machine = machine_info()
  print(f"rl: {describe_machine(machine)}")
  k = jax.random.split(jax.random.key(0), 3)
  n, v = QUICK_LOGITS_SHAPE if q else LOGITS_SHAPE
  logits = 3 * jax.random.normal(k[0], (n, v))
  ids = jax.random.randint(k[1], (n,), 0, v)
  logits_times = _time(
    {
      "token_log_probs": jax.value_and_grad(ours),
      "log_softmax": jax.value_and_grad(straightforward),
    },
    (logits, ids),
    repeats,
  )
  n, v = QUICK_TUNIX_SHAPE if q else TUNIX_SHAPE
  logits = 3 * jax.random.normal(k[0], (n, v))
  ids = jax.random.randint(k[1], (n,), 0, v)
  # The reference policy's log-probabilities: those of nearby logits (a fixed input).
  ref_lp = tunix_selective_log_softmax(logits + 0.3 * jax.random.normal(k[2], (n, v)), ids)
  tunix_times = _time(
    {
      "token_log_probs + k3": jax.value_and_grad(ours_k3),
      "Tunix": jax.value_and_grad(tunix),
    },
    (logits, ids, ref_lp),
    2 * repeats,
  )
  del logits, ref_lp
  n, hd, v = QUICK_FUSED_TIME_SHAPE if q else FUSED_TIME_SHAPE
  h = jax.random.normal(k[0], (n, hd))
  w = jax.random.normal(k[1], (hd, v)) / hd**0.5 * 2
  ids = jax.random.randint(k[2], (n,), 0, v)
  vg = lambda fn: jax.value_and_grad(fn, argnums=(0, 1))  # noqa: E731
  fused_times = _time(
    {"fused": vg(fused), "materialised": vg(materialised)}, (h, w, ids), max(3, repeats // 2)
  )
  n, hd, v = memory_shape = QUICK_FUSED_MEMORY_SHAPE if q else FUSED_MEMORY_SHAPE
  abstract = (
    jax.ShapeDtypeStruct((n, hd), jnp.float32),
    jax.ShapeDtypeStruct((hd, v), jnp.float32),
    jax.ShapeDtypeStruct((n,), jnp.int32),
  )
  memory = {
    name: memory_stats(jax.jit(vg(fn)).lower(*abstract).compile())
    for name, fn in (("fused", fused), ("log_softmax + gather", materialised_plain))
  }
  token_floats = (jax.ShapeDtypeStruct((n,), jnp.float32),) * 2
  memory.update(
    {
      name: memory_stats(jax.jit(vg(fn)).lower(*abstract, *token_floats).compile())
      for name, fn in POLICY.items()
    }
  )
  n, hd, v = (
    (QUICK_FUSED_TIME_SHAPE if q else FUSED_TIME_SHAPE)
    if not args.policy_full_time
    else (QUICK_FUSED_MEMORY_SHAPE if q else FUSED_MEMORY_SHAPE)
  )
  h = jax.random.normal(k[0], (n, hd))
  w = jax.random.normal(k[1], (hd, v)) / hd**0.5 * 2
  ids = jax.random.randint(k[2], (n,), 0, v)
  lp = kldiv_jax.token_log_probs(h @ w, ids)  # old log-probs near the policy's: ratios near 1
  old = lp + 0.1 * jax.random.normal(k[0], (n,))
  adv = jax.random.normal(k[1], (n,))
  del lp
  policy_times = _time(
    {name: vg(fn) for name, fn in POLICY.items()}, (h, w, ids, old, adv), max(3, repeats // 2)
  )
  policy_shape = (n, hd, v)
  rows = [
    (
      "token_log_probs time / log_softmax (logits)",
      ratio(logits_times["token_log_probs"]["median_ms"], logits_times["log_softmax"]["median_ms"]),
      LOGITS_TARGET,
    ),
    (
      "token_log_probs + k3 time / Tunix (no entropy)",
      ratio(tunix_times["token_log_probs + k3"]["median_ms"], tunix_times["Tunix"]["median_ms"]),
      TUNIX_TARGET,
    ),
    (
      "fused temp / log_softmax + gather",
      ratio(memory["fused"]["temp_bytes"], memory["log_softmax + gather"]["temp_bytes"]),
      MEMORY_TARGET,
    ),
    (
      "fused time / materialised",
      ratio(fused_times["fused"]["median_ms"], fused_times["materialised"]["median_ms"]),
      TIME_TARGET,
    ),
    (
      "fused policy temp / materialised policy",
      ratio(memory["fused policy"]["temp_bytes"], memory["materialised policy"]["temp_bytes"]),
      POLICY_MEMORY_TARGET,
    ),
    (
      "fused policy time / materialised policy",
      ratio(
        policy_times["fused policy"]["median_ms"],
        policy_times["materialised policy"]["median_ms"],
      ),
      POLICY_TIME_TARGET,
    ),
  ]
  targets = [
    {"target": t, "value": val, "limit": lim, "met": None if val is None else bool(val <= lim)}
    for t, val, lim in rows
  ]
  print(f"\nvalue_and_grad time, median of {repeats} (round-robin)")
  for name, t in {**logits_times, **tunix_times, **fused_times}.items():
    print(f"  {name:28} {fmt_ms(t['median_ms']):>10} ms  temp {fmt_bytes(t['temp_bytes']):>10}")
  print(f"policy losses, N={policy_shape[0]} H={policy_shape[1]} V={policy_shape[2]}:")
  for name, t in policy_times.items():
    print(f"  {name:28} {fmt_ms(t['median_ms']):>10} ms  temp {fmt_bytes(t['temp_bytes']):>10}")
  print(f"\ncompiled temp, N={memory_shape[0]} H={memory_shape[1]} V={memory_shape[2]}:")
  for name, m in memory.items():
    print(f"  {name:28} {fmt_bytes(m['temp_bytes']):>10}")
  print("\ntargets" + (" (--quick: small shapes, not the full-size ones)" if q else ""))
  for t in targets:
    met = {True: "met", False: "MISSED", None: "-"}[t["met"]]
    print(f"  {t['target']:48} {fmt_ratio(t['value']):>6} <= {t['limit']:<5} {met}")
  result = {
    "section": "rl",
    "machine": machine,
    "settings": {"quick": q, "repeats": repeats},
    "logits_times": logits_times,
    "tunix_times": tunix_times,
    "fused_times": fused_times,
    "policy_times": policy_times,
    "policy_time_shape": list(policy_shape),
    "memory_shape": list(memory_shape),
    "memory": memory,
    "targets": targets,
  }
  out = args.out or default_out
  if out is not None:
    write_json(Path(out) / "rl.json", result)
  return result


if __name__ == "__main__":
  main(sys.argv[1:], default_out=HERE / "results")
