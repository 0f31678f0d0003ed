"""Distillation across tokenizers: the LM demo's teacher into a student with its own tokenizer.

The corpus, the tokenizer trainer, the transformer and the training loop are
``examples/distill_lm.py``'s (imported, not copied): the Python standard library's own
source, byte-level BPE tokenizers trained locally with HuggingFace ``tokenizers`` (the
``examples`` extra), small decoder-only transformers in plain JAX, Optax steps.

Two tokenizers, trained on different halves of the training files and of different sizes
(the teacher's ``--teacher-vocab``, the student's ``--student-vocab``): most of their
vocabularies differ. The teacher trains on the labels in its tokenization; then four
students of one smaller size, from the same initial parameters and the same text:

* ``labels``: the student's tokenizer, cross-entropy alone;
* ``ULD``: the student's tokenizer, cross-entropy plus ``kldiv_jax.uld_loss`` against the
  teacher's logits: the two tokenizations aligned by character offsets
  (``kldiv_jax.align_tokens``), each side's token spans merged (``merge_strategy="bayesian"``:
  the rows that predict the span's tokens, chained), GOLD's ``use_extended_uld``;
* ``hybrid``: the same with ``kldiv_jax.gold_loss`` (JSD on the shared vocabulary entries of
  ``kldiv_jax.matched_vocabulary``, ULD on the others, GOLD's adaptive weights);
* ``same-tokenizer KL``: the *teacher's* tokenizer, cross-entropy plus forward KL
  (``kldiv_jax.distillation_loss``): what distillation gives when the vocabularies agree.

Every model is scored on the same held-out text in **bits per character** (the cross-entropy
of its own tokens summed, over the characters they cover: comparable across tokenizers),
and the students of the student's tokenizer by their held-out ULD to the teacher. The
training losses and the held-out curves are saved as a PNG.

Run:  python examples/distill_across_tokenizers.py [--quick] [--long] [--steps 300]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from distill_lm import (
  END_OF_FILE,
  ModelSize,
  Params,
  init_transformer,
  logits_of,
  read_texts,
  stdlib_files,
  train,
  train_tokenizer,
)
from tokenizers import Tokenizer

import kldiv_jax

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after choosing the backend

DEFAULT_OUT = Path(__file__).resolve().parent / "output" / "distill_across_tokenizers.png"
LEARNING_RATE = 3e-3


@dataclasses.dataclass(frozen=True)
class Preset:
  """What ``--quick`` and ``--long`` change."""

  teacher_vocab: int
  student_vocab: int
  train_chars: int
  eval_chars: int
  piece_chars: int  # characters of text per training row
  seq_len: int  # tokens per row (pieces that need more are left out)
  group_size: int  # tokens of one side in one aligned group (longer groups: piece left out)
  batch: int
  teacher: ModelSize
  student: ModelSize
  teacher_steps: int
  steps: int
  eval_every: int
  eval_rows: int


DEFAULT = Preset(
  teacher_vocab=1024,
  student_vocab=640,
  train_chars=400_000,
  eval_chars=40_000,
  piece_chars=64,
  seq_len=48,
  group_size=8,
  batch=12,
  teacher=ModelSize(d_model=96, n_layers=2, n_heads=4),
  student=ModelSize(d_model=48, n_layers=1, n_heads=2),
  teacher_steps=300,
  steps=100,
  eval_every=20,
  eval_rows=64,
)
QUICK = dataclasses.replace(
  DEFAULT,
  teacher_vocab=512,
  student_vocab=384,
  train_chars=100_000,
  eval_chars=10_000,
  batch=4,
  teacher=ModelSize(d_model=32, n_layers=1, n_heads=1),
  student=ModelSize(d_model=16, n_layers=1, n_heads=1),
  teacher_steps=4,
  steps=3,
  eval_every=3,
  eval_rows=8,
)
LONG = dataclasses.replace(DEFAULT, train_chars=3_000_000, teacher_steps=1500, steps=600)


# --- data: each piece of text in both tokenizations, aligned -------------------


@dataclasses.dataclass(frozen=True)
class Side:
  """One tokenization of the pieces: ``inputs``/``targets`` ``[n, seq_len]`` (``inputs`` start
  with END_OF_FILE; row ``i`` predicts ``targets[:, i]``), ``mask`` the real targets,
  ``groups`` ``[n, G, group_size]`` the aligned groups of target positions."""

  inputs: np.ndarray
  targets: np.ndarray
  mask: np.ndarray
  groups: np.ndarray


@dataclasses.dataclass(frozen=True)
class Pieces:
  student: Side
  teacher: Side
  chars: np.ndarray  # [n] characters per piece (what the targets cover)

  def batch(self, rows: slice | np.ndarray) -> dict[str, jax.Array]:
    out = {"chars": self.chars[rows]}
    for name, side in (("s", self.student), ("t", self.teacher)):
      for field in ("inputs", "targets", "mask", "groups"):
        out[f"{name}_{field}"] = getattr(side, field)[rows]
    return {k: jnp.asarray(v) for k, v in out.items()}


def make_pieces(texts: Sequence[str], student: Tokenizer, teacher: Tokenizer, p: Preset) -> Pieces:
  """Cuts ``texts`` into pieces of ``p.piece_chars`` characters, tokenizes each with both
  tokenizers and aligns the two by character offsets (one coordinate for both: the piece's
  characters); pieces longer than ``seq_len`` tokens or with a longer group are left out."""
  pieces = [t[i : i + p.piece_chars] for t in texts for i in range(0, len(t), p.piece_chars)]
  pieces = [x for x in pieces if x.strip()]
  eof_s, eof_t = student.token_to_id(END_OF_FILE), teacher.token_to_id(END_OF_FILE)
  encoded = zip(pieces, student.encode_batch(pieces), teacher.encode_batch(pieces))
  rows: dict[str, list] = {k: [] for k in ("s", "t", "gs", "gt", "chars")}
  n = p.seq_len
  for text, es, et in encoded:
    if not 0 < len(es.ids) <= n or not 0 < len(et.ids) <= n:
      continue
    try:
      gs, gt = kldiv_jax.align_tokens(es.offsets, et.offsets, group_size=p.group_size)
    except ValueError:  # a group longer than group_size
      continue
    for key, value in zip(("s", "t", "gs", "gt", "chars"), (es.ids, et.ids, gs, gt, len(text))):
      rows[key].append(value)
  # One number of groups for every piece (the most any piece has): -1 rows pad the others.
  g_max = max(len(g) for g in rows["gs"])
  for key in ("gs", "gt"):
    rows[key] = [np.pad(g, ((0, g_max - len(g)), (0, 0)), constant_values=-1) for g in rows[key]]

  def side(ids: list[list[int]], groups: list[np.ndarray], eof: int) -> Side:
    targets = np.full((len(ids), n), eof, np.int32)
    mask = np.zeros((len(ids), n), bool)
    for i, x in enumerate(ids):
      targets[i, : len(x)], mask[i, : len(x)] = x, True
    inputs = np.concatenate([np.full((len(ids), 1), eof, np.int32), targets[:, :-1]], axis=1)
    return Side(inputs, targets, mask, np.stack(groups))

  return Pieces(
    side(rows["s"], rows["gs"], eof_s),
    side(rows["t"], rows["gt"], eof_t),
    np.asarray(rows["chars"], np.int32),
  )


# --- objectives --------------------------------------------------------------


def masked_ce(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
  """Summed next-token cross-entropy of the real targets."""
  ce = optax.losses.softmax_cross_entropy_with_integer_labels(logits, targets)
  return jnp.sum(jnp.where(mask, ce, 0.0))


def ce_mean(logits, targets, mask):
  return masked_ce(logits, targets, mask) / jnp.maximum(jnp.sum(mask), 1)


Objective = Callable[[Params, dict, Params | None], jax.Array]


def labels_objective(side: str) -> Objective:
  def objective(params, batch, teacher):
    del teacher
    logits = logits_of(params, batch[f"{side}_inputs"])
    return ce_mean(logits, batch[f"{side}_targets"], batch[f"{side}_mask"])

  return objective


def cross_tokenizer_objective(loss: str, matched: tuple[np.ndarray, np.ndarray]) -> Objective:
  """Cross-entropy plus ULD (``loss="uld"``) or GOLD's hybrid (``"hybrid"``) against the
  teacher's logits, over the aligned groups, spans merged as the chain rule does."""
  teacher_ids, student_ids = (jnp.asarray(x) for x in matched)

  def objective(params, batch, teacher):
    assert teacher is not None
    logits = logits_of(params, batch["s_inputs"])
    teacher_logits = jax.lax.stop_gradient(logits_of(teacher, batch["t_inputs"]))
    aligned = dict(
      student_groups=batch["s_groups"],
      teacher_groups=batch["t_groups"],
      student_tokens=batch["s_targets"],
      teacher_tokens=batch["t_targets"],
      merge_strategy="bayesian",
    )
    if loss == "uld":
      distill = kldiv_jax.uld_loss(logits, teacher_logits, **aligned)
    else:
      distill = kldiv_jax.gold_loss(
        logits, teacher_logits, student_ids=student_ids, teacher_ids=teacher_ids, **aligned
      )
    return ce_mean(logits, batch["s_targets"], batch["s_mask"]) + distill

  return objective


def same_tokenizer_objective(params, batch, teacher):
  """Cross-entropy plus forward KL, both models on the teacher's tokens: ``distillation_loss``
  at ``alpha = 0.5`` is half of that (the others' weights), over the real targets."""
  assert teacher is not None
  logits = logits_of(params, batch["t_inputs"])
  teacher_logits = jax.lax.stop_gradient(logits_of(teacher, batch["t_inputs"]))
  labels = jnp.where(batch["t_mask"], batch["t_targets"], -100)
  return 2.0 * kldiv_jax.distillation_loss(logits, teacher_logits, labels, alpha=0.5)


# --- evaluation --------------------------------------------------------------


@jax.jit
def bits_per_char(params: Params, inputs, targets, mask, chars) -> jax.Array:
  """Held-out cross-entropy in bits, summed over the real targets, per character."""
  return masked_ce(logits_of(params, inputs), targets, mask) / jnp.sum(chars) / math.log(2)


@jax.jit
def held_out_uld(params: Params, teacher: Params, batch: dict) -> jax.Array:
  """Mean ULD between the student and the teacher over the aligned groups (merged spans)."""
  return kldiv_jax.uld_loss(
    logits_of(params, batch["s_inputs"]),
    logits_of(teacher, batch["t_inputs"]),
    student_groups=batch["s_groups"],
    teacher_groups=batch["t_groups"],
    student_tokens=batch["s_targets"],
    teacher_tokens=batch["t_targets"],
    merge_strategy="bayesian",
  )


def scorer(held_out: dict, side: str, teacher: Params | None) -> Callable[[Params], tuple]:
  """``params -> (bits per char, ULD to the teacher or NaN)`` on the held-out pieces."""
  args = [held_out[f"{side}_{f}"] for f in ("inputs", "targets", "mask")] + [held_out["chars"]]

  def score(params):
    bpc = float(bits_per_char(params, *args))
    uld = float(held_out_uld(params, teacher, held_out)) if side == "s" and teacher else math.nan
    return bpc, uld

  return score


# --- main --------------------------------------------------------------------


def plot(histories: dict[str, dict[str, list[float]]], out: Path) -> None:
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), constrained_layout=True)
  for i, (name, h) in enumerate(histories.items()):
    style = {"color": f"C{i}", "label": name, "marker": "."}
    if name == "teacher":
      axes[1].axhline(h["ppl"][-1], ls="--", color=f"C{i}", label=name)
      continue
    axes[0].plot(h["step"], h["loss"], **style)
    axes[1].plot(h["step"], h["ppl"], **style)
    if not math.isnan(h["kl"][-1]):
      axes[2].plot(h["step"], h["kl"], **style)
  titles = ("training loss (CE + distillation term)", "held-out bits per character",
            "held-out ULD to the teacher")  # fmt: skip
  for ax, title in zip(axes, titles):
    ax.set_title(title)
    ax.set_xlabel("student step")
    ax.grid(True, alpha=0.3)
    ax.legend()
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=110)
  plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  size = parser.add_mutually_exclusive_group()
  size.add_argument("--quick", action="store_true", help="tiny models, 3 steps (the CI smoke run)")
  size.add_argument("--long", action="store_true", help="more text and steps (several minutes)")
  parser.add_argument("--steps", type=int, help="steps per student")
  parser.add_argument("--teacher-steps", type=int, help="teacher steps")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="path of the PNG plot")
  args = parser.parse_args(argv)
  p = QUICK if args.quick else LONG if args.long else DEFAULT
  for flag, value in (("--steps", args.steps), ("--teacher-steps", args.teacher_steps)):
    if value is not None and value < 1:
      parser.error(f"{flag} must be positive; got {value}")
  p = dataclasses.replace(
    p, steps=args.steps or p.steps, teacher_steps=args.teacher_steps or p.teacher_steps
  )
  start = time.perf_counter()

  train_files, held_out_files = stdlib_files()
  train_texts = read_texts(train_files, p.train_chars)
  eval_texts = read_texts(held_out_files, p.eval_chars)
  teacher_tok = train_tokenizer(train_texts[0::2], p.teacher_vocab)
  student_tok = train_tokenizer(train_texts[1::2], p.student_vocab)
  matched = kldiv_jax.matched_vocabulary(student_tok.get_vocab(), teacher_tok.get_vocab())
  pieces = make_pieces(train_texts, student_tok, teacher_tok, p)
  held = make_pieces(eval_texts, student_tok, teacher_tok, p)
  held_out = held.batch(slice(0, p.eval_rows))
  vs, vt = student_tok.get_vocab_size(), teacher_tok.get_vocab_size()
  print(
    f"tokenizers: teacher {vt}, student {vs} entries, {len(matched[0])} shared; "
    f"{len(pieces.chars):,} training / {len(held_out['chars'])} held-out pieces of "
    f"{p.piece_chars} characters ({time.perf_counter() - start:.1f} s); {jax.default_backend()}"
  )

  rng_teacher, rng_student, rng_same, rng = map(
    np.random.default_rng, np.random.SeedSequence(args.seed).spawn(4)
  )

  def stream(steps: int) -> Callable[[int], dict]:
    order = np.concatenate(
      [
        rng.permutation(len(pieces.chars))
        for _ in range(math.ceil(steps * p.batch / len(pieces.chars)))
      ]
    )
    return lambda i: pieces.batch(order[i * p.batch : (i + 1) * p.batch])

  common = dict(learning_rate=LEARNING_RATE, eval_every=p.eval_every)
  teacher, teacher_history = train(
    "teacher",
    init_transformer(rng_teacher, p.teacher, vt, p.seq_len),
    labels_objective("t"),
    stream(p.teacher_steps),
    steps=p.teacher_steps,
    teacher=None,
    eval_fn=scorer(held_out, "t", None),
    **common,
  )

  student_init = init_transformer(rng_student, p.student, vs, p.seq_len)
  same_init = init_transformer(rng_same, p.student, vt, p.seq_len)
  batches = stream(p.steps)  # one stream: every student sees the same pieces
  runs = [
    ("labels", student_init, labels_objective("s"), None, "s"),
    ("ULD", student_init, cross_tokenizer_objective("uld", matched), teacher, "s"),
    ("hybrid", student_init, cross_tokenizer_objective("hybrid", matched), teacher, "s"),
    ("same-tokenizer KL", same_init, same_tokenizer_objective, teacher, "t"),
  ]
  histories = {"teacher": teacher_history}
  for name, init, objective, teacher_arg, side in runs:
    _, histories[name] = train(
      name, init, objective, batches, steps=p.steps, teacher=teacher_arg,
      eval_fn=scorer(held_out, side, teacher), **common,
    )  # fmt: skip
  plot(histories, args.out)

  header = f"{'model':<19} {'tokenizer':>9} {'held-out bits/char':>18} {'ULD to teacher':>15} {'train s':>8}"
  print(f"\n{header}\n{'-' * len(header)}")
  results = {}
  for name, h in histories.items():
    tokenizer = "teacher" if name in ("teacher", "same-tokenizer KL") else "student"
    row = {"bits_per_char": h["ppl"][-1], "uld": h["kl"][-1], "seconds": h["seconds"][0]}
    uld = "—" if math.isnan(row["uld"]) else f"{row['uld']:.4f}"
    print(
      f"{name:<19} {tokenizer:>9} {row['bits_per_char']:>18.3f} {uld:>15} {row['seconds']:>8.1f}"
    )
    results[name] = row
  print(f"\nplot: {args.out}   time: {time.perf_counter() - start:.1f} s")
  return results


if __name__ == "__main__":
  main()
