"""uld_loss, gold_loss and the alignment helpers against TRL's own GOLD ``ULDLoss``.

Runs where TRL is installed (``make integration``: trl 1.16.0, torch 2.13.0 CPU,
tokenizers 0.22.2), skipped elsewhere. Two byte-level BPE tokenizers of different vocabulary
sizes are trained here with ``tokenizers`` on this repository's docs (nothing from a hub);
the byte offsets come from TRL's own ``encode_with_byte_offsets``. The expected values and
gradients are TRL's ``ULDLoss`` on its own inputs (labels, input ids, byte offsets), float64,
with random logits: plain and extended ULD, both merge strategies, skip-EOS on and off, the
hybrid with adaptive and fixed weights, and the cross-entropy part.
"""

import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kldiv_jax as kd

torch = pytest.importorskip("torch")
tokenizers = pytest.importorskip("tokenizers")
gold = pytest.importorskip("trl.experimental.gold.gold_trainer")
trl_utils = pytest.importorskip("trl.experimental.utils")

DOCS = Path(__file__).resolve().parent.parent / "docs"
EOS = "<eos>"
SAMPLES = [  # (prompt, completion): text of the docs' kind, one with non-ASCII bytes
  ("Distil the teacher:", " The student's logits follow the teacher's distribution."),
  ("Why sort?", " Sorting each side's probabilities needs no shared vocabulary — naïve, 2°C."),
  ("Q:", " kldiv_jax computes KL divergences from logits, with masks and temperatures."),
]


@pytest.fixture(scope="module")
def tokenizer_pair():
  """(student, teacher): byte-level BPE tokenizers of 300 and 420 entries, trained locally on
  alternate pages of the docs (so that each splits some words the other keeps whole)."""
  text = [p.read_text() for p in sorted(DOCS.glob("*.md"))]
  out = []
  for size, pages in ((300, text[0::2]), (420, text[1::2])):
    tk = tokenizers.ByteLevelBPETokenizer()
    tk.train_from_iterator(pages, vocab_size=size, min_frequency=2, special_tokens=[EOS])
    out.append(tk)
  return tuple(out)


def _side(tk, offset_pad):
  """A GOLD batch of one side: input ids, labels (-100 outside the completion + EOS), the
  completion-relative byte offsets (TRL's ``encode_with_byte_offsets``, the EOS zero-width at
  the end), right-padded; ``offset_pad`` extra prompt tokens shift this side's positions."""
  eos = tk.token_to_id(EOS)
  ids, labels, offsets = [], [], []
  for prompt, completion in SAMPLES:
    p = tk.encode(prompt).ids + [eos] * offset_pad
    ((c, offs),) = trl_utils.encode_with_byte_offsets(tk._tokenizer, [completion])
    n = len(completion.encode("utf-8"))
    ids.append(p + list(c) + [eos])
    labels.append([-100] * len(p) + list(c) + [eos])
    offsets.append([(0, 0)] * len(p) + [tuple(o) for o in offs] + [(n, n)])
  width = max(len(x) for x in ids)
  pad = [width - len(x) for x in ids]
  ids = np.array([x + [eos] * k for x, k in zip(ids, pad)])
  labels = np.array([x + [-100] * k for x, k in zip(labels, pad)])
  offsets = np.array([x + [(0, 0)] * k for x, k in zip(offsets, pad)])
  return ids, labels, offsets


@pytest.fixture(scope="module")
def batch(tokenizer_pair):
  s_tk, t_tk = tokenizer_pair
  rng = np.random.default_rng(0)
  student, teacher = _side(s_tk, 0), _side(t_tk, 2)
  s_logits = 2.0 * rng.normal(size=(*student[0].shape, s_tk.get_vocab_size()))
  t_logits = 2.0 * rng.normal(size=(*teacher[0].shape, t_tk.get_vocab_size()))
  return student, teacher, s_logits, t_logits


def _config(**kw):
  base = dict(
    uld_crossentropy_weight=0.0, uld_distillation_weight=1.0, uld_student_temperature=1.0,
    uld_teacher_temperature=1.0, uld_skip_student_eos=True, uld_skip_teacher_eos=True,
    use_extended_uld=True, uld_token_merge_strategy="observed", uld_use_hybrid_loss=False,
    uld_hybrid_matched_weight=None, uld_hybrid_unmatched_weight=None, beta=0.5,
  )  # fmt: skip
  return types.SimpleNamespace(**{**base, **kw})


def trl_value_and_grads(cfg, tokenizer_pair, batch):
  (s_ids, s_lab, s_off), (t_ids, t_lab, t_off), s_logits, t_logits = batch
  loss_fn = gold.ULDLoss(cfg, *tokenizer_pair)
  s = torch.tensor(s_logits, requires_grad=True)
  t = torch.tensor(t_logits, requires_grad=True)
  loss = loss_fn(
    s, t, torch.tensor(s_lab), torch.tensor(t_lab), torch.tensor(s_ids), torch.tensor(t_ids),
    student_byte_offsets=torch.tensor(s_off), teacher_byte_offsets=torch.tensor(t_off),
  )  # fmt: skip
  loss.backward()
  return loss.item(), s.grad.numpy(), t.grad.numpy()


def _answer(labels, skip_eos):
  """Each row's answer ``(start, size)``, as TRL's ``_get_start_and_size_answers``."""
  out = []
  for row in labels:
    idx = np.flatnonzero(row != -100)
    out.append((int(idx[0]), len(idx) - int(skip_eos)))
  return out


def kldiv_jax_value_and_grads(cfg, tokenizer_pair, batch):
  """The GOLD config mapped onto kldiv_jax (the mapping of docs/cross-tokenizer.md)."""
  (s_ids, s_lab, s_off), (t_ids, t_lab, t_off), s_logits, t_logits = batch
  bayes = cfg.uld_token_merge_strategy == "bayesian"
  shift = int(bayes)  # "bayesian": the rows that predict the tokens (the causal shift)
  s_ans = _answer(s_lab, cfg.uld_skip_student_eos)
  t_ans = _answer(t_lab, cfg.uld_skip_teacher_eos)
  opts = dict(
    student_temperature=cfg.uld_student_temperature,
    teacher_temperature=cfg.uld_teacher_temperature,
    reduction="sequence_mean",
  )
  if cfg.use_extended_uld:
    pairs = [
      kd.align_tokens(
        so[a : a + n],
        to[b : b + m],
        student_start=a - shift,
        teacher_start=b - shift,
        num_groups=64,
        group_size=8,
      )
      for so, to, (a, n), (b, m) in zip(s_off, t_off, s_ans, t_ans)
    ]
    opts.update(
      student_groups=np.stack([p[0] for p in pairs]),
      teacher_groups=np.stack([p[1] for p in pairs]),
      student_tokens=np.roll(s_ids, -shift, axis=1),  # row r's token: ids[r + shift]
      teacher_tokens=np.roll(t_ids, -shift, axis=1),
      merge_strategy=cfg.uld_token_merge_strategy,
    )
  else:  # positional: the first min(sizes) answer rows of each side
    rows = max(min(n, m) for (_, n), (_, m) in zip(s_ans, t_ans))
    s_rows = np.array(
      [np.minimum(a - shift + np.arange(rows), s_ids.shape[1] - 1) for a, _ in s_ans]
    )
    t_rows = np.array(
      [np.minimum(b - shift + np.arange(rows), t_ids.shape[1] - 1) for b, _ in t_ans]
    )
    opts["where"] = np.array([np.arange(rows) < min(n, m) for (_, n), (_, m) in zip(s_ans, t_ans)])

  def loss(s, t):
    if not cfg.use_extended_uld:
      s = jnp.take_along_axis(s, s_rows[..., None], axis=1)
      t = jnp.take_along_axis(t, t_rows[..., None], axis=1)
    if cfg.uld_use_hybrid_loss:
      teacher_ids, student_ids = kd.matched_vocabulary(
        tokenizer_pair[0].get_vocab(), tokenizer_pair[1].get_vocab()
      )
      out = kd.gold_loss(
        s, t, student_ids=student_ids, teacher_ids=teacher_ids, beta=cfg.beta,
        matched_weight=cfg.uld_hybrid_matched_weight,
        unmatched_weight=cfg.uld_hybrid_unmatched_weight, **opts,
      )  # fmt: skip
    else:
      out = kd.uld_loss(s, t, **opts)
    out = cfg.uld_distillation_weight * out
    if cfg.uld_crossentropy_weight:  # nn.CrossEntropyLoss(ignore_index=-100), shifted
      labels = s_lab[:, 1:]
      log_p = kd.token_log_probs(s[:, :-1], labels, ignore_index=-100)
      ce = -jnp.sum(log_p) / np.sum(labels != -100)
      out = out + cfg.uld_crossentropy_weight * ce
    return out

  value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(s_logits, t_logits)
  return float(value), *(np.asarray(g) for g in grads)


CASES = {
  "plain": dict(use_extended_uld=False),
  "plain-eos-temperatures": dict(
    use_extended_uld=False, uld_skip_student_eos=False, uld_skip_teacher_eos=False,
    uld_student_temperature=2.0, uld_teacher_temperature=0.7,
  ),
  "plain-bayesian": dict(use_extended_uld=False, uld_token_merge_strategy="bayesian"),
  "extended-observed": {},
  "extended-bayesian": dict(uld_token_merge_strategy="bayesian"),
  "extended-keep-eos": dict(uld_skip_student_eos=False, uld_skip_teacher_eos=False),
  "extended-bayesian-keep-eos": dict(
    uld_token_merge_strategy="bayesian", uld_skip_student_eos=False, uld_skip_teacher_eos=True
  ),
  "hybrid-adaptive": dict(uld_use_hybrid_loss=True, beta=0.3),
  "hybrid-fixed-bayesian": dict(
    uld_use_hybrid_loss=True, uld_hybrid_matched_weight=0.7, uld_hybrid_unmatched_weight=0.4,
    uld_token_merge_strategy="bayesian", uld_teacher_temperature=1.5,
  ),
  "hybrid-positional-kl": dict(uld_use_hybrid_loss=True, use_extended_uld=False, beta=0.0),
  "hybrid-reverse-kl": dict(uld_use_hybrid_loss=True, beta=1.0),
  "crossentropy": dict(uld_crossentropy_weight=0.3, uld_distillation_weight=0.8),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_matches_trl_uld_loss(x64, tokenizer_pair, batch, case):
  cfg = _config(**CASES[case])
  want, want_s, want_t = trl_value_and_grads(cfg, tokenizer_pair, batch)
  got, got_s, got_t = kldiv_jax_value_and_grads(cfg, tokenizer_pair, batch)
  assert want > 0
  np.testing.assert_allclose(got, want, rtol=1e-12)
  np.testing.assert_allclose(got_s, want_s, rtol=1e-9, atol=1e-14)
  np.testing.assert_allclose(got_t, want_t, rtol=1e-9, atol=1e-14)


def _tie_groups_sum(grad, logits):
  """Each row's gradient summed over each group of equal logits (ties), ``{(row, value): sum}``."""
  out = {}
  for r, (g, z) in enumerate(
    zip(grad.reshape(-1, grad.shape[-1]), logits.reshape(-1, grad.shape[-1]))
  ):
    for v in np.unique(z):
      out[r, v] = g[z == v].sum()
  return out


@pytest.mark.parametrize("case", ["plain", "extended-observed", "hybrid-adaptive"])
def test_ties_take_the_stable_sort_order(x64, tokenizer_pair, batch, case, monkeypatch):
  """Logits on a coarse grid tie within rows. With TRL's sort made stable, the gradients are
  TRL's; with its own ``Tensor.sort`` (not stable on long rows), they differ only by a
  permutation within each tie: the value, each tie group's sum and every untied entry agree."""
  student, teacher, s_logits, t_logits = batch
  tied = (student, teacher, np.round(s_logits), np.round(t_logits))
  cfg = _config(**CASES[case])
  got, got_s, got_t = kldiv_jax_value_and_grads(cfg, tokenizer_pair, tied)
  want, want_s, want_t = trl_value_and_grads(cfg, tokenizer_pair, tied)
  np.testing.assert_allclose(got, want, rtol=1e-12)
  for g, w, z in ((got_s, want_s, tied[2]), (got_t, want_t, tied[3])):
    gs, ws = _tie_groups_sum(g, z), _tie_groups_sum(w, z)
    np.testing.assert_allclose(list(gs.values()), [ws[k] for k in gs], rtol=1e-9, atol=1e-14)
  sort = torch.sort
  monkeypatch.setattr(
    torch.Tensor,
    "sort",
    lambda x, dim=-1, descending=False: sort(x, dim=dim, descending=descending, stable=True),
  )
  want, want_s, want_t = trl_value_and_grads(cfg, tokenizer_pair, tied)
  np.testing.assert_allclose(got, want, rtol=1e-12)
  np.testing.assert_allclose(got_s, want_s, rtol=1e-9, atol=1e-14)
  np.testing.assert_allclose(got_t, want_t, rtol=1e-9, atol=1e-14)


def test_align_tokens_is_trls_alignment(tokenizer_pair, batch):
  """align_tokens equals TRL's _align_by_byte_offsets on the real tokenizers' byte offsets."""
  (_, s_lab, s_off), (_, t_lab, t_off), _, _ = batch
  teacher_spans = 0
  for so, to, (a, n), (b, m) in zip(s_off, t_off, _answer(s_lab, False), _answer(t_lab, False)):
    s_ref, t_ref = gold.ULDLoss._align_by_byte_offsets(
      so[a : a + n].tolist(), to[b : b + m].tolist()
    )
    pairs = [(x, y) for x, y in zip(s_ref, t_ref) if x and y]
    assert len(pairs) > 5 and any(len(x) > 1 for x, _ in pairs)  # spans merged
    teacher_spans += sum(len(y) > 1 for _, y in pairs)
    s_got, t_got = kd.align_tokens(so[a : a + n], to[b : b + m])
    assert [[i for i in g if i >= 0] for g in s_got] == [x for x, _ in pairs]
    assert [[i for i in g if i >= 0] for g in t_got] == [y for _, y in pairs]
  assert teacher_spans > 0


def test_matched_vocabulary_is_trls_mapping(tokenizer_pair):
  loss_fn = gold.ULDLoss(_config(uld_use_hybrid_loss=True), *tokenizer_pair)
  teacher_ids, student_ids = kd.matched_vocabulary(
    tokenizer_pair[0].get_vocab(), tokenizer_pair[1].get_vocab()
  )
  want_t = sorted(loss_fn._teacher_matched_ids)
  assert teacher_ids.tolist() == want_t
  assert student_ids.tolist() == loss_fn.mapping_tensor[torch.tensor(want_t)].tolist()
  assert 0 < len(teacher_ids) < tokenizer_pair[1].get_vocab_size()
