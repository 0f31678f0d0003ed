"""DivergenceMetric: torchmetrics' KLDivergence tests, float64 NumPy, accumulation, clu's protocol.

Expected values come from float64 NumPy ports of torchmetrics'
``_kld_update``/``_kld_compute`` (``src/torchmetrics/functional/regression/
kl_divergence.py``), from ``scipy.stats.entropy`` (the reference of
torchmetrics' own test, ``tests/unittests/regression/test_kl_divergence.py``),
from the divergences' float64 references in ``_references.py``, and, live,
from ``torchmetrics.KLDivergence`` itself (``pytest -m torch``).
"""

import dataclasses
import itertools
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from _references import count_compiles, np_log_softmax, ref_forward_kl, ref_jsd, ref_skew_kl
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P

from kldiv_jax import Divergence
from kldiv_jax._metric import DivergenceMetric

# torchmetrics' tests/unittests/conftest.py: NUM_PROCESSES = 2, NUM_BATCHES = 2 * NUM_PROCESSES.
NUM_BATCHES, BATCH_SIZE, EXTRA_DIM = 4, 32, 3
TM_ATOL = 1e-6  # TestKLDivergence.atol

ProbsMetric = DivergenceMetric.configure(inputs="probs")


# ----------------------------------------------------------------------------- references


def tm_kld_update(p, q, log_prob):
  """torchmetrics' ``_kld_update`` in float64 NumPy: ``(measures, total)``."""
  p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
  assert p.shape == q.shape and p.ndim == 2
  with np.errstate(all="ignore"):
    if log_prob:
      measures = np.sum(np.exp(p) * (p - q), axis=-1)
    else:
      p = p / p.sum(axis=-1, keepdims=True)
      q = q / q.sum(axis=-1, keepdims=True)
      terms = p * np.log(p / q)
      measures = np.where(p == 0, 0.0, terms).sum(axis=-1)  # _safe_xlogy
  return measures, p.shape[0]


def tm_kld_compute(measures, total, reduction):
  """torchmetrics' ``_kld_compute``."""
  return measures.sum() if reduction == "sum" else measures.sum() / total


def scipy_reference(p, q, log_prob, reduction):
  """torchmetrics' test's ``_wrap_reduction``: ``scipy.stats.entropy`` per row."""
  p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
  if log_prob:
    p, q = np.exp(np_log_softmax(p)), np.exp(np_log_softmax(q))
  res = scipy.stats.entropy(p, q, axis=1)
  return np.mean(res) if reduction == "mean" else np.sum(res)


def tm_inputs(log_prob, seed=42):
  """The shapes and distributions of torchmetrics' ``_probs_inputs``/``_log_probs_inputs``."""
  rng = np.random.default_rng(seed)
  shape = (NUM_BATCHES, BATCH_SIZE, EXTRA_DIM)
  p, q = rng.random(shape, np.float32), rng.random(shape, np.float32)
  if log_prob:  # torch.rand(...).softmax(dim=-1).log()
    p, q = (np_log_softmax(x).astype(np.float32) for x in (p, q))
  return p, q


def accumulate(metric_cls, batches, **kwargs):
  m = metric_cls.empty()
  for z, y in batches:
    m = m.merge(metric_cls.from_model_output(z, y, **kwargs))
  return m


# ----------------------------------------------------------------- torchmetrics parity


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("log_prob", [False, True])
def test_torchmetrics_suite(log_prob, reduction):
  # TestKLDivergence: per batch (forward) and at the end (compute), atol 1e-6.
  p, q = tm_inputs(log_prob)
  metric_cls = DivergenceMetric.configure(
    inputs="log_probs" if log_prob else "probs", reduction=reduction
  )
  step = jax.jit(lambda m, q, p: m.merge(metric_cls.from_model_output(q, p)))
  m = metric_cls.empty()
  for i in range(NUM_BATCHES):
    batch = metric_cls.from_model_output(q[i], p[i]).compute()
    expected = tm_kld_compute(*tm_kld_update(p[i], q[i], log_prob), reduction)
    np.testing.assert_allclose(batch, expected, rtol=1e-6, atol=TM_ATOL)
    np.testing.assert_allclose(
      batch, scipy_reference(p[i], q[i], log_prob, reduction), rtol=1e-6, atol=TM_ATOL
    )
    m = step(m, q[i], p[i])
  flat_p, flat_q = p.reshape(-1, EXTRA_DIM), q.reshape(-1, EXTRA_DIM)
  expected = tm_kld_compute(*tm_kld_update(flat_p, flat_q, log_prob), reduction)
  np.testing.assert_allclose(m.compute(), expected, rtol=1e-6, atol=TM_ATOL)
  np.testing.assert_allclose(
    m.compute(), scipy_reference(flat_p, flat_q, log_prob, reduction), rtol=1e-6, atol=TM_ATOL
  )
  assert int(m.count) == NUM_BATCHES * BATCH_SIZE


def test_torchmetrics_docstring_example():
  # KLDivergence's docstring: kl_divergence(p, q) -> tensor(0.0853).
  p, q = np.array([[0.36, 0.48, 0.16]]), np.array([[1 / 3, 1 / 3, 1 / 3]])
  got = ProbsMetric.from_model_output(q, p).compute()
  np.testing.assert_allclose(got, tm_kld_compute(*tm_kld_update(p, q, False), "mean"), rtol=1e-6)
  assert round(float(got), 4) == 0.0853


def test_torchmetrics_zero_probability():
  # test_zero_probability: p = 0 gives no NaN; the value is torchmetrics' (0 log 0 = 0).
  p = np.array([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
  q = np.asarray(jax.nn.softmax(np.random.default_rng(0).normal(size=(3, 3))), np.float64)
  got = ProbsMetric.from_model_output(q, p).compute()
  assert np.isfinite(got)
  np.testing.assert_allclose(got, tm_kld_compute(*tm_kld_update(p, q, False), "mean"), rtol=1e-6)


def test_torchmetrics_inf_case():
  # test_inf_case: q = 0 where p > 0 gives +inf (torchmetrics: "not finite").
  got = ProbsMetric.from_model_output([[0.5, 0.5, 0.0]], [[0.3, 0.3, 0.4]]).compute()
  assert got == np.inf


def test_unnormalised_probabilities_are_normalised_as_torchmetrics():
  rng = np.random.default_rng(1)
  p, q = 5.0 * rng.random((6, 4)), 0.1 * rng.random((6, 4))
  got = ProbsMetric.from_model_output(q, p).compute()
  np.testing.assert_allclose(got, tm_kld_compute(*tm_kld_update(p, q, False), "mean"), rtol=2e-6)


def test_more_axes_than_torchmetrics():
  # torchmetrics takes only [N, d] (test_error_on_multidim_tensors); here [..., d] is rows.
  p, q = tm_inputs(False)
  got = ProbsMetric.from_model_output(q, p)
  flat = ProbsMetric.from_model_output(q.reshape(-1, EXTRA_DIM), p.reshape(-1, EXTRA_DIM))
  np.testing.assert_allclose(got.compute(), flat.compute(), rtol=1e-6)
  assert int(got.count) == int(flat.count) == p.size // EXTRA_DIM


@pytest.mark.torch
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("log_prob", [False, True])
def test_torchmetrics_live(torch, log_prob, reduction):
  torchmetrics = pytest.importorskip("torchmetrics")
  p, q = tm_inputs(log_prob)
  ours_cls = DivergenceMetric.configure(
    inputs="log_probs" if log_prob else "probs", reduction=reduction
  )
  theirs = torchmetrics.KLDivergence(log_prob=log_prob, reduction=reduction)
  ours = ours_cls.empty()
  for i in range(NUM_BATCHES):
    batch = theirs(torch.from_numpy(p[i]), torch.from_numpy(q[i]))  # forward: batch value
    ours_batch = ours_cls.from_model_output(q[i], p[i])
    np.testing.assert_allclose(ours_batch.compute(), batch.numpy(), rtol=1e-5, atol=TM_ATOL)
    ours = ours.merge(ours_batch)
    np.testing.assert_allclose(ours.compute(), theirs.compute().numpy(), rtol=1e-5, atol=TM_ATOL)
  # The edge cases of torchmetrics' tests, side by side.
  zero_p = np.array([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]], np.float32)
  some_q = np.array([[0.2, 0.3, 0.5], [0.1, 0.1, 0.8]], np.float32)
  no_p = np.array([[0.0, 0.0, 0.0], [0.0, 0.0, 1.0]], np.float32)  # torchmetrics: 0/0, NaN
  if not log_prob:
    for p_, q_ in [(zero_p, some_q), (some_q, zero_p), (no_p, some_q), (some_q, no_p)]:
      theirs = torchmetrics.KLDivergence(reduction=reduction)
      theirs.update(torch.from_numpy(p_), torch.from_numpy(q_))
      got = ours_cls.from_model_output(q_, p_).compute()
      np.testing.assert_allclose(got, theirs.compute().numpy(), rtol=1e-5)  # NaN == NaN


# ------------------------------------------------------------ values against float64 NumPy


def test_forward_kl_with_temperature_and_sum(x64, rng):
  z, y = rng.normal(size=(2, 5, 7)), 2.0 * rng.normal(size=(2, 5, 7))
  per_row = ref_forward_kl(z, y, 2.5)
  for reduction, expected in [("mean", per_row.mean()), ("sum", per_row.sum())]:
    cls = DivergenceMetric.configure(temperature=2.5, reduction=reduction)
    m = cls.from_model_output(z, y)
    np.testing.assert_allclose(m.compute(), expected, rtol=1e-13)
    assert m.total.dtype == np.float64 and m.count.dtype == np.int64
    assert int(m.count) == 10


@pytest.mark.parametrize(
  ("divergence", "reference"),
  [
    ("jsd", lambda z, y, t: ref_jsd(z, y, t, beta=0.5)),
    (Divergence("jsd", beta=0.3), lambda z, y, t: ref_jsd(z, y, t, beta=0.3)),
    (Divergence("skew_kl", alpha=0.2), lambda z, y, t: ref_skew_kl(z, y, t, alpha=0.2)),
  ],
)
def test_other_divergences(x64, rng, divergence, reference):
  z, y = rng.normal(size=(3, 4, 9)), rng.normal(size=(3, 4, 9))
  cls = DivergenceMetric.configure(divergence=divergence, temperature=1.5)
  got = cls.from_model_output(z, y).compute()
  np.testing.assert_allclose(got, reference(z, y, 1.5).mean(), rtol=1e-12)


def test_per_sequence_is_the_mean_of_sequence_means(x64, rng):
  z, y = rng.normal(size=(4, 6, 5)), rng.normal(size=(4, 6, 5))
  tokens = rng.random((4, 6)) < 0.6
  tokens[2] = False  # a sequence without valid tokens: not counted
  tokens[0, 0] = True
  per_token = ref_forward_kl(z, y)
  valid = tokens.any(axis=-1)
  seq_means = np.array([per_token[b][tokens[b]].mean() for b in range(4) if valid[b]])
  per_seq = DivergenceMetric.configure(per="sequence")
  m = per_seq.from_model_output(z, y, mask=tokens)
  assert int(m.count) == valid.sum() == 3
  np.testing.assert_allclose(m.compute(), seq_means.mean(), rtol=1e-13)
  summed = DivergenceMetric.configure(per="sequence", reduction="sum")
  np.testing.assert_allclose(
    summed.from_model_output(z, y, mask=tokens).compute(), seq_means.sum(), rtol=1e-13
  )
  # Per token weights every token alike: a different number.
  token_mean = DivergenceMetric.from_model_output(z, y, mask=tokens).compute()
  np.testing.assert_allclose(token_mean, per_token[tokens].mean(), rtol=1e-13)
  assert abs(float(token_mean) - seq_means.mean()) > 1e-3


def test_mask_equals_dropping_rows(x64, rng):
  z, y = rng.normal(size=(5, 3, 6)), rng.normal(size=(5, 3, 6))
  keep = rng.random((5, 3)) < 0.5
  z_nan = np.where(keep[..., None], z, np.nan)  # padding in masked rows cannot leak
  got = DivergenceMetric.from_model_output(z_nan, y, mask=keep)
  dropped = DivergenceMetric.from_model_output(z[keep], y[keep])
  np.testing.assert_allclose(got.total, dropped.total, rtol=1e-13)
  assert int(got.count) == int(dropped.count) == keep.sum()
  # clu casts a numeric mask to bool; a [batch] mask (a prefix of the shape) masks whole rows.
  numeric = DivergenceMetric.from_model_output(z, y, mask=keep.astype(np.float32))
  np.testing.assert_allclose(numeric.total, dropped.total, rtol=1e-13)
  first = np.array([True, False, True, True, False])
  prefix = DivergenceMetric.from_model_output(z, y, mask=first)
  np.testing.assert_allclose(
    prefix.total, DivergenceMetric.from_model_output(z[first], y[first]).total, rtol=1e-13
  )
  assert int(prefix.count) == 9


def test_class_where_equals_dropping_classes(x64, rng):
  z, y = rng.normal(size=(4, 8)), rng.normal(size=(4, 8))
  classes = np.array([True, True, False, True, False, True, True, True])
  got = DivergenceMetric.from_model_output(z, y, where=classes)
  np.testing.assert_allclose(got.compute(), ref_forward_kl(z[:, classes], y[:, classes]).mean())
  # A [4] class mask on [4, 4] logits is a class mask here, never a per-row one.
  square_z, square_y = z[:, :4], y[:, :4]
  got = DivergenceMetric.from_model_output(square_z, square_y, where=classes[:4])
  expected = ref_forward_kl(square_z[:, classes[:4]], square_y[:, classes[:4]])
  np.testing.assert_allclose(got.compute(), expected.mean(), rtol=1e-13)
  assert int(got.count) == 4


def test_log_probs_and_probs_agree_with_logits(x64, rng):
  z, y = rng.normal(size=(6, 5)), rng.normal(size=(6, 5))
  lq, lp = np_log_softmax(z), np_log_softmax(y)
  expected = ref_forward_kl(z, y).mean()
  for inputs, args in [("logits", (z, y)), ("log_probs", (lq, lp)), ("probs", np.exp((lq, lp)))]:
    cls = DivergenceMetric.configure(inputs=inputs)
    np.testing.assert_allclose(cls.from_model_output(*args).compute(), expected, rtol=1e-12)


# ---------------------------------------------------------------------- accumulation


@pytest.mark.parametrize("per", ["token", "sequence"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_batches_accumulate_to_one_big_batch(x64, rng, per, reduction):
  sizes = [3, 1, 5, 2, 4]
  z, y = rng.normal(size=(15, 6, 11)), rng.normal(size=(15, 6, 11))
  mask = rng.random((15, 6)) < 0.7
  cls = DivergenceMetric.configure(divergence="jsd", per=per, reduction=reduction)
  whole = cls.from_model_output(z, y, mask=mask)
  edges = np.cumsum([0, *sizes])
  parts = [
    cls.from_model_output(z[a:b], y[a:b], mask=mask[a:b]) for a, b in itertools.pairwise(edges)
  ]
  for order in (range(5), [4, 2, 0, 3, 1]):
    m = cls.empty()
    for i in order:
      m = m.merge(parts[i])
    np.testing.assert_allclose(m.compute(), whole.compute(), rtol=1e-12)
    assert int(m.count) == int(whole.count)
  # A tree of merges, as over devices.
  tree = (parts[0].merge(parts[1])).merge(parts[2].merge(parts[3].merge(parts[4])))
  np.testing.assert_allclose(tree.compute(), whole.compute(), rtol=1e-12)


def test_batches_accumulate_in_float32(rng):
  z = rng.normal(size=(8, 16, 50)).astype(np.float32)
  y = rng.normal(size=(8, 16, 50)).astype(np.float32)
  step = jax.jit(lambda m, z, y: m.merge(DivergenceMetric.from_model_output(z, y)))
  m = DivergenceMetric.empty()
  for i in range(8):
    m = step(m, z[i], y[i])
  assert m.total.dtype == np.float32 and m.count.dtype == np.int32
  np.testing.assert_allclose(m.compute(), ref_forward_kl(z, y).mean(), rtol=2e-6)
  np.testing.assert_allclose(m.compute(), DivergenceMetric.from_model_output(z, y).compute(), 2e-6)


def test_empty_metric():
  # clu's Average and torchmetrics: 'mean' of nothing is 0/0 = NaN; 'sum' is 0.
  assert np.isnan(DivergenceMetric.empty().compute())
  assert DivergenceMetric.configure(reduction="sum").empty().compute() == 0.0
  m = DivergenceMetric.from_model_output(np.zeros((3, 0, 4)), np.zeros((3, 0, 4)))
  assert int(m.count) == 0 and float(m.total) == 0.0
  per_seq = DivergenceMetric.configure(per="sequence")
  assert int(per_seq.from_model_output(np.zeros((3, 0, 4)), np.zeros((3, 0, 4))).count) == 0
  all_masked = DivergenceMetric.from_model_output(np.ones((2, 3)), np.zeros((2, 3)), mask=[0, 0])
  assert int(all_masked.count) == 0 and np.isnan(all_masked.compute())
  merged = DivergenceMetric.from_model_output(np.ones((2, 3)), np.zeros((2, 3)))
  np.testing.assert_array_equal(merged.merge(DivergenceMetric.empty()).total, merged.total)


# ------------------------------------------------------------------- jit, pytree, devices


def test_jit_equals_eager_and_compiles_once(rng):
  cls = DivergenceMetric.configure(divergence="tvd", per="sequence")
  batches = [(rng.normal(size=(2, 3, 5)), rng.normal(size=(2, 3, 5))) for _ in range(4)]
  masks = [rng.random((2, 3)) < 0.8 for _ in range(4)]

  def update(m, z, y, mask):
    return m.merge(type(m).from_model_output(z, y, mask=mask, labels=None))

  step = jax.jit(update)
  eager = jitted = cls.empty()
  with count_compiles() as compiles:
    for (z, y), mask in zip(batches, masks):
      jitted = step(jitted, z, y, mask)
  assert len(compiles) <= 1  # the first call; none per batch
  for (z, y), mask in zip(batches, masks):
    eager = update(eager, z, y, mask)
  np.testing.assert_allclose(jitted.compute(), eager.compute(), rtol=1e-6)
  # The same options give the same class: a metric from a second configure() does not retrace.
  again = DivergenceMetric.configure(per="sequence", divergence=Divergence("tvd"))
  assert again is cls
  with count_compiles() as compiles:
    step(again.empty(), *batches[0], masks[0])
  assert compiles == []


def test_configure_gives_cached_registered_subclasses():
  cls = DivergenceMetric.configure(reduction="sum")
  assert cls is DivergenceMetric.configure(reduction="sum")
  assert issubclass(cls, DivergenceMetric) and cls.options.reduction == "sum"
  assert DivergenceMetric.configure() is DivergenceMetric
  # Options not given are kept from the class configure is called on.
  derived = cls.configure(per="sequence")
  assert derived.options.reduction == "sum" and derived.options.per == "sequence"
  assert derived is DivergenceMetric.configure(reduction="sum", per="sequence")
  assert cls.configure(reduction="mean") is DivergenceMetric
  m = cls.from_model_output(np.zeros((2, 3)), np.ones((2, 3)))
  leaves, treedef = jax.tree_util.tree_flatten(m)
  assert len(leaves) == 2
  assert type(jax.tree_util.tree_unflatten(treedef, leaves)) is cls
  assert type(jax.tree_util.tree_map(lambda x: x + 1, m)) is cls
  with pytest.raises(dataclasses.FrozenInstanceError):
    m.total = jnp.zeros(())  # type: ignore[misc]
  back = pickle.loads(pickle.dumps(m))
  assert type(back) is cls and float(back.total) == float(m.total)
  skew = DivergenceMetric.configure(divergence=Divergence("skew_kl", alpha=0.2)).empty()
  assert type(pickle.loads(pickle.dumps(skew))) is type(skew)


def test_vmap_collectives_psum_and_all_gather(rng):
  # Four "devices" as a vmapped axis: psum of the fields, and all_gather + reduce().
  z = rng.normal(size=(4, 8, 6)).astype(np.float32)
  y = rng.normal(size=(4, 8, 6)).astype(np.float32)
  mask = rng.random((4, 8)) < 0.75
  cls = DivergenceMetric.configure(divergence="reverse_kl")
  single = cls.from_model_output(z, y, mask=mask)

  def per_device(z, y, mask):
    m = cls.from_model_output(z, y, mask=mask)
    return lax.psum(m, "d"), lax.all_gather(m, "d").reduce()

  summed, gathered = jax.jit(jax.vmap(per_device, axis_name="d"))(z, y, mask)
  for out in (summed, gathered):
    assert type(out) is cls
    np.testing.assert_allclose(out.total, np.full(4, single.total), rtol=1e-6)
    np.testing.assert_array_equal(out.count, np.full(4, single.count))


def test_process_allgather_and_reduce(rng):
  z, y = rng.normal(size=(3, 5)), rng.normal(size=(3, 5))
  m = DivergenceMetric.from_model_output(z, y)
  gathered = multihost_utils.process_allgather(m)
  assert gathered.total.shape == (jax.process_count(),)
  reduced = gathered.reduce()
  np.testing.assert_allclose(reduced.compute(), m.compute(), rtol=1e-6)


@pytest.mark.multidevice
def test_shard_map_psum_and_all_gather(cpu_devices, rng):
  z = rng.normal(size=(16, 4, 10)).astype(np.float32)
  y = rng.normal(size=(16, 4, 10)).astype(np.float32)
  mask = rng.random((16, 4)) < 0.7
  mask[3] = False
  cls = DivergenceMetric.configure(per="sequence", temperature=2.0)
  single = cls.from_model_output(z, y, mask=mask)
  mesh = jax.sharding.Mesh(np.asarray(cpu_devices), ("data",))

  def gather(f, **kwargs):
    specs = (P("data"), P("data"), P("data"))
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=P(), **kwargs))

  summed = gather(lambda z, y, mask: lax.psum(cls.from_model_output(z, y, mask=mask), "data"))
  # shard_map cannot infer that an all_gather's sum is replicated: check_vma=False.
  gathered = gather(
    lambda z, y, mask: lax.all_gather(cls.from_model_output(z, y, mask=mask), "data").reduce(),
    check_vma=False,
  )
  summed, gathered = summed(z, y, mask), gathered(z, y, mask)
  for out in (summed, gathered):
    np.testing.assert_allclose(out.compute(), single.compute(), rtol=1e-6)
    assert int(out.count) == int(single.count) == 15


# ------------------------------------------------------------------------- clu's protocol


@dataclasses.dataclass(frozen=True)
class Average:
  """clu.metrics.Average's protocol, for the collection below."""

  total: jax.Array
  count: jax.Array

  @classmethod
  def empty(cls):
    return cls(jnp.zeros(()), jnp.zeros((), jnp.int32))

  @classmethod
  def from_model_output(cls, loss, **_):
    return cls(jnp.sum(loss), jnp.asarray(jnp.size(loss), jnp.int32))

  def merge(self, other):
    return type(self)(self.total + other.total, self.count + other.count)

  def compute(self):
    return self.total / self.count


jax.tree_util.register_dataclass(Average, data_fields=["total", "count"], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class Collection:
  """A minimal clu.metrics.Collection: every metric gets every model output as keywords."""

  kl: DivergenceMetric
  per_sequence_kl: DivergenceMetric
  loss: Average

  @classmethod
  def metrics(cls):
    return {
      "kl": DivergenceMetric,
      "per_sequence_kl": DivergenceMetric.configure(per="sequence"),
      "loss": Average,
    }

  @classmethod
  def empty(cls):
    return cls(**{k: m.empty() for k, m in cls.metrics().items()})

  @classmethod
  def single_from_model_output(cls, **outputs):
    return cls(**{k: m.from_model_output(**outputs) for k, m in cls.metrics().items()})

  def merge(self, other):
    return type(self)(**{k: getattr(self, k).merge(getattr(other, k)) for k in self.metrics()})

  def compute(self):
    return {k: getattr(self, k).compute() for k in self.metrics()}


jax.tree_util.register_dataclass(
  Collection, data_fields=["kl", "per_sequence_kl", "loss"], meta_fields=[]
)


def test_clu_style_collection(x64, rng):
  z, y = rng.normal(size=(6, 3, 4)), rng.normal(size=(6, 3, 4))
  labels = rng.integers(0, 4, size=(6, 3))
  mask = rng.random((6, 3)) < 0.8
  mask[:, 0] = True

  @jax.jit
  def eval_step(metrics, z, y, labels, mask):
    loss = jnp.mean(z, axis=-1)
    update = Collection.single_from_model_output(
      logits=z, target_logits=y, labels=labels, loss=loss, mask=mask
    )
    return metrics.merge(update)

  metrics = Collection.empty()
  for a, b in [(0, 2), (2, 3), (3, 6)]:
    metrics = eval_step(metrics, z[a:b], y[a:b], labels[a:b], mask[a:b])
  out = metrics.compute()
  per_token = ref_forward_kl(z, y)
  np.testing.assert_allclose(out["kl"], per_token[mask].mean(), rtol=1e-12)
  seq = [per_token[b][mask[b]].mean() for b in range(6)]
  np.testing.assert_allclose(out["per_sequence_kl"], np.mean(seq), rtol=1e-12)
  np.testing.assert_allclose(out["loss"], z.mean(), rtol=1e-12)


# ------------------------------------------------------------------------ hostile inputs


@pytest.mark.parametrize(
  ("options", "error", "match"),
  [
    ({"inputs": "prob"}, ValueError, "inputs must be one of 'logits', 'log_probs', 'probs'"),
    ({"reduction": "none"}, ValueError, "fixed-size state"),
    ({"reduction": "batchmean"}, ValueError, "reduction must be one of 'mean', 'sum'"),
    ({"reduction": "avg"}, ValueError, "reduction must be one of 'mean', 'sum'; got 'avg'"),
    ({"per": "batch"}, ValueError, "per must be one of 'token', 'sequence'"),
    ({"divergence": "kl"}, ValueError, "divergence must be one of"),
    ({"divergence": 3}, TypeError, "divergence must be one of"),
    ({"temperature": 0.0}, ValueError, "temperature must be positive and finite"),
    ({"temperature": jnp.asarray(2.0)}, TypeError, "temperature is part of the class"),
    ({"divergence": Divergence("jsd", beta=jnp.asarray(0.3))}, TypeError, "traced"),
  ],
)
def test_bad_options_raise(options, error, match):
  with pytest.raises(error, match=match) as info:
    DivergenceMetric.configure(**options)
  assert str(info.value).startswith("DivergenceMetric.configure: ")


@pytest.mark.parametrize(
  ("call", "error", "match"),
  [
    (lambda: DivergenceMetric.from_model_output(np.ones((2, 3), int), np.ones((2, 3))), TypeError, "Integral inputs"),
    (lambda: DivergenceMetric.from_model_output(np.ones((2, 3)), np.ones((4, 3))), ValueError, "cannot be broadcast"),
    (lambda: DivergenceMetric.from_model_output(np.ones((2, 3)), np.ones((2, 3)), mask=np.ones(3, bool)), ValueError, "mask has shape"),
    (lambda: DivergenceMetric.from_model_output(np.ones((2, 3)), np.ones((2, 3)), where=np.ones(3)), TypeError, "where must be a boolean mask"),
    (lambda: DivergenceMetric.from_model_output(np.float32(1.0), np.float32(1.0)), ValueError, r"needs inputs \[\.\.\., num_classes\]"),
    (lambda: DivergenceMetric.configure(per="sequence").from_model_output(np.ones(3), np.ones(3)), ValueError, "needs inputs"),
    (lambda: DivergenceMetric.from_model_output("logits", np.ones(3)), TypeError, "logits must be an array"),
  ],
)  # fmt: skip
def test_bad_inputs_raise_at_trace_time(call, error, match):
  with pytest.raises(error, match=match) as info:
    jax.jit(call)()
  assert str(info.value).startswith("DivergenceMetric.from_model_output: ")


def test_merging_what_does_not_match_raises():
  m = DivergenceMetric.empty()
  with pytest.raises(TypeError, match="one configuration"):
    m.merge(DivergenceMetric.configure(reduction="sum").empty())
  with pytest.raises(TypeError, match="one configuration"):
    m.merge(Average.empty())  # type: ignore[arg-type]
  gathered = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), m)
  with pytest.raises(ValueError, match=r"reduce\(\) a metric gathered"):
    m.merge(gathered)
  with pytest.raises(ValueError, match="leading axis"):
    m.reduce()
  assert int(gathered.reduce().count) == 0


def test_nan_and_invalid_probabilities_give_nan(rng):
  z, y = rng.normal(size=(4, 5)), rng.normal(size=(4, 5))
  z[2, 1] = np.nan
  assert np.isnan(DivergenceMetric.from_model_output(z, y).compute())
  assert np.isnan(DivergenceMetric.configure(reduction="sum").from_model_output(z, y).compute())
  per_seq = DivergenceMetric.configure(per="sequence")
  assert np.isnan(per_seq.from_model_output(z[None], y[None]).compute())
  # ... unless that row is masked.
  assert np.isfinite(DivergenceMetric.from_model_output(z, y, mask=[1, 1, 0, 1]).compute())
  p = np.array([[0.2, 0.3, 0.5], [0.5, -0.1, 0.6]])
  q = np.array([[0.2, 0.3, 0.5], [0.2, 0.3, 0.5]])
  assert np.isnan(ProbsMetric.from_model_output(q, p).compute())  # a negative probability
  assert np.isnan(ProbsMetric.from_model_output(p, q).compute())
  zeros = np.array([[0.2, 0.3, 0.5], [0.0, 0.0, 0.0]])
  assert np.isnan(ProbsMetric.from_model_output(q, zeros).compute())  # torchmetrics' 0/0
  assert np.isnan(ProbsMetric.from_model_output(zeros, q).compute())
  assert np.isfinite(ProbsMetric.from_model_output(q, zeros, mask=[True, False]).compute())


def test_low_precision_inputs(rng):
  z = rng.normal(size=(64, 40)).astype(jnp.bfloat16)
  y = rng.normal(size=(64, 40)).astype(jnp.bfloat16)
  m = DivergenceMetric.from_model_output(z, y)
  assert m.total.dtype == np.float32
  expected = ref_forward_kl(np.asarray(z, np.float64), np.asarray(y, np.float64)).mean()
  # Each row's value is summed in float32, not rounded to bf16 first.
  np.testing.assert_allclose(m.compute(), expected, rtol=1e-5)
  probs = ProbsMetric.from_model_output(
    jax.nn.softmax(z.astype(np.float32)).astype(jnp.float16),
    jax.nn.softmax(y.astype(np.float32)).astype(jnp.float16),
  )
  assert probs.total.dtype == np.float32
  np.testing.assert_allclose(probs.compute(), expected, rtol=2e-2)
