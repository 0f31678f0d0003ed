"""One process of the multi-process tests, and their single-process reference.

``test_multiprocess.py`` starts two of these (``python tests/_multiprocess_worker.py
--process-id I --num-processes 2 --port P --out DIR``): each joins a
``jax.distributed`` job on localhost (coordinator and gloo's CPU collectives on
loopback only) with 4 CPU devices, and the 8 devices form one ``("data",
"vocab")`` mesh of shape (2, 4) laid out like a checkerboard (:func:`checkerboard_mesh`), so
that *both* axes cross the process boundary: every psum over ``"data"`` and
every pmax/psum over ``"vocab"`` goes between processes. Each process places
only its addressable shards (``jax.make_array_from_callback``).

Each version of the loss (:data:`VERSIONS`) runs :data:`STEPS` jitted
``optax.adam`` steps twice from the same state (run to run determinism);
``process_allgather`` brings the losses, the first step's gradients and the
final parameters to the host, and each process writes them to
``DIR/process_I.npz`` with the mesh's process grid and the addresses its own
TCP sockets listen on (:func:`listening_addresses`, checked loopback here).

Imported, the module gives the same steps on one device (``mesh=None``):
the test's reference.
"""

import argparse
import faulthandler
import ipaddress
import os
import socket
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import kldiv_jax as kd

NUM_PROCESSES, LOCAL_DEVICES = 2, 4
BATCH, SEQ, VOCAB, EMBED, HIDDEN, TEACHER_HIDDEN = 4, 8, 64, 8, 16, 12
STEPS, RUNS = 3, 2
TEMPERATURE, ALPHA, LEARNING_RATE, CHUNK = 2.0, 0.5, 1e-3, 8
IGNORE = -100
VERSIONS = ("materialised", "vocab_parallel", "fused", "per_token")

PARAM_SPECS = {
  "embed": P(),
  "dense": P(),
  "dense_bias": P(),
  "head": P(None, "vocab"),
}
TEACHER_SPECS = {"embed": P(), "head": P(None, "vocab")}
BATCH_SPECS = {"tokens": P("data", None), "labels": P("data", None)}


# -- model and data (NumPy, seeded: every process builds the same global arrays) ---------------


def initial_state():
  """The student's and the teacher's parameters (float32)."""
  rng = np.random.default_rng(0)
  f32 = lambda x: x.astype(np.float32)  # noqa: E731
  params = {
    "embed": f32(0.5 * rng.normal(size=(VOCAB, EMBED))),
    "dense": f32(rng.normal(size=(EMBED, HIDDEN)) / np.sqrt(EMBED)),
    "dense_bias": np.zeros(HIDDEN, np.float32),
    "head": f32(rng.normal(size=(HIDDEN, VOCAB)) / np.sqrt(HIDDEN)),
  }
  teacher = {
    "embed": f32(rng.normal(size=(VOCAB, TEACHER_HIDDEN))),
    "head": f32(rng.normal(size=(TEACHER_HIDDEN, VOCAB)) * 3.0 / np.sqrt(TEACHER_HIDDEN)),
  }
  return params, teacher


def batches():
  """``STEPS`` batches of ``tokens`` and ``labels`` ``[BATCH, SEQ]``.

  Ignored labels are spread unevenly: the first half of the batch (the first
  ``"data"`` shard) has more of them, so a per-shard mean is not the global
  mean and a wrong normaliser shows.
  """
  rng = np.random.default_rng(1)
  out = []
  for _ in range(STEPS):
    tokens = rng.integers(0, VOCAB, size=(BATCH, SEQ)).astype(np.int32)
    labels = rng.integers(0, VOCAB, size=(BATCH, SEQ)).astype(np.int32)
    labels[0, SEQ // 4 :] = IGNORE
    labels[rng.random((BATCH, SEQ)) < 0.15] = IGNORE
    labels[BATCH - 1, 0] = VOCAB - 1  # the last class: on the last "vocab" device
    out.append({"tokens": tokens, "labels": labels})
  return out


def student_hidden(params, tokens):
  x = jnp.take(params["embed"], tokens, axis=0)
  return jnp.tanh(x @ params["dense"] + params["dense_bias"][None, None, :])


def teacher_hidden(teacher, tokens):
  return lax.stop_gradient(jnp.tanh(jnp.take(teacher["embed"], tokens, axis=0)))


# -- the losses: one function of (params, teacher, batch) per version --------------------------


def _vocab_parallel(h, w, th, tw, labels, count, axis_name):
  """``distillation_loss`` on one device's logits (its tokens, its vocabulary slice)."""
  return kd.distillation_loss(
    h @ w,
    th @ tw,
    labels,
    temperature=TEMPERATURE,
    alpha=ALPHA,
    normalizer=count,
    axis_name=axis_name,
  )


def _fused(h, w, th, tw, labels, count, axis_name):
  """The fused LM-head loss: logits ``CHUNK`` tokens at a time."""
  return kd.fused_distillation_loss(
    h,
    w,
    th,
    tw,
    labels=labels,
    temperature=TEMPERATURE,
    alpha=ALPHA,
    normalizer=count,
    chunk_size=CHUNK,
    axis_name=axis_name,
  )


def _per_token(h, w, th, tw, labels, count, axis_name):
  """Per-token divergences and log-probs, masked, summed and divided by the global count."""
  s, t = h @ w, th @ tw
  jsd = kd.divergence_from_logits(
    s, t, divergence="jsd", temperature=TEMPERATURE, axis_name=axis_name
  )
  reverse = kd.kl_div_from_logits(
    s, t, direction="reverse", temperature=TEMPERATURE, axis_name=axis_name
  )
  log_p = kd.token_log_probs(s, labels, ignore_index=IGNORE, axis_name=axis_name)
  per_token = TEMPERATURE**2 * (jsd + 0.5 * reverse) - log_p
  return jnp.sum(jnp.where(labels != IGNORE, per_token, 0.0)) / count


LOCAL_LOSSES = {"vocab_parallel": _vocab_parallel, "fused": _fused, "per_token": _per_token}


def make_loss(version, mesh):
  """``loss(params, teacher, batch)``; on ``mesh`` (sharded) or, with ``mesh=None``, one device.

  ``"materialised"`` is ``distillation_loss`` on the whole batch's logits,
  partitioned by XLA from the inputs' ``NamedSharding``. The others run
  :data:`LOCAL_LOSSES` inside ``jax.shard_map``: tokens split over
  ``"data"``, both LM heads over ``"vocab"`` (``axis_name="vocab"``), the
  *global* number of valid tokens as normaliser and a ``psum`` over ``"data"``.
  """
  if version == "materialised":

    def materialised(params, teacher, batch):
      tokens = batch["tokens"]
      s = student_hidden(params, tokens) @ params["head"]
      t = teacher_hidden(teacher, tokens) @ teacher["head"]
      return kd.distillation_loss(s, t, batch["labels"], temperature=TEMPERATURE, alpha=ALPHA)

    return materialised

  per_device = LOCAL_LOSSES[version]
  if mesh is None:
    local = lambda *args: per_device(*args, axis_name=None)  # noqa: E731
  else:
    tok, head = P("data", None, None), P(None, "vocab")
    local = jax.shard_map(
      lambda *args: lax.psum(per_device(*args, axis_name="vocab"), "data"),
      mesh=mesh,
      in_specs=(tok, head, tok, head, P("data", None), P()),
      out_specs=P(),
    )

  def loss(params, teacher, batch):
    tokens, labels = batch["tokens"], batch["labels"]
    count = jnp.sum(labels != IGNORE).astype(jnp.float32)  # global: over the whole batch
    h, th = student_hidden(params, tokens), teacher_hidden(teacher, tokens)
    return local(h, params["head"], th, teacher["head"], labels, count)

  return loss


def make_step(version, mesh):
  """A jitted Optax (adam) ``step(params, opt_state, teacher, batch) -> (params, opt_state,
  loss, grads)`` and the optimizer's jitted ``init``.

  On ``mesh`` the optimizer state, the new parameters and the gradients are
  sharded like the parameters (``out_shardings``; without them ``init``'s
  zeros would land on one device and the second step would compile again).
  """
  loss_fn, optimizer = make_loss(version, mesh), optax.adam(LEARNING_RATE)

  def step(params, opt_state, teacher, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, teacher, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grads

  if mesh is None:
    return jax.jit(step), jax.jit(optimizer.init)
  replicated = NamedSharding(mesh, P())
  params = {k: NamedSharding(mesh, spec) for k, spec in PARAM_SPECS.items()}
  state = optax.tree_utils.tree_map_params(
    optimizer,
    lambda _, sharding: sharding,
    jax.eval_shape(optimizer.init, initial_state()[0]),
    params,
    transform_non_params=lambda _: replicated,
  )
  step = jax.jit(step, out_shardings=(params, state, replicated, params))
  return step, jax.jit(optimizer.init, out_shardings=state)


def place(tree, specs, mesh):
  """Global arrays on ``mesh``, each process giving only its addressable shards."""
  if mesh is None:
    return jax.tree.map(jnp.asarray, tree)

  def put(x, spec):
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])

  return jax.tree.map(put, tree, specs)


def to_host(tree, mesh):
  """NumPy arrays of the global values (gathered from every process on ``mesh``)."""
  if mesh is not None:
    tree = multihost_utils.process_allgather(tree, tiled=True)
  return jax.tree.map(np.asarray, tree)


def train(version, mesh=None, runs=RUNS):
  """``runs`` times from the same state: ``{"loss": [runs, STEPS], "grad.K", "param.K": ...}``.

  ``grad.K`` are the first step's gradients, ``param.K`` the final
  parameters, both ``[runs, ...]``; ``seconds`` the wall time per step of
  each run (the first run's first step includes compiling).
  """
  params0, teacher0 = initial_state()
  step, init = make_step(version, mesh)
  teacher = place(teacher0, TEACHER_SPECS, mesh)
  data = [place(b, BATCH_SPECS, mesh) for b in batches()]
  out = {"loss": [], "seconds": []}
  grads_first, params_last = [], []
  for _ in range(runs):
    params = place(params0, PARAM_SPECS, mesh)
    opt_state = init(params)
    losses, grads, seconds = [], None, []
    for batch in data:
      start = time.perf_counter()
      params, opt_state, loss, g = step(params, opt_state, teacher, batch)
      loss.block_until_ready()
      seconds.append(time.perf_counter() - start)
      losses.append(loss)
      grads = g if grads is None else grads
    out["loss"].append(np.stack(to_host(losses, mesh)))
    out["seconds"].append(seconds)
    grads_first.append(to_host(grads, mesh))
    params_last.append(to_host(params, mesh))
  for name, trees in (("grad", grads_first), ("param", params_last)):
    for key in trees[0]:
      out[f"{name}.{key}"] = np.stack([t[key] for t in trees])
  return {k: np.asarray(v) for k, v in out.items()}


# -- the evaluation metric --------------------------------------------------------------------

METRIC = kd.DivergenceMetric.configure(divergence="jsd", temperature=TEMPERATURE, per="sequence")
METRIC_SEQUENCES = 8  # one per device


def metric_data():
  """Student and teacher logits ``[sequences, SEQ, VOCAB]`` and a token mask (seeded)."""
  rng = np.random.default_rng(2)
  shape = (METRIC_SEQUENCES, SEQ, VOCAB)
  s = (2.0 * rng.normal(size=shape)).astype(np.float32)
  t = (2.0 * rng.normal(size=shape)).astype(np.float32)
  mask = rng.random((METRIC_SEQUENCES, SEQ)) < 0.7
  mask[0] = False  # a sequence without valid tokens: not counted
  return s, t, mask


def metric_values(mesh=None):
  """``{"metric.gathered", "metric.psum"}``: ``[compute(), total, count]`` of the metric.

  ``gathered``: each process measures its own half of the sequences (on its
  own, no collective), ``process_allgather`` stacks the two metrics and
  ``reduce`` sums them. ``psum``: one sequence per device of the mesh, the
  metric's fields summed over both mesh axes inside ``jax.shard_map``. With
  ``mesh=None``, both are the metric of all the sequences on one device.
  """
  s, t, mask = metric_data()

  def row(m):
    return np.array([float(m.compute()), float(m.total), float(m.count)])

  if mesh is None:
    whole = row(METRIC.from_model_output(s, t, mask=mask))
    return {"metric.gathered": whole, "metric.psum": whole}
  half = METRIC_SEQUENCES // NUM_PROCESSES
  mine = slice(jax.process_index() * half, (jax.process_index() + 1) * half)
  local = METRIC.from_model_output(s[mine], t[mine], mask=mask[mine])
  gathered = multihost_utils.process_allgather(local, tiled=False)
  gathered = METRIC(total=jnp.asarray(gathered.total), count=jnp.asarray(gathered.count)).reduce()
  axes = ("data", "vocab")

  def per_device(z, y, m):
    return jax.tree.map(lambda x: lax.psum(x, axes), METRIC.from_model_output(z, y, mask=m))

  spec = P(axes)
  placed = place({"s": s, "t": t, "m": mask}, {"s": spec, "t": spec, "m": spec}, mesh)
  sharded = jax.shard_map(per_device, mesh=mesh, in_specs=(spec,) * 3, out_specs=P())
  summed = jax.jit(sharded)(placed["s"], placed["t"], placed["m"])
  return {"metric.gathered": row(gathered), "metric.psum": row(to_host(summed, mesh))}


# -- the distributed job ---------------------------------------------------------------------


def checkerboard_mesh():
  """The (2, 4) ``("data", "vocab")`` mesh, each row and each column on both processes.

  ``jax.make_mesh`` (on CPU) and ``examples/multihost_distillation.py`` put
  each process's devices in one row (``"vocab"`` inside a process, the layout
  to use on a cluster); this checkerboard makes the ``"vocab"`` collectives
  cross processes too::

      data 0:  p0  p1  p0  p1
      data 1:  p1  p0  p1  p0
  """
  local = [
    sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
    for p in range(NUM_PROCESSES)
  ]
  grid = [
    [
      local[(r + c) % NUM_PROCESSES][r * (LOCAL_DEVICES // 2) + c // 2]
      for c in range(LOCAL_DEVICES)
    ]
    for r in range(NUM_PROCESSES)
  ]
  return Mesh(np.array(grid), ("data", "vocab"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def loopback_hostname_problem() -> str | None:
  """Why gloo would not bind loopback here, or ``None``.

  Gloo's TCP transport listens on the address the machine's host name
  resolves to (JAX exposes no interface or host name for it), so a
  loopback-only job needs the host name to resolve to loopback addresses only.
  """
  name = socket.gethostname()
  try:
    infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
  except OSError as err:
    return f"the host name {name!r} does not resolve ({err})"
  addresses = sorted({info[4][0] for info in infos})
  public = [a for a in addresses if not ipaddress.ip_address(a.split("%")[0]).is_loopback]
  if public:
    return (
      f"the host name {name!r} resolves to {', '.join(public)}, not loopback: gloo's CPU "
      "collectives would listen there"
    )
  return None


def _address(hex_address: str) -> str:
  """``/proc/net/tcp{,6}``'s ``ADDR:PORT`` (hex, 32-bit words in host order) as text."""
  addr, port = hex_address.split(":")
  raw = b"".join(
    bytes.fromhex(addr[i : i + 8])[:: 1 if sys.byteorder == "big" else -1]
    for i in range(0, len(addr), 8)
  )
  host = ipaddress.ip_address(raw)
  if isinstance(host, ipaddress.IPv6Address) and host.ipv4_mapped is not None:
    host = host.ipv4_mapped
  return f"{host}:{int(port, 16)}" if host.version == 4 else f"[{host}]:{int(port, 16)}"


def listening_addresses() -> list[str]:
  """The local addresses of the TCP sockets that this process listens on (Linux ``/proc``).

  ``/proc/self/net/tcp{,6}`` list every socket of the network namespace; this
  process's are those whose inode one of its file descriptors points to.
  """
  inodes = set()
  for fd in os.listdir("/proc/self/fd"):
    try:
      target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # closed meanwhile
      continue
    if target.startswith("socket:["):
      inodes.add(target[len("socket:[") : -1])
  found = []
  for table in ("tcp", "tcp6"):
    path = Path("/proc/self/net") / table
    if not path.exists():
      continue
    for line in path.read_text().splitlines()[1:]:
      fields = line.split()
      if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
        found.append(_address(fields[1]))
  return sorted(found)


def is_loopback(address: str) -> bool:
  return ipaddress.ip_address(address.rsplit(":", 1)[0].strip("[]")).is_loopback


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description="one process of the multi-process tests")
  p.add_argument("--process-id", type=int, required=True)
  p.add_argument("--num-processes", type=int, default=NUM_PROCESSES)
  p.add_argument("--port", type=int, required=True)
  p.add_argument("--out", type=Path, required=True)
  p.add_argument("--deadline", type=float, default=90.0, help="exit after this many seconds")
  args = p.parse_args(argv)
  # Never outlive the test: dump the stacks and exit, even if the parent is gone.
  faulthandler.dump_traceback_later(args.deadline, exit=True)
  problem = loopback_hostname_problem()
  if problem:
    print(f"refusing to start: {problem}", file=sys.stderr)
    return 3
  assert args.num_processes == NUM_PROCESSES
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_numpy_rank_promotion", "raise")
  address = f"127.0.0.1:{args.port}"
  jax.distributed.initialize(
    coordinator_address=address,
    coordinator_bind_address=address,  # the default binds every interface
    num_processes=args.num_processes,
    process_id=args.process_id,
    initialization_timeout=30,
    heartbeat_timeout_seconds=30,
  )
  try:
    m = checkerboard_mesh()
    out = {
      "mesh_processes": np.vectorize(lambda d: d.process_index)(m.devices),
      "devices": np.array([jax.process_count(), jax.local_device_count(), jax.device_count()]),
    }
    for version in VERSIONS:
      start = time.perf_counter()
      for key, value in train(version, m).items():
        out[f"{version}.{key}"] = value
      print(f"process {args.process_id}: {version} in {time.perf_counter() - start:.2f} s")
    out.update(metric_values(m))
    listening = listening_addresses()
    out["listening"] = np.array(listening, dtype=str)
    np.savez(args.out / f"process_{args.process_id}.npz", **out)
    public = [a for a in listening if not is_loopback(a)]
    if public:
      print(f"process {args.process_id} listens on non-loopback {public}", file=sys.stderr)
      return 4
  finally:
    jax.distributed.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main())
