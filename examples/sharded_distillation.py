"""LM-style distillation on a (data, vocab) mesh of 8 simulated CPU devices.

A tiny student language model (token embedding, one dense layer, an LM head
``[H, V]``) learns to match a frozen random teacher (its own embedding and
head) on seeded random (Zipf-distributed) tokens, with Optax inside jitted train steps. The same
step runs three ways, from the same initial parameters and data:

* ``materialised``: ``jax.jit`` with ``NamedSharding`` inputs, the batch split
  over all 8 devices, the full ``[tokens, V]`` logits of both models, and
  ``kldiv_jax.distillation_loss``;
* ``fused (data)``: the same batch split, the loss from the hidden states with
  ``kldiv_jax.fused_distillation_loss`` inside ``jax.shard_map`` (logits made
  ``chunk_size`` tokens at a time, never for the whole batch);
* ``fused (data x vocab)``: tokens split over ``data`` (2) and both LM heads
  over ``vocab`` (4): ``fused_distillation_loss(..., axis_name="vocab")`` combines
  the softmax statistics of the vocabulary slices with collectives.

The three print the same losses (they are the same function), and the
per-device memory of their compiled train steps (XLA's memory analysis:
arguments, outputs, temporaries) shows where the fused and vocabulary-parallel
versions save.

Run:  python examples/sharded_distillation.py [--steps 8 --vocab 8192 --batch 8 --seq 64]
"""

import os

# Eight simulated CPU devices, unless the caller chose a device count already.
# (Must happen before JAX starts.)
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import kldiv_jax

Params = dict[str, jax.Array]


def init_student(key: jax.Array, vocab: int, embed: int, hidden: int) -> Params:
  k1, k2, k3 = jax.random.split(key, 3)
  return {
    "embed": jax.random.normal(k1, (vocab, embed)) * 0.1,
    "dense": jax.random.normal(k2, (embed, hidden)) / np.sqrt(embed),
    "dense_bias": jnp.zeros((hidden,)),
    "head": jax.random.normal(k3, (hidden, vocab)) / np.sqrt(hidden),
  }


def init_teacher(key: jax.Array, vocab: int, hidden: int) -> Params:
  k1, k2 = jax.random.split(key)
  return {
    "embed": jax.random.normal(k1, (vocab, hidden)),
    # Peaked next-token distributions: logits of a few units.
    "head": jax.random.normal(k2, (hidden, vocab)) * (3.0 / np.sqrt(hidden)),
  }


def student_hidden(params: Params, tokens: jax.Array) -> jax.Array:
  """``[batch, seq]`` token ids to ``[batch, seq, hidden]`` hidden states."""
  x = jnp.take(params["embed"], tokens, axis=0)
  return jnp.tanh(x @ params["dense"] + params["dense_bias"][None, None, :])


def teacher_hidden(teacher: Params, tokens: jax.Array) -> jax.Array:
  return jnp.tanh(jnp.take(teacher["embed"], tokens, axis=0))


def make_losses(mesh: jax.sharding.Mesh, temperature: float) -> dict[str, Callable[..., Any]]:
  """The three versions of ``loss(params, teacher, tokens)``."""

  def materialised(params, teacher, tokens):
    logits = student_hidden(params, tokens) @ params["head"]
    target = jax.lax.stop_gradient(teacher_hidden(teacher, tokens) @ teacher["head"])
    return kldiv_jax.distillation_loss(logits, target, temperature=temperature)

  def fused_over(token_axes, vocab_axis):
    head_spec = P(None, vocab_axis)
    token_spec = P(token_axes, None, None)

    def local(h, w, th, tw, count):
      # Each device: its tokens (and its vocabulary slice); the global token
      # count as normalizer, so the sum over the token axes is the mean.
      loss = kldiv_jax.fused_distillation_loss(
        h, w, th, tw, temperature=temperature, normalizer=count, axis_name=vocab_axis
      )
      return jax.lax.psum(loss, token_axes)

    sharded = jax.shard_map(
      local,
      mesh=mesh,
      in_specs=(token_spec, head_spec, token_spec, head_spec, P()),
      out_specs=P(),
    )

    def loss(params, teacher, tokens):
      th = jax.lax.stop_gradient(teacher_hidden(teacher, tokens))
      count = jnp.asarray(tokens.size, jnp.float32)
      return sharded(student_hidden(params, tokens), params["head"], th, teacher["head"], count)

    return loss

  return {
    "materialised": materialised,
    "fused (data)": fused_over(("data", "vocab"), None),
    "fused (data x vocab)": fused_over("data", "vocab"),
  }


def shardings(mesh, name: str, params: Params, teacher: Params):
  """Where each version keeps the parameters and the batch."""
  replicated = NamedSharding(mesh, P())
  if name == "fused (data x vocab)":
    head = NamedSharding(mesh, P(None, "vocab"))
    batch = NamedSharding(mesh, P("data", None))
  else:
    head = replicated
    batch = NamedSharding(mesh, P(("data", "vocab"), None))
  p = {k: head if k == "head" else replicated for k in params}
  t = {k: head if k == "head" else replicated for k in teacher}
  return p, t, batch


def memory(compiled) -> dict[str, int]:
  stats = compiled.memory_analysis()
  return {
    "arguments": int(stats.argument_size_in_bytes),
    "outputs": int(stats.output_size_in_bytes),
    "temporaries": int(stats.temp_size_in_bytes),
  }


def mib(n: int) -> str:
  return f"{n / 2**20:8.2f} MiB"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=8)
  p.add_argument("--batch", type=int, default=8, help="sequences per step")
  p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
  p.add_argument("--vocab", type=int, default=8192)
  p.add_argument("--hidden", type=int, default=128, help="student's and teacher's hidden size")
  p.add_argument("--embed", type=int, default=64)
  p.add_argument("--temperature", type=float, default=2.0)
  p.add_argument("--learning-rate", type=float, default=3e-2)
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)

  if jax.device_count() < 8:
    raise SystemExit(
      f"sharded_distillation: needs 8 devices, found {jax.device_count()} "
      "(XLA_FLAGS=--xla_force_host_platform_device_count=8)."
    )
  # Auto axes: XLA's partitioner propagates the shardings of the inputs.
  mesh = jax.make_mesh(
    (2, 4),
    ("data", "vocab"),
    devices=jax.devices()[:8],
    axis_types=(jax.sharding.AxisType.Auto,) * 2,
  )
  print(
    f"mesh {dict(mesh.shape)} of {jax.devices()[0].platform} devices; "
    f"batch {args.batch}x{args.seq} tokens, vocab {args.vocab}, hidden {args.hidden}, "
    f"T={args.temperature}"
  )

  k_student, k_teacher, k_data = jax.random.split(jax.random.key(args.seed), 3)
  # On the host: each version puts its own copy on the devices (the train step
  # donates its parameters).
  to_host = lambda tree: jax.tree.map(np.asarray, tree)  # noqa: E731
  params0 = to_host(init_student(k_student, args.vocab, args.embed, args.hidden))
  teacher0 = to_host(init_teacher(k_teacher, args.vocab, args.hidden))
  # Zipf-distributed token ids (as in text), so that the student sees the
  # frequent tokens again from one step to the next.
  zipf = -1.1 * jnp.log(jnp.arange(1, args.vocab + 1.0))
  batches = [
    np.asarray(jax.random.categorical(k, zipf, shape=(args.batch, args.seq)))
    for k in jax.random.split(k_data, args.steps)
  ]
  optimizer = optax.adam(args.learning_rate)

  def train_step(loss_fn):
    def step(params, opt_state, teacher, tokens):
      loss, grads = jax.value_and_grad(loss_fn)(params, teacher, tokens)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    return step

  results: dict[str, Any] = {}
  for name, loss_fn in make_losses(mesh, args.temperature).items():
    p_sh, t_sh, batch_sh = shardings(mesh, name, params0, teacher0)
    params = jax.device_put(params0, p_sh)
    teacher = jax.device_put(teacher0, t_sh)
    opt_state = optimizer.init(params)  # zeros_like: sharded like the parameters
    step = jax.jit(train_step(loss_fn), donate_argnums=(0, 1))
    tokens = [jax.device_put(b, batch_sh) for b in batches]
    compiled = step.lower(params, opt_state, teacher, tokens[0]).compile()
    losses, start = [], time.perf_counter()
    for batch in tokens:
      params, opt_state, loss = compiled(params, opt_state, teacher, batch)
      losses.append(float(loss))
    seconds = time.perf_counter() - start
    head_shards = len({str(s.index) for s in params["head"].addressable_shards})
    results[name] = {
      "losses": losses,
      "memory": memory(compiled),
      "seconds": seconds,
      "head_shards": head_shards,
    }
    print(
      f"\n{name}: loss per step "
      + " ".join(f"{x:.4f}" for x in losses)
      + f"  ({seconds:.2f} s for {args.steps} steps; LM head in {head_shards} slice(s))"
    )

  print("\nper-device memory of the compiled train step (XLA memory analysis):")
  print(f"  {'version':22} {'arguments':>12} {'outputs':>12} {'temporaries':>12}")
  for name, r in results.items():
    m = r["memory"]
    print(f"  {name:22} {mib(m['arguments'])} {mib(m['outputs'])} {mib(m['temporaries'])}")
  logits = args.batch * args.seq * args.vocab * 4
  print(f"  (one side's float32 logits for the whole batch: {mib(logits).strip()})")

  reference = np.asarray(results["materialised"]["losses"])
  for r in results.values():
    gap = float(np.max(np.abs(np.asarray(r["losses"]) - reference) / reference))
    r["max_relative_gap_vs_materialised"] = gap
  gaps = ", ".join(
    f"{n}: {r['max_relative_gap_vs_materialised']:.1e}"
    for n, r in results.items()
    if n != "materialised"
  )
  print(f"\nlargest relative loss difference from the materialised version: {gaps}")
  return results


if __name__ == "__main__":
  main()
