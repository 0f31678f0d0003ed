"""Language-model distillation on the Python standard library's own source code.

A corpus every machine has offline: the ``*.py`` files of the running Python's
standard library (a deterministic subset; a deterministic tenth of the files
held out for evaluation). A byte-level BPE tokenizer (HuggingFace
``tokenizers``, 8192 tokens; 512 with ``--quick``) is trained on the training files, then small
decoder-only transformers written in plain JAX (causal self-attention,
pre-LayerNorm, learned positions, an untied LM head ``[H, V]``) inside jitted
Optax train steps:

* a teacher, on the labels (next-token cross-entropy);
* three students of one smaller size, from the same initial parameters and the
  same batches:

  - ``labels``: cross-entropy alone;
  - ``fused KD``: ``kldiv_jax.fused_distillation_loss`` from the student's final
    hidden states and LM head and the teacher's, with the labels' cross-entropy
    in the same call (``alpha * T^2 * KL + (1 - alpha) * CE``), never
    materialising either model's ``[tokens, vocab]`` logits;
  - ``top-k KD``: the teacher's top-k token ids and log-probabilities at the
    students' training tokens are first written to a ``.npz`` file (an offline
    distillation dataset); the student then trains from that file with
    ``kldiv_jax.fused_topk_distillation_loss`` (the teacher's mass outside its
    top k in one tail bucket).

Prints, per model, the held-out perplexity and KL(teacher || model) (from
materialised logits, mean over the held-out tokens) and, for the two
distillation losses, XLA's temporary memory for the loss and its gradient at
the training batch's shape: materialised logits against fused. Saves the
held-out curves and the memory as a PNG. ``--quick`` (the CI smoke run) trains
tiny models for a few steps.

Run:  python examples/distill_lm.py [--quick] [--steps 200 --temperature 1 --alpha 0.5 --top-k 32]
"""

import argparse
import dataclasses
import math
import sysconfig
import time
import zlib
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

import kldiv_jax

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after choosing the backend
from matplotlib import ticker

Array = jax.Array
Params = dict[str, Any]
Batch = dict[str, Array]

TEACHER_LR = 3e-3
STUDENT_LR = 3e-3
DEFAULT_OUT = Path(__file__).resolve().parent / "output" / "distill_lm.png"
END_OF_FILE = "<|endoftext|>"
# Tests and installed packages are left out of the corpus.
SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})


@dataclasses.dataclass(frozen=True)
class ModelSize:
  d_model: int
  n_layers: int
  n_heads: int


@dataclasses.dataclass(frozen=True)
class Preset:
  """Everything ``--quick`` changes."""

  vocab: int  # BPE vocabulary size
  train_chars: int  # characters of training files read (the tokenizer's and models' corpus)
  eval_chars: int  # characters of held-out files read
  seq_len: int
  batch: int
  teacher: ModelSize
  student: ModelSize
  teacher_steps: int
  steps: int  # per student
  eval_every: int
  eval_seqs: int  # held-out sequences of seq_len tokens


DEFAULT = Preset(
  vocab=8192,
  train_chars=3_000_000,
  eval_chars=400_000,
  seq_len=128,
  batch=8,
  teacher=ModelSize(d_model=128, n_layers=2, n_heads=4),
  student=ModelSize(d_model=64, n_layers=2, n_heads=2),
  teacher_steps=400,
  steps=200,
  eval_every=25,
  eval_seqs=32,
)
QUICK = Preset(
  vocab=512,
  train_chars=200_000,
  eval_chars=30_000,
  seq_len=64,
  batch=8,
  teacher=ModelSize(d_model=64, n_layers=1, n_heads=2),
  student=ModelSize(d_model=32, n_layers=1, n_heads=1),
  teacher_steps=10,
  steps=10,
  eval_every=5,
  eval_seqs=16,
)


# --- corpus and tokenizer ----------------------------------------------------


def stdlib_files() -> tuple[list[Path], list[Path]]:
  """The standard library's ``*.py`` files: (training, held out).

  Sorted by a checksum of their relative path (deterministic, and mixing the
  packages); one file in ten, by the same checksum, is held out.
  """
  root = Path(sysconfig.get_paths()["stdlib"])
  train, held_out = [], []
  keyed = []
  for path in root.rglob("*.py"):
    relative = path.relative_to(root).as_posix()
    if SKIPPED_DIRS.isdisjoint(relative.split("/")):
      keyed.append((zlib.crc32(relative.encode()), relative, path))
  for checksum, _, path in sorted(keyed):
    (held_out if checksum % 10 == 0 else train).append(path)
  return train, held_out


def read_texts(paths: Sequence[Path], max_chars: int) -> list[str]:
  """The files' texts, in order, until ``max_chars`` characters are read."""
  texts, total = [], 0
  for path in paths:
    if total >= max_chars:
      break
    text = path.read_text(encoding="utf-8", errors="replace")
    texts.append(text)
    total += len(text)
  return texts


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
  """A byte-level BPE tokenizer (GPT-2's scheme) trained on ``texts``.

  Deterministic for the same texts; the end-of-file token is id 0.
  """
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    min_frequency=2,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    special_tokens=[END_OF_FILE],
    show_progress=False,
  )
  tokenizer.train_from_iterator(texts, trainer=trainer)
  return tokenizer


def to_sequences(tokenizer: Tokenizer, texts: Sequence[str], seq_len: int) -> np.ndarray:
  """``[n, seq_len + 1]`` token ids: the files, each ended by END_OF_FILE, back to back.

  Each row holds the inputs (``[:-1]``) and the next-token labels (``[1:]``).
  """
  eof = tokenizer.token_to_id(END_OF_FILE)
  ids = [i for encoding in tokenizer.encode_batch(list(texts)) for i in (*encoding.ids, eof)]
  n = len(ids) // (seq_len + 1)
  return np.asarray(ids[: n * (seq_len + 1)], np.int32).reshape(n, seq_len + 1)


# --- model -------------------------------------------------------------------


def init_transformer(rng: np.random.Generator, size: ModelSize, vocab: int, seq_len: int) -> Params:
  """GPT-2-style initial parameters; the LM head ``[d_model, vocab]`` is not tied."""
  d, n_heads = size.d_model, size.n_heads

  # NumPy arrays, moved to the device at the end: no compilation per shape, as
  # jax.random and jnp.zeros outside jit would cost.
  def normal(shape: tuple[int, ...], std: float = 0.02) -> np.ndarray:
    return std * rng.standard_normal(shape, np.float32)

  def zeros(*shape: int) -> np.ndarray:
    return np.zeros(shape, np.float32)

  def layer_norm_params() -> Params:
    return {"scale": np.ones((d,), np.float32), "bias": zeros(d)}

  residual_std = 0.02 / math.sqrt(2 * size.n_layers)  # GPT-2's scaling of residual outputs
  layers = [
    {
      "ln1": layer_norm_params(),
      "qkv": normal((d, 3, n_heads, d // n_heads)),
      "proj": normal((n_heads, d // n_heads, d), residual_std),
      "ln2": layer_norm_params(),
      "up": normal((d, 4 * d)),
      "up_bias": zeros(4 * d),
      "down": normal((4 * d, d), residual_std),
      "down_bias": zeros(d),
    }
    for _ in range(size.n_layers)
  ]
  params = {
    "embed": normal((vocab, d)),
    "pos": normal((seq_len, d), 0.01),
    "layers": layers,
    "ln_final": layer_norm_params(),
    "head": normal((d, vocab)),
  }
  return jax.tree.map(jnp.asarray, params)


def layer_norm(x: jax.Array, params: Params) -> jax.Array:
  mean = x.mean(axis=-1, keepdims=True)
  var = jnp.square(x - mean).mean(axis=-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-5) * params["scale"] + params["bias"]


def hidden_states(params: Params, tokens: jax.Array) -> jax.Array:
  """The final (layer-normed) hidden states ``[batch, seq, d_model]`` of ``tokens``.

  The logits are ``hidden_states(params, tokens) @ params["head"]``; the fused
  losses take the two factors instead.
  """
  seq = tokens.shape[-1]
  x = params["embed"][tokens] + params["pos"][:seq]
  causal = jnp.tril(jnp.ones((seq, seq), bool))
  for layer in params["layers"]:
    h = layer_norm(x, layer["ln1"])
    q, k, v = jnp.einsum("bsd,dthe->tbshe", h, layer["qkv"])
    scores = jnp.einsum("bqhe,bkhe->bhqk", q, k) / math.sqrt(q.shape[-1])
    attention = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    x = x + jnp.einsum("bhqk,bkhe,hed->bqd", attention, v, layer["proj"])
    h = layer_norm(x, layer["ln2"])
    x = x + jax.nn.gelu(h @ layer["up"] + layer["up_bias"]) @ layer["down"] + layer["down_bias"]
  return layer_norm(x, params["ln_final"])


def logits_of(params: Params, tokens: jax.Array) -> jax.Array:
  return hidden_states(params, tokens) @ params["head"]


def num_params(params: Params) -> int:
  return sum(leaf.size for leaf in jax.tree.leaves(params))


# --- losses ------------------------------------------------------------------
#
# Each distillation loss comes twice: fused (the one trained with) and on
# materialised logits (the reference for the check and the memory comparison).
# The two are the same function of their inputs.


@dataclasses.dataclass(frozen=True)
class KD:
  """The distillation settings shared by both students."""

  temperature: float
  alpha: float  # weight of T^2 * divergence; 1 - alpha on the cross-entropy
  divergence: str
  chunk_size: int  # tokens per chunk of the fused losses


def kd_fused(
  kd: KD, hidden: Array, weight: Array, teacher_hidden: Array, teacher_weight: Array, labels: Array
) -> Array:
  """``alpha T^2 D(teacher_T, student_T) + (1 - alpha) CE``, mean over the tokens, chunked."""
  return kldiv_jax.fused_distillation_loss(
    hidden,
    weight,
    teacher_hidden,
    teacher_weight,
    labels=labels,
    alpha=kd.alpha,
    temperature=kd.temperature,
    divergence=kd.divergence,
    chunk_size=kd.chunk_size,
  )


def kd_materialised(
  kd: KD, hidden: Array, weight: Array, teacher_hidden: Array, teacher_weight: Array, labels: Array
) -> Array:
  """The same, from the ``[batch, seq, vocab]`` logits of both models."""
  return kldiv_jax.distillation_loss(
    hidden @ weight,
    teacher_hidden @ teacher_weight,
    labels,
    alpha=kd.alpha,
    temperature=kd.temperature,
    divergence=kd.divergence,
  )


def topk_fused(
  kd: KD, hidden: Array, weight: Array, topk_ids: Array, topk_log_probs: Array, labels: Array
) -> Array:
  """``alpha T^2 D_k(top-k teacher + tail, student_T) + (1 - alpha) CE``, chunked."""
  return kldiv_jax.fused_topk_distillation_loss(
    hidden,
    weight,
    topk_ids,
    topk_log_probs,
    labels=labels,
    alpha=kd.alpha,
    temperature=kd.temperature,
    divergence=kd.divergence,
    tail="bucket",
    chunk_size=kd.chunk_size,
  )


def topk_materialised(
  kd: KD, hidden: Array, weight: Array, topk_ids: Array, topk_log_probs: Array, labels: Array
) -> Array:
  """The same, from the student's ``[batch, seq, vocab]`` logits."""
  logits = hidden @ weight
  soft = kldiv_jax.divergence_from_topk(
    logits,
    topk_ids,
    topk_log_probs,
    divergence=kd.divergence,
    temperature=kd.temperature,
    tail="bucket",
  )
  hard = optax.losses.softmax_cross_entropy_with_integer_labels(logits, labels)
  return jnp.mean(kd.alpha * kd.temperature**2 * soft + (1 - kd.alpha) * hard)


def cross_entropy(params: Params, tokens: jax.Array) -> jax.Array:
  """Next-token cross-entropy of ``tokens [batch, seq + 1]``, mean over the tokens."""
  logits = logits_of(params, tokens[:, :-1])
  return optax.losses.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


# An objective: (student parameters, batch, teacher parameters or None) -> loss.
Objective = Callable[[Params, Batch, Params | None], jax.Array]


def labels_objective(params: Params, batch: Batch, teacher: Params | None) -> jax.Array:
  del teacher
  return cross_entropy(params, batch["tokens"])


def fused_objective(kd: KD) -> Objective:
  def objective(params: Params, batch: Batch, teacher: Params | None) -> jax.Array:
    assert teacher is not None
    inputs, labels = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
    teacher_hidden = jax.lax.stop_gradient(hidden_states(teacher, inputs))
    hidden = hidden_states(params, inputs)
    return kd_fused(kd, hidden, params["head"], teacher_hidden, teacher["head"], labels)

  return objective


def topk_objective(kd: KD) -> Objective:
  def objective(params: Params, batch: Batch, teacher: Params | None) -> jax.Array:
    del teacher  # the teacher is the file
    inputs, labels = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
    hidden = hidden_states(params, inputs)
    ids, log_probs = batch["topk_ids"], batch["topk_log_probs"]
    return topk_fused(kd, hidden, params["head"], ids, log_probs, labels)

  return objective


# --- training and evaluation -------------------------------------------------


Step = Callable[
  [Params, optax.OptState, Batch, Params | None], tuple[Params, optax.OptState, Array]
]


def make_step(objective: Objective, optimizer: optax.GradientTransformation) -> Step:
  """A jitted Optax step: (params, opt_state, batch, teacher) -> (params, opt_state, loss)."""

  @jax.jit
  def step(params, opt_state, batch, teacher):
    loss, grads = jax.value_and_grad(objective)(params, batch, teacher)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


@jax.jit
def eval_logits(params: Params, eval_tokens: jax.Array) -> jax.Array:
  """Logits ``[n_batches, batch, seq, vocab]`` of ``eval_tokens [n_batches, batch, seq + 1]``."""
  return jax.lax.map(lambda tokens: logits_of(params, tokens[:, :-1]), eval_tokens)


@jax.jit
def evaluate(
  params: Params, eval_tokens: jax.Array, teacher_logits: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
  """Held-out perplexity and mean KL(teacher || model) per token, from materialised logits.

  One batch of ``eval_tokens [n_batches, batch, seq + 1]`` at a time; the KL
  is 0 without ``teacher_logits`` (``eval_logits`` of the teacher).
  """

  def sums(batch: tuple[jax.Array, jax.Array | None]) -> tuple[jax.Array, jax.Array]:
    tokens, target_logits = batch
    logits = logits_of(params, tokens[:, :-1])
    ce = optax.losses.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).sum()
    if target_logits is None:
      return ce, jnp.zeros(())
    return ce, kldiv_jax.kl_div_from_logits(logits, target_logits).sum()

  ce, kl = jax.lax.map(sums, (eval_tokens, teacher_logits))
  n = eval_tokens.shape[0] * eval_tokens.shape[1] * (eval_tokens.shape[2] - 1)
  return jnp.exp(ce.sum() / n), kl.sum() / n


def optimizer_for(steps: int, learning_rate: float) -> optax.GradientTransformation:
  warmup = max(1, steps // 10)
  schedule = optax.warmup_cosine_decay_schedule(
    0.0, learning_rate, warmup, max(steps, warmup + 1), end_value=learning_rate / 10
  )
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))


def train(
  name: str,
  params: Params,
  objective: Objective,
  batches: Callable[[int], Batch],
  *,
  steps: int,
  learning_rate: float,
  teacher: Params | None,
  eval_fn: Callable[[Params], tuple[float, float]],
  eval_every: int,
) -> tuple[Params, dict[str, list[float]]]:
  """``steps`` Optax steps on ``objective``; the held-out curves every ``eval_every``."""
  optimizer = optimizer_for(steps, learning_rate)
  opt_state = jax.jit(optimizer.init)(params)
  step = make_step(objective, optimizer)
  history: dict[str, list[float]] = {"step": [], "ppl": [], "kl": [], "loss": []}
  start = time.perf_counter()
  bar = tqdm(range(1, steps + 1), desc=f"{name:<18}", unit="step", ncols=90)
  for i in bar:
    params, opt_state, loss = step(params, opt_state, batches(i - 1), teacher)
    if i % eval_every == 0 or i == steps:
      ppl, kl = eval_fn(params)
      history["step"].append(i)
      history["ppl"].append(ppl)
      history["kl"].append(kl)
      history["loss"].append(float(loss))
      bar.set_postfix(loss=f"{float(loss):.3f}", ppl=f"{ppl:.1f}")
  bar.close()
  history["seconds"] = [time.perf_counter() - start]
  return params, history


@partial(jax.jit, static_argnames="k")
def teacher_topk(
  teacher: Params, tokens: jax.Array, k: int, temperature: float
) -> tuple[jax.Array, jax.Array]:
  """The teacher's ``k`` most likely next tokens: ids and log-probabilities ``[batch, seq, k]``.

  At the distillation temperature, as a server sampling at ``T`` reports them
  (the tail bucket's mass, ``1 - sum(exp(log_probs))``, is then the teacher's at ``T``).
  """
  logits = logits_of(teacher, tokens[:, :-1]) / temperature
  log_probs, ids = jax.lax.top_k(jax.nn.log_softmax(logits), k)
  return ids, log_probs


def write_topk_dataset(
  path: Path, teacher: Params, tokens: np.ndarray, *, k: int, temperature: float, batch: int
) -> None:
  """An offline distillation dataset: the tokens and the teacher's top-k, as a ``.npz``.

  Stored compactly, as such datasets are: ids as ``uint16`` (or ``int32`` past
  65536 tokens), log-probabilities as ``float16``.
  """
  vocab = teacher["head"].shape[1]
  id_dtype = np.uint16 if vocab <= 2**16 else np.int32
  ids, log_probs = [], []
  for i in tqdm(
    range(0, len(tokens), batch), desc=f"{'teacher top-k':<18}", unit="batch", ncols=90
  ):
    batch_ids, batch_log_probs = teacher_topk(
      teacher, jnp.asarray(tokens[i : i + batch]), k, temperature
    )
    ids.append(np.asarray(batch_ids).astype(id_dtype))
    log_probs.append(np.asarray(batch_log_probs).astype(np.float16))
  path.parent.mkdir(parents=True, exist_ok=True)
  np.savez(
    path, tokens=tokens, topk_ids=np.concatenate(ids), topk_log_probs=np.concatenate(log_probs)
  )


@dataclasses.dataclass(frozen=True)
class LossComparison:
  """A fused loss against the same loss on materialised logits."""

  temp_materialised: int  # XLA's temporary bytes for value_and_grad
  temp_fused: int
  max_abs_diff: float  # over the value and the gradients, at the inputs compared


def compare_losses(
  materialised: Callable[..., jax.Array], fused: Callable[..., jax.Array], *args: jax.Array
) -> LossComparison:
  """Compiles ``value_and_grad`` (wrt the first two arguments) of both, runs both on ``args``.

  The temporary memory is XLA's compiled memory analysis; the values and
  gradients must agree.
  """
  temp, outputs = [], []
  for loss_fn in (materialised, fused):
    compiled = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1))).lower(*args).compile()
    temp.append(int(compiled.memory_analysis().temp_size_in_bytes))
    outputs.append(jax.tree.leaves(jax.device_get(compiled(*args))))
  diffs = []
  for a, b in zip(*outputs):
    diffs.append(float(np.max(np.abs(a - b))))
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * float(np.max(np.abs(a))))
  return LossComparison(temp[0], temp[1], max(diffs))


# --- main --------------------------------------------------------------------


def plot(
  histories: dict[str, dict[str, list[float]]], memory: dict[str, LossComparison], out: Path
) -> None:
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), constrained_layout=True)
  for i, (name, history) in enumerate(histories.items()):
    style = {"color": f"C{i}", "label": name}
    if name == "teacher":
      axes[0].axhline(history["ppl"][-1], ls="--", **style)
      continue
    axes[0].plot(history["step"], history["ppl"], marker=".", **style)
    axes[1].plot(history["step"], history["kl"], marker=".", **style)
  for ax, title in zip(axes[:2], ("held-out perplexity", "held-out KL(teacher ‖ model)")):
    ax.set_title(title)
    ax.set_xlabel("student step")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ticker.ScalarFormatter())
    ax.yaxis.set_minor_formatter(ticker.ScalarFormatter())
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
  x = np.arange(len(memory))
  for offset, label, field in (
    (-0.2, "materialised logits", "temp_materialised"),
    (0.2, "fused", "temp_fused"),
  ):
    mib = [getattr(m, field) / 2**20 for m in memory.values()]
    bars = axes[2].bar(x + offset, mib, 0.4, label=label)
    axes[2].bar_label(bars, fmt="%.1f")
  axes[2].set_xticks(x, list(memory))
  axes[2].set_ylabel("MiB")
  axes[2].set_title("XLA temporary memory of the loss + gradient")
  axes[2].legend()
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=110)
  plt.close(fig)


def print_table(
  params: dict[str, Params],
  histories: dict[str, dict[str, list[float]]],
  memory: dict[str, LossComparison],
) -> dict[str, dict[str, float]]:
  header = (
    f"{'model':<19} {'params':>9} {'held-out ppl':>12} {'KL(teacher‖model)':>18} "
    f"{'loss temp: materialised → fused':>33} {'train s':>8}"
  )
  print(header)
  print("-" * len(header))
  results = {}
  for name, history in histories.items():
    row = {"params": num_params(params[name]), "ppl": history["ppl"][-1], "kl": history["kl"][-1]}
    row["seconds"] = history["seconds"][0]
    kl, mem = "—", "—"
    if name != "teacher":
      kl = f"{row['kl']:.4f}"
    if name in memory:
      row["temp_materialised"] = memory[name].temp_materialised
      row["temp_fused"] = memory[name].temp_fused
      before, after = row["temp_materialised"] / 2**20, row["temp_fused"] / 2**20
      mem = f"{before:.1f} → {after:.1f} MiB ({after / before:.2f}x)"
    numbers = f"{row['params']:>9,} {row['ppl']:>12.2f} {kl:>18} {mem:>33}"
    print(f"{name:<19} {numbers} {row['seconds']:>8.1f}")
    results[name] = row
  return results


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="tiny models, few steps (CI smoke run)")
  parser.add_argument("--steps", type=int, help=f"steps per student (default {DEFAULT.steps})")
  parser.add_argument(
    "--teacher-steps", type=int, help=f"teacher steps (default {DEFAULT.teacher_steps})"
  )
  parser.add_argument(
    "--vocab", type=int, help=f"BPE vocabulary size (default {DEFAULT.vocab}; {QUICK.vocab} quick)"
  )
  parser.add_argument("--temperature", type=float, default=1.0, help="distillation T (default 1)")
  parser.add_argument(
    "--alpha", type=float, default=0.5, help="weight of the KD term in [0, 1] (default 0.5)"
  )
  parser.add_argument(
    "--divergence",
    default="forward_kl",
    choices=("forward_kl", "reverse_kl", "jsd"),
    help="the divergence of both distilled students (default forward_kl)",
  )
  parser.add_argument("--top-k", type=int, default=32, help="teacher tokens stored (default 32)")
  parser.add_argument(
    "--chunk-size", type=int, default=256, help="tokens per chunk of the fused losses (256)"
  )
  parser.add_argument("--seed", type=int, default=0, help="seed of the inits and batches")
  parser.add_argument(
    "--out", type=Path, default=DEFAULT_OUT, help="path of the PNG plot; the .npz goes beside it"
  )
  args = parser.parse_args(argv)
  preset = QUICK if args.quick else DEFAULT
  for flag, value in (("--steps", args.steps), ("--teacher-steps", args.teacher_steps)):
    if value is not None and value < 1:
      parser.error(f"{flag} must be positive; got {value}")
  preset = dataclasses.replace(
    preset,
    steps=args.steps or preset.steps,
    teacher_steps=args.teacher_steps or preset.teacher_steps,
    vocab=preset.vocab if args.vocab is None else args.vocab,
  )
  if preset.vocab < 512:
    parser.error(f"--vocab must be at least 512; got {preset.vocab}")
  if args.temperature <= 0:
    parser.error(f"--temperature must be positive; got {args.temperature}")
  if not 0.0 <= args.alpha <= 1.0:
    parser.error(f"--alpha must be in [0, 1]; got {args.alpha}")
  if not 0 < args.top_k <= preset.vocab:
    parser.error(f"--top-k must be in [1, --vocab]; got {args.top_k}")
  if args.chunk_size < 1:
    parser.error(f"--chunk-size must be positive; got {args.chunk_size}")
  kd = KD(args.temperature, args.alpha, args.divergence, args.chunk_size)
  seq_len, batch = preset.seq_len, preset.batch
  start = time.perf_counter()

  # Corpus, tokenizer, token sequences.
  train_files, held_out_files = stdlib_files()
  train_texts = read_texts(train_files, preset.train_chars)
  eval_texts = read_texts(held_out_files, preset.eval_chars)
  tokenizer = train_tokenizer(train_texts, preset.vocab)
  vocab = tokenizer.get_vocab_size()
  train_tokens = to_sequences(tokenizer, train_texts, seq_len)
  eval_rows = to_sequences(tokenizer, eval_texts, seq_len)[: preset.eval_seqs]
  eval_rows = eval_rows[: len(eval_rows) // batch * batch]
  eval_tokens = jnp.asarray(eval_rows.reshape(-1, batch, seq_len + 1))
  print(
    f"corpus: {len(train_texts)} training + {len(eval_texts)} held-out files of "
    f"{sysconfig.get_paths()['stdlib']} ({sum(map(len, train_texts)) / 1e6:.1f} M characters); "
    f"byte-level BPE, vocab {vocab} ({time.perf_counter() - start:.1f} s); "
    f"{train_tokens.size:,} training / {eval_rows.size:,} held-out tokens; "
    f"batch {batch} x {seq_len}; {jax.default_backend()}"
  )

  # One seed for everything: the teacher's init, the students' (shared) init, the batches.
  rng_teacher, rng_student, rng = map(
    np.random.default_rng, np.random.SeedSequence(args.seed).spawn(3)
  )

  def stream(steps: int) -> np.ndarray:
    """``steps * batch`` training rows: shuffled epochs of the training set."""
    epochs = math.ceil(steps * batch / len(train_tokens))
    order = np.concatenate([rng.permutation(len(train_tokens)) for _ in range(epochs)])
    return train_tokens[order[: steps * batch]]

  # The teacher: cross-entropy on the training set.
  teacher_tokens = stream(preset.teacher_steps)
  teacher, teacher_history = train(
    "teacher",
    init_transformer(rng_teacher, preset.teacher, vocab, seq_len),
    labels_objective,
    lambda i: {"tokens": jnp.asarray(teacher_tokens[i * batch : (i + 1) * batch])},
    steps=preset.teacher_steps,
    learning_rate=TEACHER_LR,
    teacher=None,
    eval_fn=lambda p: tuple(float(x) for x in evaluate(p, eval_tokens)),
    eval_every=preset.eval_every,
  )

  # The students' training sequences, and the teacher's top-k at them, on disk.
  student_tokens = stream(preset.steps)
  npz = args.out.with_name(f"{args.out.stem}_top{args.top_k}.npz")
  write_topk_dataset(
    npz, teacher, student_tokens, k=args.top_k, temperature=kd.temperature, batch=batch
  )
  with np.load(npz) as stored:
    dataset = {name: stored[name] for name in ("tokens", "topk_ids", "topk_log_probs")}
  print(f"top-{args.top_k} dataset: {npz} ({npz.stat().st_size / 2**20:.1f} MiB)")

  def student_batch(i: int) -> Batch:
    return {"tokens": jnp.asarray(student_tokens[i * batch : (i + 1) * batch])}

  def topk_batch(i: int) -> Batch:  # from the file alone
    rows = slice(i * batch, (i + 1) * batch)
    return {
      "tokens": jnp.asarray(dataset["tokens"][rows]),
      "topk_ids": jnp.asarray(dataset["topk_ids"][rows].astype(np.int32)),
      "topk_log_probs": jnp.asarray(dataset["topk_log_probs"][rows].astype(np.float32)),
    }

  student_init = init_transformer(rng_student, preset.student, vocab, seq_len)
  topk_name = f"student (top-{args.top_k})"

  # Fused against materialised, at the first training batch: the same values and
  # gradients, and XLA's temporary memory of each.
  first, first_tokens = topk_batch(0), dataset["tokens"][:batch]
  inputs, labels = jnp.asarray(first_tokens[:, :-1]), jnp.asarray(first_tokens[:, 1:])
  hidden = jax.jit(hidden_states)(student_init, inputs)
  teacher_hidden = jax.jit(hidden_states)(teacher, inputs)
  head = student_init["head"]
  memory = {
    "student (fused KD)": compare_losses(
      partial(kd_materialised, kd),
      partial(kd_fused, kd),
      *(hidden, head, teacher_hidden, teacher["head"], labels),
    ),
    topk_name: compare_losses(
      partial(topk_materialised, kd),
      partial(topk_fused, kd),
      *(hidden, head, first["topk_ids"], first["topk_log_probs"], labels),
    ),
  }
  diff = max(m.max_abs_diff for m in memory.values())
  print(
    f"fused = materialised (loss and gradients) at the first batch: max |difference| {diff:.1e}"
  )

  # Three students: same initial parameters, same sequences.
  teacher_eval_logits = eval_logits(teacher, eval_tokens)

  def eval_student(params: Params) -> tuple[float, float]:
    return tuple(float(x) for x in evaluate(params, eval_tokens, teacher_eval_logits))

  runs: list[tuple[str, Objective, Callable[[int], Batch], Params | None]] = [
    ("student (labels)", labels_objective, student_batch, None),
    ("student (fused KD)", fused_objective(kd), student_batch, teacher),
    (topk_name, topk_objective(kd), topk_batch, None),
  ]
  models_ = {"teacher": teacher}
  histories = {"teacher": teacher_history}
  for name, objective, batches, teacher_arg in runs:
    models_[name], histories[name] = train(
      name,
      student_init,
      objective,
      batches,
      steps=preset.steps,
      learning_rate=STUDENT_LR,
      teacher=teacher_arg,
      eval_fn=eval_student,
      eval_every=preset.eval_every,
    )
  plot(histories, {"KD": memory["student (fused KD)"], "top-k KD": memory[topk_name]}, args.out)

  print(
    f"\nloss: alpha={kd.alpha:g}, T={kd.temperature:g}, {kd.divergence} (top-k: tail bucket), "
    f"chunk {kd.chunk_size}; memory: value_and_grad of the loss at the batch "
    f"[{batch}, {seq_len}], vocab {vocab}"
  )
  results = print_table(models_, histories, memory)
  print(f"\nplot: {args.out}   time: {time.perf_counter() - start:.1f} s")
  return results


if __name__ == "__main__":
  main()
