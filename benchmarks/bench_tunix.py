"""Tunix's whole train steps, stock against kldiv_jax's fused losses, compiled without the device.

Two steps of Tunix (google-tunix 0.1.7) at a real model's shapes, compiled for TPU v5e and an
H100 as ``benchmarks/bench_accel.py`` compiles a loss (a deviceless client, **XLA's
estimates, not measurements**): the policy update of Tunix's GRPO learner
(``nnx.value_and_grad`` of its ``grpo_loss_fn`` through the model, ``optax.global_norm``, the
optimizer's update, the optimizer state donated as Tunix's trainer donates it) and the train
step of its distillation trainer with the ``LogitStrategy`` (the teacher's output an input of
the step, as the trainer computes it before). *Stock*: Tunix's own code (``grpo_loss_fn``, whose
``compute_per_token_logps`` holds the float32 logits, and ``LogitStrategy.compute_loss``).
*kldiv_jax*: the same model called with ``output_hidden_states=True``, its final-norm hidden
states (sown as ``nnx.Intermediate`` ``'all_hidden_states'``) and its (tied) embedding table
handed to ``fused_policy_loss`` / ``fused_distillation_loss``: the logits nothing reads are
removed by XLA. Models: Tunix's ``Qwen3`` with Qwen 3 0.6B's config and ``Gemma3`` with
Gemma 3 1B's (bf16 parameters), their layer count cut (``--layers``) to keep the compiles
short: the logits' part of the step does not depend on it.

Per case: the peak memory of the compiled step (``memory_analysis()``: arguments + outputs -
aliased + temporaries), XLA's time (the roofline of its flops and bytes: XLA:TPU's
``optimal_seconds`` is negative for whole train steps; a loop body counted once, the fused
loss's chunk loop extrapolated from the loss compiled unrolled at one and two chunks, as
bench_accel does) and the largest micro-batch whose step fits the chip. Tunix and Flax live
in the accelerator environments (``.venv-accel-tpu``, ``.venv-accel-cuda``, installed without
their dependencies next to that environment's jax: ``TUNIX_PACKAGES``). Each record is appended
to ``<out>/tunix.jsonl`` as it is measured; ``--report`` prints the tables from it.

  python benchmarks/bench_tunix.py                                 # v5e and h100, the grid
  python benchmarks/bench_tunix.py --targets v5e --models qwen3_0p6b --seq 4096 --steps grpo
  python benchmarks/bench_tunix.py --quick                         # tiny models: a smoke test
  python benchmarks/bench_tunix.py --report                        # the tables of tunix.jsonl
"""

import argparse
import importlib.metadata
import importlib.util
import json
import subprocess
import sys
import time
import types
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import _harness
from _harness import HERE, fmt_bytes
from bench_accel import (
  TARGETS,
  _cost,
  _device,
  _or_error,
  _unrolled_loops,
  _worker_env,
  venv_python,
)

# Installed with --no-deps into each accelerator environment (its jax untouched): Tunix,
# Flax, and what their model, RL and distillation modules import (versions of the
# integration environment, `make integration`).
TUNIX_PACKAGES = (
  "google-tunix==0.1.7 flax==0.12.8 optax==0.2.8 absl-py==2.5.1 einops==0.8.2 "
  "jaxtyping==0.3.11 wadler_lindig==0.1.8 msgpack==1.2.4 rich==15.0.0 markdown-it-py==4.3.0 "
  "mdurl==0.1.2 Pygments==2.21.0 treescope==0.1.10 typing_extensions==4.16.0 PyYAML==6.0.4 "
  "humanize==4.17.0 etils==1.15.0 safetensors==0.7.0 zipp==4.1.2 importlib_resources==7.1.0 "
  "fsspec==2026.9.0 huggingface_hub==1.33.0 filelock==4.3.1 packaging==25.0 tqdm==4.70.1 "
  "httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 hf-xet==1.8.0"
).split()

MODELS = ("qwen3_0p6b", "gemma3_1b")
STEPS = ("grpo", "distill")
PROMPT = 256  # GRPO: prompt tokens of a row; the completion is the rest of S
PAD_ID, EOS_ID = 0, 1
# Tunix's GRPOConfig defaults (beta, epsilon, kl "kl", sequence-mean-token-mean), with
# DAPO's clip-higher epsilon_high; LogitStrategy's defaults (temperature 2, alpha 0.5).
GRPO = dict(beta=0.04, epsilon=0.2, epsilon_high=0.28, loss_algo="grpo", temperature=1.0)
GRPO |= dict(loss_agg_mode="sequence-mean-token-mean", kl_loss_mode="kl", kl_clamp_value=None)
DISTILL = dict(temperature=2.0, alpha=0.5)
# The steps compared: the fused one first (it compiles; XLA:TPU's out-of-memory compiles of
# stock are the slow ones).
VARIANTS = ("kldiv_jax", "stock")
TIME_TARGET = 1.05  # the fused step's estimated time / stock's
MAX_BATCH = 256


# ----------------------------------------------------------------------------- Tunix, lightly


def import_tunix() -> types.SimpleNamespace:
  """Tunix's model, RL and distillation modules without ``tunix/__init__.py`` (which imports
  every trainer, sampler and their dependencies: torch, orbax, grain, ...): the packages on
  the way are registered as bare namespaces of their directories."""
  for name in ("tunix", "tunix.rl", "tunix.distillation", "tunix.distillation.strategies"):
    if name not in sys.modules:
      spec = importlib.util.find_spec(name)
      if spec is None or spec.submodule_search_locations is None:
        raise ImportError(f"bench_tunix: {name} is not installed (google-tunix==0.1.7)")
      module = types.ModuleType(name)
      module.__path__ = list(spec.submodule_search_locations)
      sys.modules[name] = module
  from tunix.distillation.strategies import logit
  from tunix.models.gemma3 import model as gemma3
  from tunix.models.qwen3 import model as qwen3
  from tunix.rl import algo_core, common
  from tunix.sft import utils as sft_utils

  return types.SimpleNamespace(
    qwen3=qwen3, gemma3=gemma3, algo_core=algo_core, common=common, logit=logit, sft=sft_utils
  )


def model_config(t, name: str, layers: int, quick: bool, flash: bool, remat: str = "none"):
  """Tunix's config of ``name`` with ``layers`` layers, bf16 parameters, Tunix's
  ``RematConfig`` ``remat`` (``quick``: tiny)."""
  import dataclasses

  import jax.numpy as jnp

  family = t.qwen3 if name == "qwen3_0p6b" else t.gemma3
  policy = family.RematConfig[remat.upper()]
  if name == "qwen3_0p6b":
    cfg = t.qwen3.ModelConfig.qwen3_0p6b()
    cfg = dataclasses.replace(cfg, remat_config=policy)
    cfg = dataclasses.replace(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    cfg = dataclasses.replace(cfg, use_flash_attention=flash, num_layers=layers)
    if quick:
      cfg = dataclasses.replace(cfg, vocab_size=4096, embed_dim=128, hidden_dim=256)
      cfg = dataclasses.replace(cfg, num_heads=2, head_dim=64, num_kv_heads=1)
      cfg = dataclasses.replace(cfg, flash_attention_block_size=128)
    return cfg, cfg.vocab_size
  cfg = t.gemma3.ModelConfig.gemma3_1b_pt()  # bf16 parameters by default
  cfg = dataclasses.replace(cfg, num_layers=layers, remat_config=policy)
  if quick:
    cfg = dataclasses.replace(cfg, num_embed=4096, embed_dim=128, hidden_dim=256, head_dim=64)
  return cfg, cfg.num_embed


def abstract_model(t, name: str, cfg):
  """``(graphdef, params, rest)`` of the model, as shapes (nothing allocated)."""
  from flax import nnx

  cls = t.qwen3.Qwen3 if name == "qwen3_0p6b" else t.gemma3.Gemma3
  model = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0)))
  return nnx.split(model, nnx.Param, ...)


def head(model, name: str):
  """The LM head ``[H, V]``: the tied embedding table transposed, or ``lm_head``."""
  if name == "qwen3_0p6b" and not model.config.use_tied_embedding:
    return model.lm_head.w.value
  return model.embedder.input_embedding.value.T


def hidden_states(model, tokens, **kwargs):
  """The final-norm hidden states that the model sows with ``output_hidden_states=True``."""
  from flax import nnx

  model(tokens, output_hidden_states=True, **kwargs)
  sown = nnx.pop(model, nnx.Intermediate)
  return sown["all_hidden_states"].value[0]


# ----------------------------------------------------------------------------- the losses


def grpo_losses(t, name: str, chunk_size: int | None = None) -> dict[str, Callable]:
  """``{"stock": f, "kldiv_jax": g}``: GRPO policy losses ``(model, batch) -> (loss, aux)``
  (``chunk_size``: the fused loss's, ``None`` for the library's default)."""
  import kldiv_jax

  algo = types.SimpleNamespace(**GRPO)

  def stock(model, b):
    example = types.SimpleNamespace(
      prompt_ids=b["prompt"], completion_ids=b["completion"], completion_mask=b["mask"],
      advantages=b["advantages"], ref_per_token_logps=b["ref"], old_per_token_logps=None,
      segment_ids=None, segment_positions=None, sampler_is_weights=None,
    )  # fmt: skip
    return t.algo_core.grpo_loss_fn(model, example, algo, PAD_ID, EOS_ID)

  def fused(model, b):
    tokens, positions, attn_mask, seg = t.common.process_ids(
      b["prompt"], b["completion"], PAD_ID, EOS_ID
    )
    kwargs = dict(positions=positions, cache=None, attention_mask=attn_mask)
    if name == "qwen3_0p6b":
      kwargs["segment_ids"] = seg  # as compute_per_token_logps passes them
    length = b["completion"].shape[1]
    h = hidden_states(model, tokens, **kwargs)[:, -length - 1 : -1]
    loss, m = kldiv_jax.fused_policy_loss(
      h, head(model, name), b["completion"], None, b["advantages"],
      clip_low=algo.epsilon, clip_high=algo.epsilon_high, aggregation="seq-mean-token-mean",
      where=b["mask"].astype(bool), ref_log_probs=b["ref"], beta=algo.beta, kl_estimator="k1",
      temperature=algo.temperature, chunk_size=chunk_size,
    )  # fmt: skip
    return loss, {"pg_loss": m.pg_loss, "kl": m.kl, "entropy": m.entropy, "ppo_kl": m.approx_kl}

  return {"stock": stock, "kldiv_jax": fused}


def distill_losses(t, name: str, chunk_size: int | None = None) -> dict[str, Callable]:
  """``{"stock": f, "kldiv_jax": g}``: distillation losses ``(model, batch) -> (loss, aux)``
  (``chunk_size`` as in :func:`grpo_losses`)."""
  import jax
  import jax.numpy as jnp

  import kldiv_jax

  strategy = t.logit.LogitStrategy(
    student_forward_fn=lambda model, **kw: model,  # unused: compute_loss takes the outputs
    teacher_forward_fn=lambda model, **kw: model,
    labels_fn=lambda **kw: kw,
    **DISTILL,
  )

  def inputs(b):
    mask = jnp.ones(b["tokens"].shape, bool)
    positions = t.sft.build_positions_from_mask(mask)
    return dict(positions=positions, cache=None, attention_mask=t.sft.make_causal_attn_mask(mask))

  def next_tokens(b):
    return jnp.roll(b["tokens"], -1, axis=-1)

  def stock(model, b):
    logits, _ = model(b["tokens"], **inputs(b))
    labels = jax.nn.one_hot(next_tokens(b), logits.shape[-1])  # LogitStrategy's labels
    return strategy.compute_loss(logits, b["teacher_logits"], labels)

  def fused(model, b):
    h = hidden_states(model, b["tokens"], **inputs(b))
    loss, parts = kldiv_jax.fused_distillation_loss(
      h, head(model, name), b["teacher_hidden"], b["teacher_head"], labels=next_tokens(b),
      return_parts=True, chunk_size=chunk_size, **DISTILL,
    )  # fmt: skip
    tokens = jnp.maximum(parts.num_tokens, 1)
    return loss, {
      "distill/soft_loss": parts.soft / tokens,
      "distill/hard_loss": parts.hard / tokens,
    }

  return {"stock": stock, "kldiv_jax": fused}


def batch_structs(step: str, variant: str, batch: int, seq: int, cfg_v: tuple, sharding):
  """The step's batch as ``ShapeDtypeStruct``s (``cfg_v``: ``(hidden size, vocabulary, logits
  dtype)``)."""
  import jax
  import jax.numpy as jnp

  h, v, logits_dtype = cfg_v
  sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)  # noqa: E731
  if step == "grpo":
    c = seq - PROMPT
    return {
      "prompt": sds((batch, PROMPT), jnp.int32), "completion": sds((batch, c), jnp.int32),
      "mask": sds((batch, c), jnp.int32), "advantages": sds((batch,), jnp.float32),
      "ref": sds((batch, c), jnp.float32),
    }  # fmt: skip
  out = {"tokens": sds((batch, seq), jnp.int32)}
  if variant == "stock":  # Tunix's trainer hands the teacher's logits to the step
    return out | {"teacher_logits": sds((batch, seq, v), logits_dtype)}
  return out | {
    "teacher_hidden": sds((batch, seq, h), jnp.bfloat16),
    "teacher_head": sds((h, v), jnp.bfloat16),
  }


# ----------------------------------------------------------------------------- the worker


def train_step(graphdef, loss_fn: Callable, tx) -> Callable:
  """Tunix's train step (``PeftTrainer._train_step``) as a function of the model's state:
  ``nnx.value_and_grad`` of the loss wrt the parameters, the gradient's global norm, the
  optimizer's update (``optax`` ``update`` and ``apply_updates``, as ``nnx.Optimizer``)."""
  import jax
  import optax
  from flax import nnx

  def step(params, rest, opt_state, batch):
    def loss(p):
      return loss_fn(nnx.merge(graphdef, p, rest), batch)

    (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(params)
    grad_norm = optax.global_norm(grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value, aux, grad_norm

  return step


class Setup:
  """One (target, model) of the worker: the model's shapes, its losses, the device."""

  def __init__(
    self, target: str, name: str, layers: int, quick: bool, remat: str = "none",
    chunk_size: int | None = None,
  ):  # fmt: skip
    import jax
    import numpy as np
    import optax
    from jax.sharding import Mesh, SingleDeviceSharding

    self.t = import_tunix()
    self.target, self.name, self.dev = target, name, _device(target)
    flash = TARGETS[target]["kind"] == "tpu" and name == "qwen3_0p6b"
    self.cfg, self.vocab = model_config(self.t, name, layers, quick, flash, remat)
    self.remat, self.chunk_size = remat, chunk_size
    self.flash = flash
    self.graphdef, params, rest = abstract_model(self.t, name, self.cfg)
    self.sharding = SingleDeviceSharding(self.dev)
    self.mesh = Mesh(np.array([self.dev]).reshape(1, 1), ("fsdp", "tp"))
    self.tx = optax.adamw(1e-6)
    place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.sharding)  # noqa: E731
    self.params = jax.tree.map(place, params)
    self.rest = jax.tree.map(place, rest)
    self.opt_state = jax.tree.map(place, jax.eval_shape(self.tx.init, self.params))
    embed = self.cfg.embed_dim
    self.logits_dtype = "float32" if name == "qwen3_0p6b" else "bfloat16"
    self.cfg_v = (embed, self.vocab, self.logits_dtype)
    self._chunk_costs: dict[tuple[str, int], dict[str, Any]] = {}
    self.losses = {
      "grpo": grpo_losses(self.t, name, chunk_size),
      "distill": distill_losses(self.t, name, chunk_size),
    }

  def compile(self, step: str, variant: str, batch: int, seq: int):
    import jax

    fn = train_step(self.graphdef, self.losses[step][variant], self.tx)
    structs = batch_structs(step, variant, batch, seq, self.cfg_v, self.sharding)
    with warnings.catch_warnings():  # Tunix's splash attention reads the legacy mesh context
      warnings.simplefilter("ignore", DeprecationWarning)
      with self.mesh:
        lowered = jax.jit(fn, donate_argnums=(2,)).lower(
          self.params, self.rest, self.opt_state, structs
        )
    return lowered.compile()

  def measure(self, step: str, variant: str, batch: int, seq: int) -> dict[str, Any]:
    start = time.perf_counter()
    compiled = self.compile(step, variant, batch, seq)
    out = memory(compiled) | _cost(compiled, self.target)
    out["vocab_arrays"] = vocab_arrays(compiled.as_text(), self.vocab, self.cfg.embed_dim)
    return out | {"compile_s": time.perf_counter() - start}

  def loss_chunk_cost(self, step: str, tokens: int) -> dict[str, Any]:
    """The fused loss alone (``value_and_grad`` wrt hidden states and head) unrolled at one
    and two chunks of the library's default chunk for ``tokens``: flops and bytes per chunk."""
    import jax
    import jax.numpy as jnp

    import kldiv_jax
    from kldiv_jax._fused_chunks import platform_chunk_size

    platform = "tpu" if TARGETS[self.target]["kind"] == "tpu" else "cuda"
    c = self.chunk_size or platform_chunk_size(tokens, self.vocab, platform)
    c = min(c, tokens)
    counts = {"chunks": -(-tokens // c), "full_chunks": tokens // c}
    if (step, c) in self._chunk_costs:  # the same for every length with this chunk
      return self._chunk_costs[step, c] | counts
    h = self.cfg.embed_dim
    sds = lambda s, dt: jax.ShapeDtypeStruct(s, dt, sharding=self.sharding)  # noqa: E731
    bf = jnp.bfloat16

    def cost(n):
      if step == "grpo":
        fn = lambda hid, w, y, ref, adv: kldiv_jax.fused_policy_loss(  # noqa: E731
          hid, w, y, None, adv, clip_low=0.2, clip_high=0.28, ref_log_probs=ref, beta=0.04,
          kl_estimator="k1", chunk_size=c,
        )[0]  # fmt: skip
        args = [sds((n, h), bf), sds((h, self.vocab), bf), sds((n,), jnp.int32)]
        args += [sds((n,), jnp.float32), sds((n,), jnp.float32)]
      else:
        fn = lambda hid, w, th, tw, y: kldiv_jax.fused_distillation_loss(  # noqa: E731
          hid, w, th, tw, labels=y, chunk_size=c, **DISTILL
        )
        args = [sds((n, h), bf), sds((h, self.vocab), bf), sds((n, h), bf)]
        args += [sds((h, self.vocab), bf), sds((n,), jnp.int32)]
      with _unrolled_loops():
        compiled = jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(*args).compile()
      return _cost(compiled, self.target)

    one, two = cost(c), cost(2 * c)
    self._chunk_costs[step, c] = {
      "chunk": c,
      "flops": two["flops"] - one["flops"],
      "bytes": two["bytes"] - one["bytes"],
    }
    return self._chunk_costs[step, c] | counts


def vocab_arrays(hlo: str, vocab: int, hidden: int, top: int = 3) -> list[list]:
  """The largest arrays of the optimised HLO (fusions' insides included) with a
  vocabulary-sized axis, other than the head's shapes ``[V, H]``, ``[H, V]`` (a chunk of
  ``H`` tokens' logits has them too): ``[[dtype, shape, bytes], ...]``, largest first: the
  logits a step holds (or a fused loss's chunk of them)."""
  import re

  import numpy as np

  sizes = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1}
  found = set()
  for dtype, dims in re.findall(r"\b(f32|bf16|f16|s32|u32|pred|s8|u8)\[([0-9,]+)\]", hlo):
    shape = tuple(int(d) for d in dims.split(","))
    if vocab in shape and sorted(shape) != sorted((vocab, hidden)):
      found.add((dtype, shape))
  ranked = sorted(found, key=lambda x: -int(np.prod(x[1])) * sizes[x[0]])[:top]
  return [[d, list(sh), int(np.prod(sh)) * sizes[d]] for d, sh in ranked]


def memory(compiled) -> dict[str, int]:
  """The compiled program's memory: arguments + outputs - aliased (donated) + temporaries."""
  ma = compiled.memory_analysis()
  parts = {
    k: int(getattr(ma, f"{k}_size_in_bytes", 0) or 0)
    for k in ("argument", "output", "alias", "temp", "generated_code")
  }
  total = parts["argument"] + parts["output"] - parts["alias"] + parts["temp"]
  xla_peak = getattr(ma, "peak_memory_in_bytes", None)
  out = {f"{k}_bytes": v for k, v in parts.items()} | {"peak_bytes": total}
  return out | ({"xla_peak_bytes": int(xla_peak)} if xla_peak else {})


def roofline(flops: float, bytes_: float, target: str) -> float:
  cfg = TARGETS[target]
  return max(flops / cfg["peak"], bytes_ / cfg["bw"])


def peak(result: dict[str, Any]) -> int:
  """XLA's own peak (``peak_memory_in_bytes``) where it reports one, else the sum."""
  return result.get("xla_peak_bytes", result["peak_bytes"])


def fits(result: dict[str, Any], target: str) -> bool:
  return "error" not in result and peak(result) <= TARGETS[target]["hbm"]


def max_batch(setup: Setup, step: str, variant: str, seq: int, known: dict[int, Any]) -> dict:
  """The largest micro-batch whose step compiles and fits the chip, with the probes made
  (``known``: batch -> memory or error, those measured already). The peak is close to linear
  in the micro-batch: the line through the two largest fitting probes (at first 1 and 2, or 1
  and 8) predicts the largest, checked by compiling it and the next, up to three times (XLA
  rematerialises a program to fit, so more than the line may fit); then doubling and
  bisection from there."""

  def probe(b: int) -> bool:
    if b not in known:
      known[b] = _or_error(lambda: estimate(setup, step, variant, b, seq))
      r = known[b]
      what = r["error"][:80] if "error" in r else fmt_bytes(peak(r))
      print(f"    [{setup.target}] {setup.name} {step} {variant} S={seq} B={b}: "
            f"{'fits' if fits(r, setup.target) else 'does not fit'} ({what})",
            file=sys.stderr, flush=True)  # fmt: skip
    return fits(known[b], setup.target)

  def bracket() -> tuple[int, int | None]:
    ok = [b for b in known if fits(known[b], setup.target)]
    bad = [b for b in known if not fits(known[b], setup.target)]
    return max(ok, default=0), min(bad, default=None)

  if not probe(1):
    return {"max_batch": 0, "probes": _probes(known)}
  if sum(fits(r, setup.target) for r in known.values()) < 2:
    probe(2)
  for _ in range(3):  # the line through the two largest fitting probes, as long as it moves
    lo, hi = bracket()
    ok = sorted(b for b in known if fits(known[b], setup.target))[-2:]
    if len(ok) < 2 or (hi is not None and hi == lo + 1):
      break
    slope = (peak(known[ok[1]]) - peak(known[ok[0]])) / (ok[1] - ok[0])
    if slope <= 0:
      break
    guess = int(ok[1] + (TARGETS[setup.target]["hbm"] - peak(known[ok[1]])) // slope)
    guess = max(lo, min(guess, MAX_BATCH, hi - 1 if hi is not None else MAX_BATCH))
    if guess in known and guess + 1 in known:
      break
    if probe(guess) and guess < MAX_BATCH:
      probe(guess + 1)
    elif guess > 1:
      probe(guess - 1)
  lo, hi = bracket()
  while hi is None and lo < MAX_BATCH:
    nxt = min(2 * lo, MAX_BATCH)
    probe(nxt)
    lo, hi = bracket()
  while hi is not None and hi - lo > 1:
    probe((lo + hi) // 2)
    lo, hi = bracket()
  return {"max_batch": lo, "probes": _probes(known)}


def _probes(known: dict[int, Any]) -> dict[str, Any]:
  """The probes of a search: batch -> peak and time, or the error."""
  out = {}
  for b, r in sorted(known.items()):
    out[str(b)] = {"error": r["error"][:200]} if "error" in r else {"peak_bytes": peak(r)}
    if "seconds" in r:
      out[str(b)]["seconds"] = r["seconds"]
  return out


def tokens_of(step: str, batch: int, seq: int) -> int:
  """The tokens whose logits the step's loss takes: GRPO's completions, all for distillation."""
  return batch * (seq - PROMPT if step == "grpo" else seq)


def estimate(setup: Setup, step: str, variant: str, batch: int, seq: int) -> dict[str, Any]:
  """One compiled step: its memory, counts and roofline time (the fused loss's chunk loop
  extrapolated from its one- and two-chunk programs: ``loss_chunk``)."""
  out = setup.measure(step, variant, batch, seq)
  if variant == "kldiv_jax":
    chunk = out["loss_chunk"] = _or_error(
      lambda: setup.loss_chunk_cost(step, tokens_of(step, batch, seq))
    )
    if "error" in chunk:
      return out
    return unrolled(out, chunk, setup.target)
  return out | {"seconds": roofline(out["flops"], out["bytes"], setup.target)}


def unrolled(out: dict[str, Any], chunk: dict[str, Any], target: str) -> dict[str, Any]:
  """The fused step's counts and time with its chunk loop counted in full: the looped step
  counts the loop's body (one full chunk) once and the uneven last chunk (outside the loop)
  once, so ``full_chunks - 1`` chunks are added (not ``chunks - 1``: that counted one chunk
  too many where the tokens are not a multiple of the chunk)."""
  extra = chunk["full_chunks"] - 1
  out = out | {"flops_unrolled": out["flops"] + extra * chunk["flops"]}
  out["bytes_unrolled"] = out["bytes"] + extra * chunk["bytes"]
  return out | {"seconds": roofline(out["flops_unrolled"], out["bytes_unrolled"], target)}


def case_record(
  setup: Setup, step: str, seq: int, batch: int, variants: Sequence[str] = VARIANTS
) -> dict[str, Any]:
  """Stock and kldiv_jax's steps at one micro-batch: memory, the roofline time, their ratio
  (``variants``: those compiled; one left out is recorded as ``{"skipped": True}``)."""
  row: dict[str, Any] = {"kind": "step", "target": setup.target, "model": setup.name}
  row |= {"step": step, "seq": seq, "batch": batch, "layers": setup.cfg.num_layers}
  row |= {"vocab": setup.vocab, "flash_attention": setup.flash, "remat": setup.remat}
  row |= {"logits_dtype": setup.logits_dtype, "chunk_size": setup.chunk_size}
  row["logits_f32_bytes"] = tokens_of(step, batch, seq) * setup.vocab * 4
  for variant in VARIANTS:
    if variant not in variants:
      row[variant] = {"skipped": True}
      continue
    row[variant] = _or_error(lambda v=variant: estimate(setup, step, v, batch, seq))
  fused, stock = row["kldiv_jax"], row["stock"]
  if "skipped" in stock or "skipped" in fused:
    return row
  if "seconds" in stock and "seconds" in fused:
    row["time_ratio"] = fused["seconds"] / stock["seconds"]
  if "error" not in stock and "error" not in fused:
    row["peak_saved_bytes"] = peak(stock) - peak(fused)
    row["saved_over_logits"] = row["peak_saved_bytes"] / row["logits_f32_bytes"]
  elif "error" not in fused and oom_temp_bytes(stock) is not None:
    # at least: stock's temporaries alone (XLA:TPU's figure) against the fused step's peak
    row["peak_saved_bytes_at_least"] = oom_temp_bytes(stock) - peak(fused)
    row["saved_over_logits_at_least"] = row["peak_saved_bytes_at_least"] / row["logits_f32_bytes"]
  return row


def worker(args: argparse.Namespace) -> int:
  import jax

  if TARGETS[args.worker]["kind"] == "tpu":
    jax.config.update("jax_platforms", "cpu")  # the compile-only TPU client needs no devices
  out = Path(args.worker_out)

  def save(row):
    row |= {"quick": args.quick, "jax": jax.__version__, "time": time.strftime("%FT%T%z")}
    with out.open("a") as f:
      f.write(json.dumps(row) + "\n")

  for name in _list(args.models):
    setup = Setup(args.worker, name, args.layers, args.quick, args.remat, args.chunk_size)
    for seq in [int(s) for s in _list(args.seq)]:
      for step in _list(args.steps):
        keys = ("target", "model", "step", "seq", "layers", "remat", "chunk_size")
        row = {"target": setup.target, "model": name, "step": step, "seq": seq}
        row |= {"layers": setup.cfg.num_layers, "remat": setup.remat}
        row |= {"chunk_size": setup.chunk_size}
        if not args.search_only:
          row = case_record(setup, step, seq, args.batch, _list(args.variants))
          save(row)
          print(f"  {line(row)}", file=sys.stderr, flush=True)
        if not (args.max_batch or args.search_only):
          continue
        for variant in [v for v in ("stock", "kldiv_jax") if v in _list(args.variants)]:
          known = {} if args.search_only else {args.batch: row[variant]}
          found = max_batch(setup, step, variant, seq, known)
          save({"kind": "max_batch", "variant": variant} | {k: row[k] for k in keys} | found)
          print(f"  {setup.target} {name} {step} S={seq}: largest micro-batch {variant} "
                f"{found['max_batch']}", file=sys.stderr, flush=True)  # fmt: skip
  return 0


# ----------------------------------------------------------------------------- the parent


def _list(text: str) -> list[str]:
  return [x.strip() for x in text.split(",") if x.strip()]


def tunix_python(kind: str, jax_version: str, root: Path) -> Path:
  """bench_accel's environment of ``kind`` with Tunix and Flax added (``--no-deps``: its jax
  stays), on first use."""
  python = venv_python(kind, jax_version, root)
  stamp = python.parent.parent / ".installed-tunix-0.1.7"
  if not stamp.exists():
    print(f"bench_tunix: installing google-tunix 0.1.7 into {python.parent.parent}", flush=True)
    cmd = [str(python), "-m", "pip", "install", "-q", "--no-deps", *TUNIX_PACKAGES]
    subprocess.run(cmd, check=True)
    stamp.touch()
  return python


def _gib(b: float | None) -> str:
  return "—" if b is None else f"{b / 2**30:.1f}"


def line(row: dict[str, Any]) -> str:
  what = f"{row['target']:4} {row['model']:10} {row['step']:7} S={row['seq']:<5} B={row['batch']}"
  s, f = row["stock"], row["kldiv_jax"]
  ps, pf = (_gib(peak(x)) if not ({"error", "skipped"} & set(x)) else "—" for x in (s, f))
  text = f"{what}  peak stock {ps} GiB, kldiv_jax {pf} GiB"
  text += f" (f32 logits {_gib(row['logits_f32_bytes'])} GiB)"
  if "time_ratio" in row:
    text += (
      f"  time {s['seconds'] * 1e3:.1f} -> {f['seconds'] * 1e3:.1f} ms ({row['time_ratio']:.3f}x)"
    )
  for k in ("stock", "kldiv_jax"):
    if "error" in row[k]:
      text += f"  {k}: {row[k]['error'][:120]}"
  return text


def _failure(result: dict[str, Any]) -> str:
  """``OOM`` (XLA could not fit the program in the chip's memory; with XLA:TPU's figure of
  the temporaries it needed, in GiB) or ``error``."""
  err = result["error"].lower()
  if "memory" not in err and "exhausted" not in err:
    return "error"
  needed = oom_temp_bytes(result)
  return "OOM" if needed is None else f"OOM (temp {needed / 2**30:.1f})"


def oom_temp_bytes(result: dict[str, Any]) -> float | None:
  """The temporaries XLA:TPU said an out-of-memory program needs (its ``G``: GiB, as in its
  "exceeds available HBM (15.75G)" of a 16 GiB v5e), or ``None``."""
  import re

  found = re.search(r"required for HLO temporaries \(([0-9.]+)G\)", result.get("error", ""))
  return None if found is None else float(found.group(1)) * 2**30


def table(rows: list[dict[str, Any]]) -> str:
  """The step-level table (Markdown): the latest record of each case, with the largest
  micro-batches found for its model, step and length."""
  latest: dict[tuple, dict] = {}
  largest: dict[tuple, int] = {}
  probes: dict[tuple, dict] = {}
  for r in rows:
    key = (r["target"], r["model"], r["step"], r["seq"], r["layers"], r.get("remat", "none"))
    key += (r.get("chunk_size"),)
    if r.get("kind", "step") == "max_batch":
      largest[(*key, r["variant"])] = r["max_batch"]
      probes[(*key, r["variant"])] = r.get("probes", {})
    else:
      latest[(*key, r["batch"])] = r
  head = (
    "| target | model (layers) | step | S | B | peak stock GiB | peak kldiv_jax GiB |"
    " saved / f32 logits | time stock ms | time kldiv_jax ms | ratio |"
    " largest B stock | largest B kldiv_jax |"
  )
  lines = [head, "|" + "---|" * 13]
  order = {name: i for i, name in enumerate((*TARGETS, *MODELS, *STEPS))}
  for key, r in sorted(  # target, model, length, step, micro-batch (largest first)
    latest.items(),
    key=lambda kv: (order[kv[0][0]], order[kv[0][1]], kv[0][3], order[kv[0][2]], -kv[0][-1]),
  ):
    s, f = r["stock"], r["kldiv_jax"]
    peak_s, peak_f = (
      "not run" if "skipped" in x else _gib(peak(x)) if "error" not in x else _failure(x)
      for x in (s, f)
    )
    saved = f"{r['saved_over_logits']:.2f}" if "saved_over_logits" in r else "—"
    if "error" in s and "error" not in f and oom_temp_bytes(s) is not None:
      at_least = (oom_temp_bytes(s) - peak(f)) / r["logits_f32_bytes"]
      saved = f"> {at_least:.2f}"
    ts = f"{s['seconds'] * 1e3:.1f}" if "seconds" in s else "—"
    tf = f"{f['seconds'] * 1e3:.1f}" if "seconds" in f else "—"
    ratio = f"{r['time_ratio']:.3f}" if "time_ratio" in r else "—"
    if "time_ratio" not in r:  # where both compile: the largest micro-batch of both searches
      ps, pf = (probes.get((*key[:-1], v), {}) for v in ("stock", "kldiv_jax"))
      both = [int(b) for b in ps if "seconds" in ps[b] and "seconds" in pf.get(b, {})]
      if both:
        b = str(max(both))
        ratio = f"{pf[b]['seconds'] / ps[b]['seconds']:.3f} (B={b})"
    big = [largest.get((*key[:-1], v), "—") for v in ("stock", "kldiv_jax")]
    remat = "" if r.get("remat", "none") == "none" else f", remat {r['remat']}"
    remat += "" if r.get("chunk_size") is None else f", chunk {r['chunk_size']}"
    lines.append(
      f"| {r['target']} | {r['model']} ({r['layers']}{remat}) | {r['step']} | {r['seq']} | {r['batch']} |"
      f" {peak_s} | {peak_f} | {saved} | {ts} | {tf} | {ratio} | {big[0]} | {big[1]} |"
    )
  return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
  p = _harness.parser(__doc__, quick="tiny models (Tunix's classes, small dims): a smoke test")
  p.add_argument("--targets", default="v5e,h100", help="comma-separated (v5e, v6e, h100)")
  p.add_argument(
    "--models", default=",".join(MODELS), help=f"comma-separated ({', '.join(MODELS)})"
  )
  p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated ({', '.join(STEPS)})")
  p.add_argument("--seq", default="4096,8192", help="comma-separated sequence lengths")
  p.add_argument("--batch", type=int, default=8, help="micro-batch (default 8)")
  p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
  p.add_argument(
    "--remat", default="none", choices=("none", "block", "decoder"),
    help="Tunix's RematConfig of the models (default: none, Tunix's default)",
  )  # fmt: skip
  p.add_argument(
    "--max-batch", action=argparse.BooleanOptionalAction, default=True,
    help="search the largest micro-batch that fits the chip (one compile per probe)",
  )  # fmt: skip
  p.add_argument(
    "--search-only", action="store_true",
    help="only the largest micro-batch (its probes' records), not the step at --batch",
  )  # fmt: skip
  p.add_argument(
    "--chunk-size", type=int, default=None,
    help="the fused losses' chunk of tokens (default: the library's for the target)",
  )  # fmt: skip
  p.add_argument(
    "--variants", default=",".join(VARIANTS),
    help="the steps compiled (kldiv_jax, stock; default both), at --batch and in the "
    "searches: stock's step does not depend on the fused loss's chunk",
  )  # fmt: skip
  p.add_argument("--venvs", type=Path, default=None, help="where .venv-accel-* live (the repo)")
  p.add_argument("--report", action="store_true", help="print the tables of <out>/tunix.jsonl")
  p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
  return p


def main(argv: Sequence[str] | None = None) -> int:
  args = parser().parse_args(argv)
  if args.quick:
    args.seq, args.batch, args.layers = "512" if args.seq == "4096,8192" else args.seq, 2, 1
    args.max_batch = False
  if args.worker:
    return worker(args)
  args.out.mkdir(parents=True, exist_ok=True)
  jsonl = args.out / ("tunix-quick.jsonl" if args.quick else "tunix.jsonl")
  if not args.report:
    targets = _list(args.targets)
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
      parser().error(f"unknown target(s) {unknown}; available: {list(TARGETS)}")
    for bad in [m for m in _list(args.models) if m not in MODELS]:
      parser().error(f"unknown model {bad!r}; available: {MODELS}")
    for bad in [s for s in _list(args.steps) if s not in STEPS]:
      parser().error(f"unknown step {bad!r}; available: {STEPS}")
    for bad in [v for v in _list(args.variants) if v not in VARIANTS]:
      parser().error(f"unknown variant {bad!r}; available: {VARIANTS}")
    jax_version = importlib.metadata.version("jax")
    ok = True
    for target in targets:
      kind = TARGETS[target]["kind"]
      python = tunix_python(kind, jax_version, args.venvs or HERE.parent)
      cmd = [str(python), str(Path(__file__).resolve()), "--worker", target]
      cmd += ["--worker-out", str(jsonl), "--models", args.models, "--steps", args.steps]
      cmd += ["--seq", args.seq, "--batch", str(args.batch), "--layers", str(args.layers)]
      cmd += ["--remat", args.remat, "--variants", args.variants]
      cmd += [] if args.chunk_size is None else ["--chunk-size", str(args.chunk_size)]
      cmd += ["--max-batch" if args.max_batch else "--no-max-batch"]
      cmd += ["--search-only"] if args.search_only else []
      cmd += ["--quick"] if args.quick else []
      print(f"\n=== {target} ({kind}, compile-only) ===", flush=True)
      proc = subprocess.run(cmd, env=_worker_env(target))
      if proc.returncode != 0:
        print(f"bench_tunix: the {target} worker failed (exit {proc.returncode})")
        ok = False
  rows = (
    [json.loads(x) for x in jsonl.read_text().splitlines() if x.strip()] if jsonl.exists() else []
  )
  print(f"\nXLA's estimates (compile-only, not measurements), from {jsonl}:\n")
  print(table(rows))
  return 0 if (args.report or ok) else 1


if __name__ == "__main__":
  raise SystemExit(main())
