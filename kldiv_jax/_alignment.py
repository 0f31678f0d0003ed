"""Host helpers for distillation across tokenizers: token alignment and the shared vocabulary.

Plain Python and NumPy (no tokenizer library): :func:`align_tokens` turns two
tokenizations' byte offsets into the padded groups that :func:`kldiv_jax.uld_loss`,
:func:`kldiv_jax.gold_loss` and :func:`kldiv_jax.merge_spans` take; :func:`matched_vocabulary`
turns two ``get_vocab()`` dicts into the hybrid loss's id pairs. Both port TRL 1.16.0
(``trl/experimental/gold/gold_trainer.py``: ``ULDLoss._align_by_byte_offsets`` and
``ULDLoss._initialize_vocabulary_mapping``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def _ends(name: str, arg: str, offsets: object) -> list[int]:
  arr = np.asarray(offsets)
  if arr.size == 0:
    return []
  if arr.ndim != 2 or arr.shape[1] != 2 or not np.issubdtype(arr.dtype, np.integer):
    raise ValueError(
      f"{name}: {arg} must be (start, end) integer pairs, shape [tokens, 2] (a tokenizer's "
      f"offsets); got shape {arr.shape} and dtype {arr.dtype}."
    )
  return [int(e) for e in arr[:, 1]]


def _pad(name: str, groups: list[list[int]], num_groups: int, group_size: int) -> np.ndarray:
  out = np.full((num_groups, group_size), -1, np.int32)
  for i, g in enumerate(groups):
    out[i, : len(g)] = g
  return out


def align_tokens(
  student_offsets: Sequence[Sequence[int]] | np.ndarray,
  teacher_offsets: Sequence[Sequence[int]] | np.ndarray,
  *,
  student_start: int = 0,
  teacher_start: int = 0,
  num_groups: int | None = None,
  group_size: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
  """Groups of student and teacher token positions that cover the same bytes.

  Walks both offset lists, advancing the side whose current token ends first; a group
  closes where both sides end at the same byte (where the two tokenizers agree on a
  split). What is left at the end is one last group; pairs with an empty side (a
  zero-width token, such as an appended EOS) are dropped. TRL 1.16.0's
  ``ULDLoss._align_by_byte_offsets`` and the pairing in its ``_compute_distillation_loss``.

  Args:
    student_offsets, teacher_offsets: each token's byte ``(start, end)``, ``[tokens, 2]``,
      in one byte coordinate of the same text (only the ends are read). Give only the
      tokens to compare (e.g. the completion, without an EOS to skip).
    student_start, teacher_start: added to the positions (where these tokens start in the
      sequence the logits belong to).
    num_groups, group_size: the padded shape (default: as many as needed); give them to
      stack sequences into a batch of one shape.

  Returns:
    ``(student_groups, teacher_groups)``, int32 ``[num_groups, group_size]`` each: the
    positions of each group in ascending order, ``-1`` after them and in padding groups.

  Examples:
    >>> from kldiv_jax import align_tokens
    >>> s, t = align_tokens([(0, 3), (3, 5), (5, 9)], [(0, 5), (5, 7), (7, 9)])
    >>> s.tolist(), t.tolist()
    ([[0, 1], [2, -1]], [[0, -1], [1, 2]])
  """
  name = "align_tokens"
  s_end = _ends(name, "student_offsets", student_offsets)
  t_end = _ends(name, "teacher_offsets", teacher_offsets)
  for arg, value in (("student_start", student_start), ("teacher_start", teacher_start)):
    if not isinstance(value, (int, np.integer)) or value < 0:
      raise ValueError(f"{name}: {arg} must be a non-negative int; got {value!r}.")
  s_groups, t_groups = [], []
  s_first = t_first = s = t = 0
  while s < len(s_end) and t < len(t_end):
    if s_end[s] < t_end[t]:
      s += 1
    elif s_end[s] > t_end[t]:
      t += 1
    else:
      s, t = s + 1, t + 1
      s_groups.append(list(range(s_first, s)))
      t_groups.append(list(range(t_first, t)))
      s_first, t_first = s, t
  if s < len(s_end) or t < len(t_end):
    s_groups.append(list(range(s_first, len(s_end))))
    t_groups.append(list(range(t_first, len(t_end))))
  pairs = [(sg, tg) for sg, tg in zip(s_groups, t_groups) if sg and tg]
  s_groups = [[i + int(student_start) for i in sg] for sg, _ in pairs]
  t_groups = [[i + int(teacher_start) for i in tg] for _, tg in pairs]
  need_g = len(pairs)
  need_l = max([len(g) for g in s_groups + t_groups], default=1)
  g = need_g if num_groups is None else num_groups
  size = need_l if group_size is None else group_size
  if g < need_g:
    raise ValueError(f"{name}: num_groups={num_groups} is too small; these offsets make {need_g}.")
  if size < need_l:
    raise ValueError(
      f"{name}: group_size={group_size} is too small; the longest group has {need_l} tokens."
    )
  return _pad(name, s_groups, g, size), _pad(name, t_groups, g, size)


def matched_vocabulary(
  student_vocab: Mapping[str, int], teacher_vocab: Mapping[str, int]
) -> tuple[np.ndarray, np.ndarray]:
  """The vocabulary entries both tokenizers have (the same token string), as id pairs.

  TRL 1.16.0's ``ULDLoss._initialize_vocabulary_mapping``: every teacher token whose
  string is in the student's vocabulary maps to that student id.

  Args:
    student_vocab, teacher_vocab: ``{token string: id}``, what ``tokenizer.get_vocab()``
      returns.

  Returns:
    ``(teacher_ids, student_ids)``, int32 ``[M]``, sorted by teacher id (the
    ``teacher_ids``/``student_ids`` of :func:`gold_loss`).

  Examples:
    >>> from kldiv_jax import matched_vocabulary
    >>> t, s = matched_vocabulary({"a": 0, "b": 1, "c": 2}, {"c": 0, "x": 1, "a": 2})
    >>> t.tolist(), s.tolist()
    ([0, 2], [2, 0])
  """
  for arg, vocab in (("student_vocab", student_vocab), ("teacher_vocab", teacher_vocab)):
    if not isinstance(vocab, Mapping):
      raise TypeError(
        f"matched_vocabulary: {arg} must be a mapping of token strings to ids "
        f"(tokenizer.get_vocab()); got {type(vocab).__name__}."
      )
  pairs = sorted(
    (int(t), int(student_vocab[k])) for k, t in teacher_vocab.items() if k in student_vocab
  )
  teacher_ids = np.asarray([t for t, _ in pairs], np.int32)
  student_ids = np.asarray([s for _, s in pairs], np.int32)
  return teacher_ids, student_ids
