"""GRPO from scratch: a small transformer learns to reverse digit strings from a verifiable reward.

The task: a prompt of ``L`` random digits and a separator, e.g. ``3 9 0 4 |``;
the model writes ``L`` digits and earns the fraction of them that match the
reversed prompt (``4 0 9 3``: reward 1; ``4 0 3 3``: reward 0.75). Nothing is
supervised: the model starts from random weights and learns from its own
samples alone (pure RL, no warm-up).

One GRPO step, as verl and TRL run it:

1. sample ``G`` completions for each of ``P`` prompts from the current policy
   (temperature 1), score them, and normalise the rewards within each group
   (``A = (r - mean) / (std + eps)``, one advantage per completion);
2. record the sampling policy's per-token log-probs (``old_log_probs``) and
   the frozen reference model's (here: the initial, random model);
3. take ``mu`` Adam steps on the batch, each on ``kldiv_jax.policy_loss``:
   PPO's clipped surrogate (``eps = 0.2``) plus ``beta`` times the KL
   estimate to the reference, token-mean aggregated. The estimate is
   ``"k3+"`` (verl's): GRPO's ``k3`` value with ``k2``'s gradient, whose
   expectation is the KL's; plain ``k3``'s ``exp`` blows up on the rare
   tokens a sharp policy still samples (``--kl-estimator k3`` to see it).

The per-token log-probs and entropy come from
``kldiv_jax.token_log_probs(logits, ids, return_entropy=True)``;
``--fused`` computes the same loss from the final hidden states and the LM
head with ``kldiv_jax.fused_policy_loss`` (no ``[tokens, vocab]`` logits), where
the installed kldiv_jax has it.

The same run is made twice, with the KL penalty (``--beta``, default 0.3) and
without (``beta = 0``), from the same initial weights and seeds; the script
prints a table (reward and exact-match accuracy of greedy decoding on fresh
prompts; the exact per-token KL(policy || reference) and the policy's entropy
there) and saves the reward and KL curves as a PNG. ``--quick`` (the CI smoke
run) trains a tiny model for a few steps.

Run:  python examples/grpo_digits.py [--quick] [--steps 300 --beta 0.3 --kl-estimator k3+ --fused]
"""

import argparse
import dataclasses
import math
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from tqdm import tqdm

import kldiv_jax

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after choosing the backend

Array = jax.Array
Params = dict[str, Any]

DEFAULT_OUT = Path(__file__).resolve().parent / "output" / "grpo_digits.png"
SEPARATOR = 10  # token ids 0-9 are the digits
VOCAB = 11


@dataclasses.dataclass(frozen=True)
class Config:
  digits: int = 4  # L: prompt and completion length
  d_model: int = 64
  n_layers: int = 2
  n_heads: int = 4
  prompts: int = 32  # P prompts per step
  group: int = 8  # G completions per prompt
  steps: int = 300
  updates_per_batch: int = 2  # mu: policy updates on each sampled batch (ratios != 1 from the 2nd)
  learning_rate: float = 3e-3
  clip: float = 0.2
  eval_batches: int = 4  # of P * G fresh prompts


QUICK = Config(d_model=16, n_layers=1, n_heads=2, prompts=8, group=4, steps=6, eval_batches=1)


# --- model: a decoder-only transformer in plain JAX ----------------------------------------------


def init_params(rng: np.random.Generator, cfg: Config) -> Params:
  """GPT-2-style initial parameters; the LM head ``[d_model, vocab]`` is not tied."""
  d, h = cfg.d_model, cfg.n_heads

  def normal(*shape: int, std: float = 0.02) -> np.ndarray:
    return std * rng.standard_normal(shape, np.float32)

  def layer_norm() -> Params:
    return {"scale": np.ones(d, np.float32), "bias": np.zeros(d, np.float32)}

  residual_std = 0.02 / math.sqrt(2 * cfg.n_layers)
  layers = [
    {
      "ln1": layer_norm(),
      "qkv": normal(d, 3, h, d // h),
      "proj": normal(h, d // h, d, std=residual_std),
      "ln2": layer_norm(),
      "up": normal(d, 4 * d),
      "down": normal(4 * d, d, std=residual_std),
    }
    for _ in range(cfg.n_layers)
  ]
  params = {
    "embed": normal(VOCAB, d),
    "pos": normal(2 * cfg.digits + 1, d, std=0.01),
    "layers": layers,
    "ln_final": layer_norm(),
    "head": normal(d, VOCAB),
  }
  return jax.tree.map(jnp.asarray, params)


def layer_norm(x: Array, p: Params) -> Array:
  mean = x.mean(-1, keepdims=True)
  var = jnp.square(x - mean).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def hidden_states(params: Params, tokens: Array) -> Array:
  """The final (layer-normed) hidden states ``[batch, seq, d_model]``; logits are ``@ head``."""
  seq = tokens.shape[-1]
  x = params["embed"][tokens] + params["pos"][:seq]
  causal = jnp.tril(jnp.ones((seq, seq), bool))
  for layer in params["layers"]:
    h = layer_norm(x, layer["ln1"])
    q, k, v = jnp.einsum("bsd,dthe->tbshe", h, layer["qkv"])
    scores = jnp.einsum("bqhe,bkhe->bhqk", q, k) / math.sqrt(q.shape[-1])
    attention = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    x = x + jnp.einsum("bhqk,bkhe,hed->bqd", attention, v, layer["proj"])
    x = x + jax.nn.gelu(layer_norm(x, layer["ln2"]) @ layer["up"]) @ layer["down"]
  return layer_norm(x, params["ln_final"])


def completion_hidden(params: Params, tokens: Array, digits: int) -> Array:
  """The hidden states that predict the completion's ``L`` tokens (positions ``L .. 2L-1``)."""
  return hidden_states(params, tokens[:, :-1])[:, digits:]


# --- rollouts and rewards ------------------------------------------------------------------------


def generate(params: Params, prompts: Array, key: Array, digits: int, greedy: Array | bool = False):
  """Completes ``[n, L]`` prompts: ``[n, 2L+1]`` tokens (prompt, separator, completion);
  sampled at temperature 1, or greedy.

  A full causal forward per new token (the model and the sequences are tiny), in a
  ``fori_loop`` so that the forward is compiled once.
  """
  n = prompts.shape[0]
  tokens = jnp.concatenate(
    [prompts, jnp.full((n, 1), SEPARATOR), jnp.zeros((n, digits), prompts.dtype)], axis=1
  )

  def step(i, carry):
    tokens, key = carry
    position = digits + i  # the hidden state that predicts token position + 1
    hidden = jax.lax.dynamic_index_in_dim(hidden_states(params, tokens[:, :-1]), position, 1, False)
    logits = hidden @ params["head"]
    key, sub = jax.random.split(key)
    nxt = jnp.where(greedy, jnp.argmax(logits, -1), jax.random.categorical(sub, logits))
    tokens = jax.lax.dynamic_update_index_in_dim(tokens, nxt.astype(tokens.dtype), position + 1, 1)
    return tokens, key

  return jax.lax.fori_loop(0, digits, step, (tokens, key))[0]


def rewards(tokens: Array, digits: int) -> Array:
  """The fraction of completion digits equal to the reversed prompt's (a verifiable reward)."""
  target = tokens[:, :digits][:, ::-1]
  return jnp.mean(tokens[:, digits + 1 :] == target, axis=-1, dtype=jnp.float32)


def group_advantages(r: Array, group: int, eps: float = 1e-6) -> Array:
  """GRPO's advantages: rewards normalised within each prompt's group of ``G`` completions."""
  g = r.reshape(-1, group)
  return ((g - g.mean(-1, keepdims=True)) / (g.std(-1, ddof=1, keepdims=True) + eps)).reshape(-1)


# --- the loss: one function, materialised logits or fused from the LM head -----------------------


def policy_objective(
  params: Params,
  tokens: Array,
  old_log_probs: Array,
  ref_log_probs: Array,
  advantages: Array,
  beta: Array,
  *,
  digits: int,
  clip: float,
  kl_estimator: str,
  fused: bool,
):
  """GRPO's loss on one batch: clipped surrogate + beta * KL estimate to the reference,
  token-mean (as TRL's ``dapo`` and verl's default)."""
  hidden = completion_hidden(params, tokens, digits)
  completion = tokens[:, digits + 1 :]
  options = dict(clip_low=clip, ref_log_probs=ref_log_probs, beta=beta, kl_estimator=kl_estimator)
  if fused:
    fused_loss: Callable | None = getattr(kldiv_jax, "fused_policy_loss", None)
    if fused_loss is None:
      # TODO: wire kldiv_jax.fused_policy_loss(hidden, weight, token_ids, old_log_probs,
      # advantages, *, ...) once it lands; it takes the same options as policy_loss.
      raise NotImplementedError("--fused needs kldiv_jax.fused_policy_loss (not in this version)")
    return fused_loss(hidden, params["head"], completion, old_log_probs, advantages, **options)
  log_probs, entropy = kldiv_jax.token_log_probs(
    hidden @ params["head"], completion, return_entropy=True
  )
  return kldiv_jax.policy_loss(log_probs, old_log_probs, advantages, entropy=entropy, **options)


@partial(jax.jit, static_argnames=("digits", "group"))
def rollout(params, ref_params, prompts, key, greedy, *, digits: int, group: int):
  """Steps 1-2 of GRPO: ``G`` samples a prompt (or greedy completions), their rewards and
  advantages, the sampling policy's and the reference's per-token log-probs; for the record,
  the mean reward, the fraction all right, and the exact KL(policy || reference) and entropy per
  token (over the whole vocabulary, at
  the sampled prefixes). The evaluation reuses it (the same shapes: no second compilation)."""
  tokens = generate(params, prompts, key, digits, greedy)
  r = rewards(tokens, digits)
  completion = tokens[:, digits + 1 :]
  logits = completion_hidden(params, tokens, digits) @ params["head"]
  old_log_probs, entropy = kldiv_jax.token_log_probs(logits, completion, return_entropy=True)
  ref_logits = completion_hidden(ref_params, tokens, digits) @ ref_params["head"]
  ref_log_probs = kldiv_jax.token_log_probs(ref_logits, completion)
  kl = kldiv_jax.kl_div_from_logits(logits, ref_logits, direction="reverse")
  record = jnp.stack([r.mean(), jnp.mean(r == 1.0), kl.mean(), entropy.mean()])
  return tokens, group_advantages(r, group), old_log_probs, ref_log_probs, record


def make_update(
  cfg: Config, optimizer: optax.GradientTransformation, kl_estimator: str, fused: bool
):
  loss_fn = partial(
    policy_objective, digits=cfg.digits, clip=cfg.clip, kl_estimator=kl_estimator, fused=fused
  )

  @jax.jit
  def update(params, opt_state, tokens, old_log_probs, ref_log_probs, advantages, beta):
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (_, metrics), grads = grad_fn(params, tokens, old_log_probs, ref_log_probs, advantages, beta)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, metrics

  return update


# --- evaluation ----------------------------------------------------------------------------------


def evaluate(params: Params, ref_params: Params, cfg: Config, seed: int) -> dict[str, float]:
  """On fresh prompts: the sampled completions' reward, the greedy ones' exact match, and the
  exact per-token KL(policy || reference) and entropy."""
  rng = np.random.default_rng(seed)
  key = jax.random.key(seed)
  totals = np.zeros(4)
  for _ in range(cfg.eval_batches):
    prompts = jnp.asarray(rng.integers(0, 10, (cfg.prompts * cfg.group, cfg.digits)), jnp.int32)
    run = partial(rollout, params, ref_params, prompts, key, digits=cfg.digits, group=cfg.group)
    reward, _, kl, entropy = run(False)[-1].tolist()
    exact = run(True)[-1][1]  # greedy decoding: the fraction with every digit right
    totals += [reward, float(exact), kl, entropy]
  return dict(zip(("reward", "exact", "kl", "entropy"), (totals / cfg.eval_batches).tolist()))


# --- training ------------------------------------------------------------------------------------


def train(cfg: Config, beta: float, seed: int, update: Callable, label: str):
  """One GRPO run from the seed's initial weights; returns its history and final evaluation."""
  params = init_params(np.random.default_rng(seed), cfg)
  ref_params = params  # the frozen reference: the initial model
  opt_state = optax.adam(cfg.learning_rate).init(params)
  rng = np.random.default_rng(seed + 1)
  key = jax.random.key(seed + 2)
  beta_arr = jnp.asarray(beta, jnp.float32)  # traced: both runs share one compilation
  history = {"reward": [], "kl": [], "entropy": [], "clip": []}
  bar = tqdm(range(cfg.steps), desc=label, unit="step")
  for _ in bar:
    prompts = rng.integers(0, 10, (cfg.prompts, cfg.digits))
    prompts = jnp.asarray(np.repeat(prompts, cfg.group, axis=0), jnp.int32)  # G per prompt
    key, sub = jax.random.split(key)
    tokens, advantages, old_log_probs, ref_log_probs, record = rollout(
      params, ref_params, prompts, sub, False, digits=cfg.digits, group=cfg.group
    )
    for _ in range(cfg.updates_per_batch):
      params, opt_state, metrics = update(
        params, opt_state, tokens, old_log_probs, ref_log_probs, advantages, beta_arr
      )
    reward, _, kl, entropy = record.tolist()
    history["reward"].append(reward)
    history["kl"].append(kl)  # exact; metrics.kl is the loss's estimate on the samples
    history["entropy"].append(entropy)
    history["clip"].append(float(metrics.clip_low + metrics.clip_high))
    bar.set_postfix(reward=f"{history['reward'][-1]:.3f}", kl=f"{history['kl'][-1]:.3f}")
  return history, evaluate(params, ref_params, cfg, seed + 3)


def smooth(x: list[float], window: int) -> np.ndarray:
  window = max(1, min(window, len(x)))
  return np.convolve(x, np.ones(window) / window, mode="valid")


def plot(histories: dict[str, dict[str, list[float]]], out: Path) -> None:
  fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
  for label, h in histories.items():
    window = max(1, len(h["reward"]) // 30)
    steps = np.arange(len(smooth(h["reward"], window))) + window
    axes[0].plot(steps, smooth(h["reward"], window), label=label)
    axes[1].plot(steps, smooth(h["kl"], window), label=label)
  axes[0].set(xlabel="GRPO step", ylabel="mean reward (sampled)", title="reward")
  axes[1].set(xlabel="GRPO step", ylabel="KL(policy || initial model)", title="KL per token")
  for ax in axes:
    ax.grid(alpha=0.3)
    ax.legend()
  fig.tight_layout()
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=80)
  plt.close(fig)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="a tiny model for a few steps (CI)")
  parser.add_argument("--steps", type=int, default=None)
  parser.add_argument("--beta", type=float, default=0.3, help="the KL penalty's coefficient")
  parser.add_argument(
    "--kl-estimator",
    default="k3+",
    choices=["k1", "k2", "k3", "k1+", "k2+", "k3+"],
    help="k3+ (verl's): k3's value, k2's gradient; plain k3's exp blows up on rare tokens",
  )
  parser.add_argument("--fused", action="store_true", help="kldiv_jax.fused_policy_loss")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
  args = parser.parse_args()
  cfg = QUICK if args.quick else Config()
  if args.steps is not None:
    cfg = dataclasses.replace(cfg, steps=args.steps)
  print(
    f"task: reverse {cfg.digits} digits; model: {cfg.n_layers} layers, d={cfg.d_model}; "
    f"{cfg.steps} steps of {cfg.prompts} prompts x {cfg.group} samples, mu={cfg.updates_per_batch}; "
    f"KL: {args.kl_estimator} to the initial model"
  )
  start = time.perf_counter()
  optimizer = optax.adam(cfg.learning_rate)
  update = make_update(cfg, optimizer, args.kl_estimator, args.fused)  # beta traced: one compile
  histories, finals = {}, {}
  for beta in (args.beta, 0.0):
    label = f"beta={beta:g}"
    histories[label], finals[label] = train(cfg, beta, args.seed, update, label)
  elapsed = time.perf_counter() - start
  plot(histories, args.out)
  print()
  header = f"{'run':<12}{'reward':>8}{'exact':>8}{'KL(pi||ref)':>13}{'entropy':>9}"
  print(header)
  print("-" * len(header))
  for label, f in finals.items():
    print(f"{label:<12}{f['reward']:>8.3f}{f['exact']:>8.3f}{f['kl']:>13.3f}{f['entropy']:>9.3f}")
  print(f"\n{len(finals)} runs in {elapsed:.0f} s; curves saved to {args.out}")


if __name__ == "__main__":
  main()
