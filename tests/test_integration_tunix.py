"""kldiv_jax.tunix against Tunix itself (google-tunix 0.1.7, flax 0.12.8, jax 0.10.2).

Runs where google-tunix is installed (``make integration``), skipped elsewhere. Every model
here is one of Tunix's own families (Gemma, Gemma 3, Qwen 2, Qwen 3, Llama 3, Gemma 4) at a
tiny configuration; the expected values are Tunix's own: its ``compute_per_token_logps``,
its registered ``"grpo"`` policy loss, its ``LogitStrategy``, run by its own RL actor
trainer, its whole ``GRPOLearner`` (rollout included) and its distillation trainer on its
own data structures.

Tolerance of the stock-vs-fused comparisons (float32): ``rtol=2e-5, atol=1e-6``. The fused
path computes the same float32 logits chunk by chunk and its log-softmax with an online
log-sum-exp over vocabulary chunks, so each log-prob differs from Tunix's by a few float32
ulps (~1e-7 relative); two SGD steps carry that into the parameters at the same scale. A
wrong option, mask, shift, head or temperature moves the numbers by 1e-3 or more.
"""

import contextlib
import re
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kldiv_jax

# Tunix and its own dependency flax: skipped where the integration environment is not.
nnx = pytest.importorskip("flax.nnx")
kt = pytest.importorskip("kldiv_jax.tunix")
_tunix_rl = pytest.importorskip("kldiv_jax._tunix_rl")  # spied on in the learner's run
distillation_trainer = pytest.importorskip("tunix.distillation.distillation_trainer")
logit = pytest.importorskip("tunix.distillation.strategies.logit")
algo_core = pytest.importorskip("tunix.rl.algo_core")
common = pytest.importorskip("tunix.rl.common")
function_registry = pytest.importorskip("tunix.rl.function_registry")
rl_trainer = pytest.importorskip("tunix.rl.trainer")
grpo_learner = pytest.importorskip("tunix.rl.grpo.grpo_learner")
GRPOConfig = grpo_learner.GRPOConfig
rl_cluster = pytest.importorskip("tunix.rl.rl_cluster")
base_rollout = pytest.importorskip("tunix.rl.rollout.base_rollout")
hooks = pytest.importorskip("tunix.sft.hooks")
peft_trainer = pytest.importorskip("tunix.sft.peft_trainer")
gemma = pytest.importorskip("tunix.models.gemma.model")
gemma3 = pytest.importorskip("tunix.models.gemma3.model")
gemma4 = pytest.importorskip("tunix.models.gemma4.model")
llama3 = pytest.importorskip("tunix.models.llama3.model")
qwen2 = pytest.importorskip("tunix.models.qwen2.model")
qwen3 = pytest.importorskip("tunix.models.qwen3.model")

# Tunix 0.1.7's models and trainers call APIs that flax 0.12, jax 0.10 and optax 0.2.8
# deprecate.
pytestmark = [
  pytest.mark.filterwarnings("ignore:'sharding' is deprecated:DeprecationWarning"),
  pytest.mark.filterwarnings("ignore:'.value' access is now deprecated:DeprecationWarning"),
  pytest.mark.filterwarnings("ignore:jax.interpreters.pxla.thread_resources:DeprecationWarning"),
  pytest.mark.filterwarnings("ignore:optax.global_norm is deprecated:DeprecationWarning"),
]


@pytest.fixture(autouse=True)
def _allow_rank_promotion():
  """Tunix's models broadcast by rank promotion (their norms' scales), which conftest.py
  makes an error for kldiv_jax's own code."""
  with jax.numpy_rank_promotion("allow"):
    yield


PAD, EOS, VOCAB = 0, 1, 37
SMALL = dict(num_layers=1, embed_dim=16, hidden_dim=32, num_heads=2, head_dim=8, num_kv_heads=1)


def tiny(family, *, seed=0, tied=True, dtype=jnp.float32, softcap=5.0, vocab=VOCAB):
  """A one-layer model of a Tunix family (``tied``: the embedder is the head)."""
  rngs = nnx.Rngs(seed)
  if family == "gemma":  # Gemma 2's logit soft-cap
    config = gemma.ModelConfig(
      num_embed=vocab, final_logit_softcap=softcap, use_post_attn_norm=True,
      use_post_ffw_norm=True, attention_types=[gemma.AttentionType.GLOBAL], **SMALL,
    )  # fmt: skip
    return gemma.Gemma(config, rngs=rngs)
  if family == "gemma3":
    config = gemma3.ModelConfig(num_embed=vocab, sliding_window_size=4, param_dtype=dtype, **SMALL)
    return gemma3.Gemma3(config, rngs=rngs)
  if family == "gemma4":
    config = gemma4.ModelConfig(
      num_embed=vocab, global_key_size=8, sliding_window_size=4, final_logit_softcap=softcap,
      dtype=dtype, param_dtype=dtype, **SMALL,
    )  # fmt: skip
    return gemma4.Gemma4(config, rngs=rngs)
  if family == "llama3":
    config = llama3.ModelConfig(
      vocab_size=vocab, rope_theta=10_000, norm_eps=1e-5, weight_tying=tied, **SMALL
    )
    return llama3.Llama3(config, rngs=rngs)
  module, cls = {"qwen2": (qwen2, qwen2.Qwen2), "qwen3": (qwen3, qwen3.Qwen3)}[family]
  config = module.ModelConfig(
    vocab_size=vocab, rope_theta=10_000, norm_eps=1e-6, use_tied_embedding=tied,
    dtype=dtype, param_dtype=dtype, **SMALL,
  )  # fmt: skip
  return cls(config, rngs=rngs)


# Each family once, in its usual head: (family, tied). Gemma and Gemma 4 soft-cap.
FAMILIES = [
  ("gemma", True),
  ("gemma3", True),
  ("gemma4", True),
  ("llama3", False),
  ("qwen2", False),
  ("qwen3", True),
]
FAMILY_IDS = [f"{f}-{'tied' if t else 'untied'}" for f, t in FAMILIES]


def _close(actual, expected, rtol=2e-5, atol=1e-6):
  np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=atol)


def _params(model):
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _tokens(seed=0, batch=3, prompt=4, completion=5):
  """Left-padded prompts and right-padded completions (one empty)."""
  rng = np.random.default_rng(seed)
  prompt_ids = rng.integers(2, VOCAB, (batch, prompt))
  prompt_ids[:, 0] = PAD
  lengths = np.array([completion, 2, 0, 3, 1])[:batch]
  mask = np.arange(completion) < lengths[:, None]
  completion_ids = np.where(mask, rng.integers(2, VOCAB, (batch, completion)), PAD)
  return jnp.asarray(prompt_ids), jnp.asarray(completion_ids), jnp.asarray(mask)


def _packed(seed=0):
  """One row, three sequences and padding, as tunix.rl.utils.pack_sequences lays it out."""
  rng = np.random.default_rng(seed)
  lengths, total = [5, 7, 4], 20
  segment_ids = np.zeros((1, total), np.int32)
  positions = np.zeros((1, total), np.int32)
  start = 0
  for i, n in enumerate(lengths, start=1):
    segment_ids[0, start : start + n], positions[0, start : start + n] = i, np.arange(n)
    start += n
  tokens = np.where(segment_ids > 0, rng.integers(2, VOCAB, (1, total)), PAD)
  mask = (segment_ids > 0) & (positions >= 2)  # the first two tokens: the prompt
  return jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(segment_ids), jnp.asarray(positions)


def _example(model, *, seed=0, per_token_advantages=False, packed=False, temperature=0.8):
  """A Tunix TrainExample: old and reference log-probs off the model's, so ratios clip."""
  rng = np.random.default_rng(seed)
  graphdef, state = nnx.split(model)
  if packed:
    completion, mask, segment_ids, positions = _packed(seed)
    prompt = jnp.zeros((1, 0), jnp.int32)
    extra = {"segment_ids": segment_ids, "segment_positions": positions}
    advantages = np.where(mask, rng.normal(size=mask.shape), 0.0)
  else:
    prompt, completion, mask = _tokens(seed)
    extra = {}
    shape = mask.shape if per_token_advantages else mask.shape[:1]
    advantages = rng.normal(size=shape)
  logp = common.compute_per_token_logps(
    graphdef, state, prompt, completion, PAD, EOS, temperature=temperature, **extra
  )
  return common.TrainExample(
    prompt_ids=prompt,
    prompt_mask=prompt != PAD,
    completion_ids=completion,
    completion_mask=jnp.asarray(mask, jnp.int32),
    advantages=jnp.asarray(advantages, jnp.float32),
    ref_per_token_logps=logp + 0.4 * jnp.asarray(rng.normal(size=logp.shape), jnp.float32),
    old_per_token_logps=logp + 0.7 * jnp.asarray(rng.normal(size=logp.shape), jnp.float32),
    **extra,
  )


def _config(cls, temperature=0.8, **options):
  extra = {k: options.pop(k) for k in ("epsilon_high", "epsilon_c") if k in options}
  config = cls(num_generations=2, **options)
  config.temperature = temperature  # what GRPOLearner sets from the rollout configuration
  for k, v in extra.items():
    setattr(config, k, v)
  return config


def _learner_calls(model, example, *configs):
  """Value and gradient of each configured loss, called as GRPOLearner's loss_fn calls it;
  all in one jit (one compilation)."""

  @nnx.jit
  def calls(model, example):
    out = []
    for config in configs:
      fn = function_registry.get_policy_loss_fn(config.policy_loss_fn)
      loss = lambda m, fn=fn, c=config: fn(m, example, algo_config=c, pad_id=PAD, eos_id=EOS)  # noqa: E731
      out.append(nnx.value_and_grad(loss, has_aux=True)(model))
    return out

  return calls(model, example)


def _head_logits(hidden, head):
  z = (hidden.astype(head.weight.dtype) @ head.weight).astype(jnp.float32)
  return z if head.softcap is None else jnp.tanh(z / head.softcap) * head.softcap


# Models and per-token log-probs ----------------------------------------------------------------


@pytest.mark.parametrize(
  ("family", "tied", "dtype"),
  [*((f, t, jnp.float32) for f, t in FAMILIES), ("qwen3", False, jnp.float32),
   ("llama3", True, jnp.float32), ("gemma3", True, jnp.bfloat16),
   ("qwen2", True, jnp.bfloat16)],
)  # fmt: skip
def test_family_hidden_states_head_and_log_probs(family, tied, dtype):
  """Every family, tied or not, bf16 too: softcap(hidden @ head) is the model's own logits,
  and per_token_logps is Tunix's compute_per_token_logps (at a temperature)."""
  model = tiny(family, tied=tied, dtype=dtype)
  assert hasattr(model, "lm_head") != tied
  prompt, completion, _ = _tokens(2)

  @nnx.jit
  def run(model):
    mask = prompt != PAD
    kwargs = dict(
      positions=common.build_positions_from_mask(mask),
      attention_mask=common.make_causal_attn_mask(mask),
    )
    logits, _ = model(prompt, cache=None, **kwargs)
    z = _head_logits(kt.hidden_states(model, prompt, **kwargs), kt.lm_head(model))
    graphdef, state = nnx.split(model)
    args = (graphdef, state, prompt, completion, PAD, EOS)
    stock = common.compute_per_token_logps(*args, temperature=0.7)
    return logits.astype(jnp.float32), z, stock, kt.per_token_logps(*args, temperature=0.7)

  logits, z, stock, fused = run(model)
  head = kt.lm_head(model)
  assert head.softcap == ({"gemma": 5.0, "gemma4": 5.0}.get(family))
  assert head.weight.shape == (SMALL["embed_dim"], VOCAB)
  assert fused.shape == stock.shape == completion.shape and fused.dtype == stock.dtype
  # bf16: the logits' own rounding (a bf16 step at |z| ~ 4 is 1.6e-2), both sides alike.
  tol = dict(rtol=2e-5, atol=1e-6) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
  _close(z, logits, **tol)
  _close(fused, stock, **tol)


def test_missing_attributes_are_named():
  """A model with neither switch nor final_norm, or no head, fails naming the attribute."""

  class NoHead(nnx.Module):
    def __init__(self):
      self.embed = nnx.Embed(VOCAB, 4, rngs=nnx.Rngs(0))

    def __call__(self, tokens, positions=None, cache=None, attention_mask=None):
      return self.embed(tokens) @ self.embed.embedding[...].T, cache

  with pytest.raises(AttributeError, match="'final_norm'"):
    kt.hidden_states(NoHead(), jnp.ones((1, 3), jnp.int32))
  with pytest.raises(AttributeError, match=r"'embedder\.input_embedding'"):
    kt.lm_head(NoHead())
  lora = tiny("qwen3", tied=False)
  lora.lm_head.lora_a = nnx.LoRAParam(jnp.zeros((SMALL["embed_dim"], 2)))
  with pytest.raises(NotImplementedError, match="lm_head carries a LoRA adapter"):
    kt.lm_head(lora)


@pytest.mark.parametrize(("family", "tied"), [("qwen3", True), ("llama3", False)])
def test_no_logits_array_in_the_compiled_programs(family, tied):
  """XLA's compiled log-prob pass and policy-loss gradient hold no [B, L, V] array (the
  model's own logits, unread, are removed), where Tunix's hold several; both routes to the
  hidden states (Qwen 3's switch, Llama 3's final_norm)."""
  vocab = 1031  # a size no other axis has
  graphdef, state = nnx.split(tiny(family, tied=tied, vocab=vocab))
  prompt, completion, _ = _tokens(2)
  logits = re.compile(rf"\[{prompt.shape[0]},\d+,{vocab}\]")
  args = (graphdef, state, prompt, completion, PAD, EOS)
  stock = jax.jit(common.compute_per_token_logps, static_argnums=(4, 5)).lower(*args)
  fused = jax.jit(kt.per_token_logps, static_argnums=(4, 5)).lower(*args)
  assert logits.search(stock.compile().as_text())
  assert not logits.search(fused.compile().as_text())
  example = common.TrainExample(
    prompt_ids=prompt, prompt_mask=prompt != PAD, completion_ids=completion,
    completion_mask=(completion != PAD).astype(jnp.int32),
    advantages=jnp.ones(prompt.shape[:1]), ref_per_token_logps=None,
    old_per_token_logps=jnp.full(completion.shape, -3.0),
  )  # fmt: skip
  for config, expect in [(_config(kt.PolicyLossConfig), False), (_config(GRPOConfig), True)]:
    fn = function_registry.get_policy_loss_fn(config.policy_loss_fn)

    def loss(state, fn=fn, config=config):
      model = nnx.merge(graphdef, state)
      return fn(model, example, algo_config=config, pad_id=PAD, eos_id=EOS)[0]

    text = jax.jit(jax.grad(loss)).lower(state).compile().as_text()
    assert bool(logits.search(text)) == expect, config.policy_loss_fn


def test_per_token_logps_packed():
  graphdef, state = nnx.split(tiny("qwen3"))
  tokens, _, segment_ids, positions = _packed(3)
  packing = dict(segment_ids=segment_ids, segment_positions=positions, temperature=0.9)
  empty = jnp.zeros((1, 0), jnp.int32)
  expected = common.compute_per_token_logps(graphdef, state, empty, tokens, PAD, EOS, **packing)
  actual = kt.per_token_logps(graphdef, state, empty, tokens, PAD, EOS, **packing)
  assert float(actual[0, 0]) == 0.0
  _close(actual, expected)


def test_use_fused_log_probs_is_where_the_learners_look():
  """Tunix's RL cluster, inference worker and rollouts call common.compute_per_token_logps."""
  inference_worker = pytest.importorskip("tunix.rl.inference.inference_worker")
  stock = common.compute_per_token_logps
  model = tiny("qwen3")
  graphdef, state = nnx.split(model)
  prompt, completion, _ = _tokens(5)
  worker = inference_worker.InferenceWorker({"reference": model})
  expected = worker.get_ref_per_token_logps(prompt, completion, PAD, EOS, temperature=0.7)
  with kt.use_fused_log_probs():
    assert common.compute_per_token_logps is kt.per_token_logps
    actual = worker.get_ref_per_token_logps(prompt, completion, PAD, EOS, temperature=0.7)
    # A caller that asks for the logits gets Tunix's function, loudly.
    with pytest.warns(kt.MaterializedLogitsWarning, match="return_logits"):
      _, logits = common.compute_per_token_logps(
        graphdef, state, prompt, completion, PAD, EOS, return_logits=True
      )
    assert logits.shape == (*completion.shape, VOCAB)
  assert common.compute_per_token_logps is stock
  _close(actual, expected)
  kt.use_fused_log_probs()  # for good, as a script would
  try:
    assert common.compute_per_token_logps is kt.per_token_logps
  finally:
    common.compute_per_token_logps = stock


# RL: the registered policy loss ---------------------------------------------------------------

CASES = [
  ("token-mean", "kl", "grpo", {"epsilon_high": 0.28, "epsilon_c": 1.05}),
  ("sequence-mean-token-mean", "low_var_kl", "grpo", {}),
  ("seq-mean-token-sum", "mse_kl", "grpo", {"epsilon_c": 1.05}),
  ("sequence-mean-token-sum-norm", "low_var_kl", "grpo", {}),
  ("sequence-mean-token-scale", "kl", "grpo", {"epsilon_high": 0.3}),
  ("token-mean", "low_var_kl", "gspo-token", {}),
]


def test_registered_loss_equals_tunix_grpo():
  """Each aggregation, KL estimator, clip and loss_algo: Tunix's "grpo" value, gradient and
  metrics (per-token advantages in some cases)."""
  model = tiny("qwen3", seed=1)
  examples = {False: _example(model), True: _example(model, per_token_advantages=True)}
  configs = {}
  for mode, kl_mode, algo, options in CASES:
    kwargs = dict(beta=0.04, kl_loss_mode=kl_mode, loss_agg_mode=mode, loss_algo=algo)
    kwargs |= dict(epsilon=0.2, **options)
    per_token = algo == "grpo" and bool(options)
    configs.setdefault(per_token, []).extend(
      [_config(kt.PolicyLossConfig, **kwargs), _config(GRPOConfig, **kwargs)]
    )
  results = {k: _learner_calls(model, examples[k], *v) for k, v in configs.items()}
  for per_token, out in results.items():
    for i in range(0, len(out), 2):
      ((loss, aux), grads), ((t_loss, t_aux), t_grads) = out[i], out[i + 1]
      config = configs[per_token][i]
      case = (config.loss_agg_mode, config.kl_loss_mode, config.loss_algo, per_token)
      assert abs(float(loss)) > 1e-3, case
      _close(loss, t_loss)
      jax.tree.map(_close, nnx.to_pure_dict(grads), nnx.to_pure_dict(t_grads))
      keys = ["pg_loss", "pg_clipfrac", "ppo_kl", "kl", "is_ratio/mean", "is_ratio/max"]
      keys += ["is_ratio/min"]
      if config.loss_agg_mode == "token-mean":
        keys += ["pg_clipfrac_lower", "entropy"]
      for key in keys:
        _close(aux[key], t_aux[key])
      if config.loss_algo == "grpo":
        assert float(aux["pg_clipfrac"]) > 0, case  # the clip is exercised
      if getattr(config, "epsilon_c", None) is not None:
        assert float(aux["pg_clipfrac_lower"]) > 0, case  # and the dual clip


def test_ppo_config_equals_tunix_ppo():
  """Tunix's PPO learner's configuration with "kldiv_jax": its "ppo" loss's value, gradient
  and metrics (clips, dual clip, entropy bonus; its KL needs a kl_coef that PPOConfig, a
  slotted dataclass, cannot hold)."""
  ppo_learner = pytest.importorskip("tunix.rl.ppo.ppo_learner")
  model = tiny("qwen3", seed=5)
  # Per-token advantages (GAE); Tunix's "ppo" loss applies no temperature.
  example = _example(model, seed=6, per_token_advantages=True, temperature=1.0)
  configs = []
  for name in ("kldiv_jax", "ppo"):
    config = ppo_learner.PPOConfig(
      policy_loss_fn=name, epsilon_low=0.2, epsilon_high=0.28, epsilon_c=1.05,
      entropy_coef=0.01,
    )  # fmt: skip
    configs.append(config)
  assert not hasattr(configs[0], "kl_coef")
  ((loss, aux), grads), ((t_loss, t_aux), t_grads) = _learner_calls(model, example, *configs)
  _close(loss, t_loss)
  jax.tree.map(_close, nnx.to_pure_dict(grads), nnx.to_pure_dict(t_grads))
  for key in ("pg_clipfrac", "pg_clipfrac_lower", "loss/entropy"):
    _close(aux[key], t_aux[key])
  assert float(aux["pg_clipfrac"]) > 0 and float(aux["pg_clipfrac_lower"]) > 0


def test_policy_loss_options_reach_fused_policy_loss():
  """A surrogate Tunix lacks (CISPO) and an entropy bonus, through the configuration."""
  model = tiny("qwen3", seed=2)
  example = _example(model, seed=1)
  config = _config(
    kt.PolicyLossConfig, beta=0.0, loss_agg_mode="token-mean", epsilon=0.2,
    surrogate="cispo", policy_loss_options={"clip_high": 4.0, "entropy_coef": 0.01},
  )  # fmt: skip

  @jax.jit
  def expected(state):
    logp, logits = common.compute_per_token_logps(
      graphdef, state, example.prompt_ids, example.completion_ids, PAD, EOS,
      return_logits=True, temperature=0.8,
    )  # fmt: skip
    return kldiv_jax.policy_loss(
      logp, example.old_per_token_logps, example.advantages, surrogate="cispo", clip_low=0.2,
      clip_high=4.0, where=example.completion_mask.astype(bool),
      entropy=algo_core.compute_entropy_from_logits(logits), entropy_coef=0.01,
    )[0]  # fmt: skip

  graphdef, state = nnx.split(model)
  stock = _config(GRPOConfig, beta=0.0, loss_agg_mode="token-mean")
  ((loss, _), _), ((t_loss, _), _) = _learner_calls(model, example, config, stock)
  _close(loss, expected(state))
  assert abs(float(loss) - float(t_loss)) > 1e-4  # not Tunix's PPO surrogate


def test_sampler_importance_weights():
  """Tunix's precomputed TIS weights: its "grpo" loss, value and gradient."""
  model = tiny("qwen3", seed=3)
  example = _example(model, seed=2)
  rng = np.random.default_rng(3)
  mask = example.completion_mask.astype(bool)
  sampler = example.old_per_token_logps + 0.5 * rng.normal(size=mask.shape)
  # As Tunix's agentic GRPO learner computes them (sampler_is == "token").
  log_ratio = jnp.clip(example.old_per_token_logps - sampler, -20.0, 20.0)
  weights = jnp.minimum(jnp.exp(log_ratio), 1.5) * mask
  assert float(jnp.max(jnp.where(mask, weights, 0.0))) == 1.5  # the threshold is exercised
  example = example.replace(sampler_is_weights=weights)
  kwargs = dict(beta=0.04, loss_agg_mode="sequence-mean-token-mean", epsilon=0.2)
  configs = _config(kt.PolicyLossConfig, **kwargs), _config(GRPOConfig, **kwargs)
  ((loss, _), grads), ((t_loss, _), t_grads) = _learner_calls(model, example, *configs)
  _close(loss, t_loss)
  jax.tree.map(_close, nnx.to_pure_dict(grads), nnx.to_pure_dict(t_grads))
  with pytest.raises(ValueError, match="old_per_token_logps"):
    kt.policy_loss_options(configs[0], example.replace(old_per_token_logps=None))


def test_packed_rows():
  """Packed rows: token-mean equals Tunix's; per-sequence means here, per-row in Tunix
  (Tunix's equals policy_loss without segment_ids, a row one sequence)."""
  model = tiny("qwen3", seed=4)
  ex = _example(model, seed=3, packed=True)
  modes = ("token-mean", "sequence-mean-token-mean")
  configs = [
    _config(cls, beta=0.04, loss_agg_mode=mode, epsilon=0.2)
    for mode in modes
    for cls in (kt.PolicyLossConfig, GRPOConfig)
  ]
  out = _learner_calls(model, ex, *configs)
  logp = common.compute_per_token_logps(
    *nnx.split(model), ex.prompt_ids, ex.completion_ids, PAD, EOS, segment_ids=ex.segment_ids,
    segment_positions=ex.segment_positions, temperature=0.8,
  )  # fmt: skip
  for i, mode in enumerate(modes):
    ((loss, _), _), ((t_loss, _), _) = out[2 * i], out[2 * i + 1]
    per_row, _ = kldiv_jax.policy_loss(
      logp, ex.old_per_token_logps, ex.advantages, where=ex.completion_mask > 0,
      aggregation={"token-mean": "token-mean"}.get(mode, "seq-mean-token-mean"), ref_log_probs=ex.ref_per_token_logps, beta=0.04,
      kl_estimator="k1",
    )  # fmt: skip
    _close(t_loss, per_row)
    if mode == "token-mean":
      _close(loss, t_loss)
    else:
      assert abs(float(loss) - float(t_loss)) > 1e-4


def test_kl_clamp_value_is_refused():
  config = _config(kt.PolicyLossConfig, beta=0.04, kl_clamp_value=10.0)
  with pytest.raises(ValueError, match="kl_clip"):
    kt.policy_loss_options(config, _example(tiny("qwen3")))


class _Record(hooks.TrainingHooks):
  """Each train step's loss and parameters, as the trainer reports them."""

  def __init__(self):
    self.steps = []

  def on_train_step_end(self, train_ctx, train_step, train_loss):
    self.steps.append((float(train_loss), _params(train_ctx.model)))

  def on_train_start(self, train_ctx): ...
  def on_train_end(self, train_ctx): ...
  def on_train_step_start(self, train_ctx): ...
  def on_eval_step_start(self, train_ctx): ...
  def on_eval_step_end(self, train_ctx, eval_loss): ...


def _grpo_steps(make_model, example, config, steps=2):
  """Tunix's RL actor trainer, wired as GRPOLearner wires it, for a few steps."""
  record = _Record()
  trainer = rl_trainer.Trainer(
    make_model(),
    optax.sgd(0.3),
    peft_trainer.TrainingConfig(eval_every_n_steps=100, max_steps=steps),
    custom_checkpoint_metadata_fn=dict,
  )
  policy_loss_fn = function_registry.get_policy_loss_fn(config.policy_loss_fn)
  trainer.with_loss_fn(
    lambda model, train_example, algo_config: policy_loss_fn(
      model, train_example, algo_config=config, pad_id=PAD, eos_id=EOS
    ),
    has_aux=True,
  )
  trainer.with_gen_model_input_fn(lambda x: {"train_example": x, "algo_config": config})
  trainer.with_rl_metrics_to_log({"kl": np.mean, "pg_clipfrac": np.mean})
  trainer.with_training_hooks(record)
  trainer.train([example] * steps)
  return record.steps


def _same_steps(steps, t_steps, initial, rtol=2e-5, atol=1e-6):
  assert len(steps) == len(t_steps) >= 1
  close = lambda a, b: _close(np.float32(a), np.float32(b), rtol=rtol, atol=atol)  # noqa: E731
  for (loss, params), (t_loss, t_params) in zip(steps, t_steps):
    close(loss, t_loss)
    jax.tree.map(close, params, t_params)
  moved = jax.tree.map(
    lambda a, b: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b))), t_steps[-1][1], initial
  )
  assert max(jax.tree.leaves(moved)) > 1e-3  # the steps moved the parameters


@pytest.mark.parametrize(("family", "tied"), FAMILIES, ids=FAMILY_IDS)
def test_grpo_train_steps_equal_stock(family, tied):
  """Every family: Tunix's actor trainer with "kldiv_jax" and with Tunix's "grpo", from the
  same model and example: the same loss and parameters after each step."""
  make = lambda: tiny(family, tied=tied, seed=5)  # noqa: E731
  example = _example(make(), seed=4)
  kwargs = dict(beta=0.04, loss_agg_mode="token-mean", epsilon=0.2, kl_loss_mode="low_var_kl")
  steps = _grpo_steps(make, example, _config(kt.PolicyLossConfig, **kwargs))
  t_steps = _grpo_steps(make, example, _config(GRPOConfig, **kwargs))
  assert len(steps) == 2
  _same_steps(steps, t_steps, _params(make()))


def test_grpo_train_step_bf16():
  """bf16 parameters: one step within bf16's rounding of Tunix's (logits rounded to bf16)."""
  make = lambda: tiny("qwen3", tied=False, dtype=jnp.bfloat16, seed=6)  # noqa: E731
  example = _example(make(), seed=5)
  kwargs = dict(beta=0.04, loss_agg_mode="token-mean", epsilon=0.2)
  steps = _grpo_steps(make, example, _config(kt.PolicyLossConfig, **kwargs), 1)
  t_steps = _grpo_steps(make, example, _config(GRPOConfig, **kwargs), 1)
  _same_steps(steps, t_steps, _params(make()), rtol=2e-2, atol=2e-2)


# RL: Tunix's GRPOLearner end to end ----------------------------------------------------------

BOS = 2


class _WordTokenizer:
  """Token ``i`` is the word ``"w{i}"``: Tunix's TokenizerAdapter takes any object with these
  five methods."""

  def encode(self, text, **kwargs):
    return [int(word[1:]) for word in text.split()]

  def decode(self, ids, **kwargs):
    return " ".join(f"w{i}" for i in ids)

  def bos_id(self):
    return BOS

  def eos_id(self):
    return EOS

  def pad_id(self):
    return PAD


def _distinct_words(prompts, completions, **kwargs):
  """The reward: how many different tokens a completion has."""
  return [float(len(set(text.split()))) for text in completions]


# Two batches of two prompts (as grain batches them: arrays of strings), each prompt sampled
# twice (num_generations=2) and each batch trained on twice (num_iterations=2).
_PROMPTS = [["w5 w6 w7", "w8 w9"], ["w10 w11 w12 w13", "w3"]]


def _spy(monkeypatch, module, name):
  """Record the arguments of each call of ``module.name`` (in any thread)."""
  calls, original = [], getattr(module, name)

  def spy(*args, **kwargs):
    calls.append((args, kwargs))
    return original(*args, **kwargs)

  monkeypatch.setattr(module, name, spy)
  return calls


def _grpo_learner_run(options, *, fused, packing=None):
  """Tunix's GRPOLearner on CPU: its vanilla rollout sampling from the actor it trains, a
  reference model of its own, 2 rollouts of 2 steps each; switched to kldiv_jax (``fused``)
  as docs/tunix.md tells a user. Returns each rollout's TrainExample, each step's loss and
  parameters, the trainer's metrics, and the cluster."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
  cluster = rl_cluster.RLCluster(
    actor=tiny("qwen3", seed=13),
    reference=tiny("qwen3", seed=14),
    tokenizer=_WordTokenizer(),
    cluster_config=rl_cluster.ClusterConfig(
      role_to_mesh=dict.fromkeys(rl_cluster.Role, mesh),
      rollout_engine="vanilla",
      training_config=rl_cluster.RLTrainingConfig(
        actor_optimizer=optax.sgd(0.3),
        eval_every_n_steps=100,
        max_steps=4,
        max_seq_token_per_tpu=packing,
      ),
      rollout_config=base_rollout.RolloutConfig(
        max_tokens_to_generate=6,
        max_prompt_length=8,
        kv_cache_size=32,
        temperature=0.8,
        seed=3,
      ),
    ),
  )
  config = GRPOConfig(policy_loss_fn="kldiv_jax" if fused else "grpo", **options)
  learner = grpo_learner.GRPOLearner(cluster, config, _distinct_words)
  assert not learner.should_sync_weights  # the rollout samples from the model trained
  record, examples = _Record(), []
  cluster.actor_trainer.with_training_hooks(record)
  generate = learner._generate_and_compute_advantage  # each rollout's TrainExample

  def rollout(*args, **kwargs):
    examples.append(generate(*args, **kwargs))
    return examples[-1]

  learner._generate_and_compute_advantage = rollout
  data = [{"prompts": np.array(prompts)} for prompts in _PROMPTS]
  with kt.use_fused_log_probs() if fused else contextlib.nullcontext():
    learner.train(data)
  logger = cluster.actor_trainer.metrics_logger
  metrics = {
    k: logger.get_metric_history("actor", k, "train") for k in ("loss", "kl", "pg_clipfrac")
  }
  return examples, record.steps, metrics, cluster


@pytest.fixture
def _allow_rank_promotion_in_every_thread():
  """The learner samples and computes its log-probs in a thread of its own, which the
  (thread-local) context of _allow_rank_promotion does not reach."""
  previous = jax.config.jax_numpy_rank_promotion
  jax.config.update("jax_numpy_rank_promotion", "allow")
  yield
  jax.config.update("jax_numpy_rank_promotion", previous)


@pytest.mark.usefixtures("_allow_rank_promotion_in_every_thread")
@pytest.mark.filterwarnings(
  "ignore:`with mesh.` context manager has been deprecated:DeprecationWarning"
)
@pytest.mark.parametrize(
  ("options", "packing"),
  [
    (dict(beta=0.04, kl_loss_mode="low_var_kl", num_iterations=2), None),
    # Packed rows: token-mean (Tunix's per-sequence means are per row, see test_packed_rows).
    (dict(beta=0.04, loss_agg_mode="token-mean", epsilon=0.1, num_iterations=2), 40),
  ],
  ids=["docs-config", "packed-token-mean"],
)
def test_grpo_learner_with_rollout_equals_stock(monkeypatch, options, packing):
  """Tunix's whole GRPOLearner, rollout included, stock (its "grpo" loss and log-prob
  passes) and with policy_loss_fn="kldiv_jax" plus use_fused_log_probs(), from the same
  seed: the same sampled completions (so rewards) and advantages, exactly; the same
  reference and old-policy log-probs, and the same loss, KL, clip fraction and parameters
  after each step, to float32 rounding. The fused run hands fused_policy_loss the hidden
  states and the head, its passes go through per_token_logps and none to Tunix's function
  (a materialising fallback warns: an error here).

  Tolerance: the module's (rtol=2e-5, atol=1e-6). Measured here: the log-probs differ by
  one float32 ulp (2.4e-7 at |log p| ~ 3.7), the parameters by at most 1.3e-7 after 4 steps;
  a temperature off by 1e-3 or a beta off by 1e-2 fails at 1e-4. The completions are exact:
  the sampler calls no kldiv_jax code, and the second rollout samples from parameters that
  differ by those ulps, which moves a sampled token only at a near-tie of two logits (none
  at this seed)."""
  with monkeypatch.context() as m:
    stock_calls = _spy(m, common, "compute_per_token_logps")
    stock = _grpo_learner_run(options, fused=False, packing=packing)
  with monkeypatch.context() as m, warnings.catch_warnings():
    warnings.simplefilter("error", kt.MaterializedLogitsWarning)
    passes = _spy(m, _tunix_rl, "per_token_logps")  # what use_fused_log_probs installs
    materialised = _spy(m, _tunix_rl, "_STOCK")
    losses = _spy(m, _tunix_rl, "fused_policy_loss")
    fused = _grpo_learner_run(options, fused=True, packing=packing)
  (examples, steps, metrics, cluster), (t_examples, t_steps, t_metrics, t_cluster) = fused, stock
  # 2 rollouts, each with a reference pass and an old-policy pass (num_iterations > 1).
  t_passes = [c for c in stock_calls if not c[1].get("return_logits")]
  assert len(examples) == len(t_examples) == 2 and len(passes) == len(t_passes) == 4
  # The passes called as Tunix calls them: the reference at the rollout's temperature, the
  # old policy (Tunix 0.1.7's rollout get_per_token_logps passes none) at 1.
  temperatures = [[kw.get("temperature", 1.0) for _, kw in c] for c in (passes, t_passes)]
  assert temperatures[0] == temperatures[1] == [0.8, 1.0, 0.8, 1.0]
  assert not materialised
  assert losses, "fused_policy_loss was never called"
  for (hidden, head, *_), kwargs in losses:  # hidden states [B, K, H] and the head [H, V]
    assert hidden.ndim == 3 and hidden.shape[-1] == head.shape[0] == SMALL["embed_dim"]
    assert head.shape == (SMALL["embed_dim"], VOCAB)
    assert (kwargs["segment_ids"] is None) == (packing is None)
  for ex, t_ex in zip(examples, t_examples):
    for key in ("prompt_ids", "completion_ids", "completion_mask", "advantages"):
      np.testing.assert_array_equal(getattr(ex, key), getattr(t_ex, key), err_msg=key)
    _close(ex.ref_per_token_logps, t_ex.ref_per_token_logps)
    _close(ex.old_per_token_logps, t_ex.old_per_token_logps)
    assert np.any(np.asarray(ex.advantages) != 0)
  assert len(steps) == len(t_steps) >= 2
  _same_steps(steps, t_steps, _params(tiny("qwen3", seed=13)))
  for key in ("loss", "kl", "pg_clipfrac"):
    _close(metrics[key], t_metrics[key])
  assert max(t_metrics["pg_clipfrac"]) > 0  # a second pass over a batch clips
  if packing is None:
    # The train step the learner runs, compiled: no [B, L, V] array (the model's own
    # logits, unread, are removed), where Tunix's has them.
    logits = re.compile(rf"\[{examples[0].completion_ids.shape[0]},\d+,{VOCAB}\]")
    for trainer, expect in [(cluster.actor_trainer, False), (t_cluster.actor_trainer, True)]:
      step = nnx.jit(trainer.create_train_step_fn())  # what the trainer jits
      text = step.lower(trainer.model, trainer.optimizer, examples[0]).compile().as_text()
      assert bool(logits.search(text)) == expect
    # Tunix's own "grpo" loss, as the learner wired it, asks for the logits: with the
    # fused log-probs installed that is loud, not a silent [B, L, V] pass.
    with kt.use_fused_log_probs(), pytest.warns(kt.MaterializedLogitsWarning):
      t_cluster.actor_trainer.loss_fn(t_cluster.actor_trainer.model, t_examples[0], None)


# Distillation -----------------------------------------------------------------------------------


def _distillation_batch(seed=0, padded=False):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(2, VOCAB, (2, 6))
  mask = np.ones_like(tokens, bool)
  if padded:
    mask[1, :2] = False  # left padding
    tokens = np.where(mask, tokens, PAD)
  return distillation_trainer.TrainingInput(
    input_tokens=jnp.asarray(tokens), input_mask=jnp.asarray(mask)
  )


def _logits_forward(model, input_tokens, input_mask):
  mask = input_mask.astype(bool)
  logits, _ = model(
    input_tokens,
    positions=common.build_positions_from_mask(mask),
    cache=None,
    attention_mask=common.make_causal_attn_mask(mask),
  )
  return logits


def _one_hot_labels(input_tokens, input_mask):
  return jax.nn.one_hot(jnp.roll(input_tokens, -1, axis=-1), VOCAB)


def _every_token(input_tokens, input_mask):
  return jnp.ones(input_tokens.shape, bool)


def _distill_steps(strategy, student, teacher, batch, steps=2):
  record = _Record()
  config = distillation_trainer.TrainingConfig(eval_every_n_steps=100, max_steps=steps)
  trainer = distillation_trainer.DistillationTrainer(
    student, teacher, strategy, optax.sgd(0.5), config
  )
  trainer.with_training_hooks(record)
  trainer.train([batch] * steps)
  return record.steps


@pytest.mark.parametrize(("family", "tied"), FAMILIES, ids=FAMILY_IDS)
def test_distillation_train_steps_equal_stock(family, tied):
  """Every family: Tunix's DistillationTrainer with FusedLogitStrategy and with its own
  LogitStrategy (every token counted, as LogitStrategy counts them): the same loss and
  parameters after each step."""
  options = dict(temperature=2.0, alpha=0.3)
  make_student = lambda: tiny(family, tied=tied, seed=7)  # noqa: E731
  teacher = tiny(family, tied=tied, seed=8, softcap=7.0)
  batch = _distillation_batch(1)
  fused = kt.FusedLogitStrategy(kt.next_token_labels, _every_token, **options)
  stock = logit.LogitStrategy(_logits_forward, _logits_forward, _one_hot_labels, **options)
  steps = _distill_steps(fused, make_student(), teacher, batch)
  t_steps = _distill_steps(stock, make_student(), teacher, batch)
  assert len(steps) == 2
  _same_steps(steps, t_steps, _params(make_student()))


def test_distillation_train_step_bf16():
  """bf16 parameters (Gemma 3's default): one step within bf16's rounding of Tunix's."""
  make_student = lambda: tiny("gemma3", dtype=jnp.bfloat16, seed=7)  # noqa: E731
  teacher = tiny("gemma3", dtype=jnp.bfloat16, seed=8)
  batch = _distillation_batch(1)
  fused = kt.FusedLogitStrategy(kt.next_token_labels, _every_token)
  stock = logit.LogitStrategy(_logits_forward, _logits_forward, _one_hot_labels)
  steps = _distill_steps(fused, make_student(), teacher, batch, steps=1)
  t_steps = _distill_steps(stock, make_student(), teacher, batch, steps=1)
  _same_steps(steps, t_steps, _params(make_student()), rtol=2e-2, atol=2e-2)


def test_distillation_strategy_masks_padding_and_any_divergence():
  """With padding, the mask leaves it out (Tunix's LogitStrategy averages it in); any
  divergence; the eval loss is the student's cross entropy over the kept tokens."""
  student, teacher = tiny("qwen3", seed=9), tiny("qwen3", seed=10, tied=False)
  batch = _distillation_batch(2, padded=True)
  inputs = {"input_tokens": batch.input_tokens, "input_mask": batch.input_mask}
  options = [dict(divergence="jsd", beta=0.3, alpha=0.8), dict(alpha=0.3)]
  strategies = [kt.FusedLogitStrategy(**o) for o in options]
  teacher_outputs = [s.get_teacher_outputs(teacher, inputs) for s in strategies]
  assert isinstance(teacher_outputs[0], kt.TeacherOutput)
  stock = logit.LogitStrategy(_logits_forward, _logits_forward, _one_hot_labels, alpha=0.3)

  @nnx.jit
  def run(student, teacher, teacher_outputs):
    s_logits, t_logits = _logits_forward(student, **inputs), _logits_forward(teacher, **inputs)
    train = [s.get_train_loss(student, t, inputs) for s, t in zip(strategies, teacher_outputs)]
    eval_loss, _ = strategies[0].get_eval_loss(student, inputs)
    one_hot = _one_hot_labels(**inputs)
    t_loss, _ = stock.compute_loss(s_logits, t_logits, one_hot)
    pad = ~next_mask  # Tunix's loss of the tokens the mask leaves out, alone
    t_pad, _ = stock.compute_loss(s_logits[pad], t_logits[pad], one_hot[pad])
    return s_logits, t_logits, train, eval_loss, (t_loss, t_pad)

  labels, mask = kt.next_token_labels(**inputs), kt.next_token_mask(**inputs)
  next_mask = np.asarray(mask)
  s_logits, t_logits, train, eval_loss, (t_loss, t_pad) = run(student, teacher, teacher_outputs)
  assert not bool(mask.all())
  for o, (loss, _) in zip(options, train):
    o = {"temperature": 2.0} | o  # LogitStrategy's default temperature
    _close(loss, kldiv_jax.distillation_loss(s_logits, t_logits, labels, where=mask, **o))
  soft = kldiv_jax.distillation_loss(s_logits, t_logits, where=mask, temperature=2.0)
  _close(train[1][1]["distill/soft_loss"], soft)
  ce = optax.softmax_cross_entropy_with_integer_labels(s_logits, labels)
  _close(eval_loss, ce[mask].mean())
  # Tunix's mean over all B * S tokens is this loss over the kept ones and its own loss of
  # the rest, weighted by their numbers: the whole difference is the padding it counts.
  kept = int(mask.sum())
  _close(t_loss * mask.size, train[1][0] * kept + t_pad * (mask.size - kept))


def test_topk_strategy():
  """A top-k teacher (computed chunked from a teacher model, or stored): the loss of
  fused_topk_distillation_loss equals divergence_from_topk on the student's logits plus the
  cross entropy; and a step of Tunix's trainer with it."""
  student, teacher = tiny("gemma", seed=11), tiny("gemma", seed=12, softcap=7.0)
  batch = _distillation_batch(3, padded=True)
  inputs = {"input_tokens": batch.input_tokens, "input_mask": batch.input_mask}
  strategy = kt.FusedTopKStrategy(
    kt.topk_teacher(4, chunk_size=5), temperature=1.5, alpha=0.6, tail="bucket"
  )
  ids, log_probs = strategy.get_teacher_outputs(teacher, inputs)
  labels, mask = kt.next_token_labels(**inputs), kt.next_token_mask(**inputs)

  @nnx.jit
  def run(student, teacher):
    loss, _ = strategy.get_train_loss(student, (ids, log_probs), inputs)
    s_logits, t_logits = _logits_forward(student, **inputs), _logits_forward(teacher, **inputs)
    soft = kldiv_jax.divergence_from_topk(
      s_logits, ids, log_probs, temperature=1.5, tail="bucket", where=mask
    )
    ce = optax.softmax_cross_entropy_with_integer_labels(s_logits, labels)
    expected = jnp.sum(jnp.where(mask, 0.6 * 1.5**2 * soft + 0.4 * ce, 0.0)) / jnp.sum(mask)
    return loss, expected, jax.lax.top_k(jax.nn.log_softmax(t_logits), 4)

  loss, expected, (want_lp, want_ids) = run(student, teacher)
  _close(log_probs, want_lp)
  np.testing.assert_array_equal(ids, want_ids)
  _close(loss, expected)
  [(step_loss, _)] = _distill_steps(strategy, student, teacher, batch, steps=1)
  _close(step_loss, loss)


# Any Flax NNX model: the page's recipe ----------------------------------------------------------

PAGE = Path(__file__).resolve().parent.parent / "docs" / "tunix.md"


@pytest.fixture(scope="module")
def recipe():
  """The code block of the page's "Any Flax NNX model" section, run as the page shows it."""
  section = PAGE.read_text().split("## Any Flax NNX model\n", 1)[1].split("\n## ", 1)[0]
  [code] = re.findall(r"```python\n(.*?)```", section, re.S)
  namespace = {"__name__": "docs_tunix_recipe"}
  exec(compile(code, str(PAGE), "exec"), namespace)
  return namespace


@pytest.mark.parametrize("tied", [False, True], ids=["biased-head", "tied-head"])
def test_any_nnx_model_recipe(recipe, tied):
  """The recipe's fused losses equal the same losses on the model's own (soft-capped, biased)
  logits, and its two routes to the hidden states agree."""
  rng = np.random.default_rng(6)
  model = recipe["TinyLM"](VOCAB, 8, tied=tied, softcap=3.0, rngs=nnx.Rngs(0))
  teacher = recipe["TinyLM"](VOCAB, 8, tied=not tied, softcap=4.0, rngs=nnx.Rngs(1))
  for m in (model, teacher):
    if m.head is not None:  # a bias that matters (nnx.Linear starts it at zero)
      m.head.bias[...] = jnp.asarray(rng.normal(size=VOCAB), jnp.float32)
  tokens = jnp.asarray(rng.integers(0, VOCAB, (3, 7)))
  mask = jnp.asarray(np.arange(7) < np.array([7, 4, 2])[:, None])
  old = jnp.asarray(rng.normal(-3.0, 0.5, (3, 6)), jnp.float32)
  advantages = jnp.asarray(rng.normal(size=3), jnp.float32)

  def materialised_grpo(model):
    lp = kldiv_jax.token_log_probs(model(tokens)[:, :-1], tokens[:, 1:])
    return kldiv_jax.policy_loss(lp, old, advantages, where=mask[:, 1:], clip_high=0.28)[0]

  @nnx.jit
  def run(model, teacher):
    logits, t_logits = model(tokens), teacher(tokens)
    hidden = (recipe["captured_hidden"](model, tokens), model.hidden(tokens))
    lp = kldiv_jax.token_log_probs(logits[:, :-1], tokens[:, 1:])
    sequences = (
      recipe["sequence_log_probs"](model, tokens, mask),
      jnp.sum(jnp.where(mask[:, 1:], lp, 0.0), axis=-1),
    )
    grpo = nnx.value_and_grad(recipe["grpo_loss"])(model, tokens, mask, old, advantages)
    t_grpo = nnx.value_and_grad(materialised_grpo)(model)
    distill = (
      recipe["distill_loss"](model, teacher, tokens, mask),
      kldiv_jax.distillation_loss(
        logits[:, :-1], t_logits[:, :-1], tokens[:, 1:], where=mask[:, 1:], temperature=2.0,
        alpha=0.5,
      ),
    )  # fmt: skip
    return hidden, sequences, grpo, t_grpo, distill

  hidden, sequences, (loss, grads), (t_loss, t_grads), distill = run(model, teacher)
  _close(*hidden)
  _close(*sequences)
  _close(loss, t_loss)
  jax.tree.map(_close, nnx.to_pure_dict(grads), nnx.to_pure_dict(t_grads))
  _close(*distill)
  assert abs(float(loss)) > 1e-3
