"""LM-style distillation on one (data, vocab) mesh spanning several processes.

The multi-process version of ``sharded_distillation.py``: a tiny student
language model (token embedding, one dense layer, an LM head ``[H, V]``)
learns to match a frozen random teacher with ``optax.adam`` inside jitted
train steps, on a mesh of every device of every process, ``("data",
"vocab")`` = (processes, devices per process): the batch split over all of
them, the LM heads over the devices of one process. Three versions of the
same loss, from the same parameters and data:

* ``materialised``: ``kldiv_jax.distillation_loss`` on the whole batch's
  ``[tokens, V]`` logits, partitioned by XLA from the ``NamedSharding`` of the
  inputs (batch over every device);
* ``fused (data)``: ``kldiv_jax.fused_distillation_loss`` in ``jax.shard_map``,
  the tokens over every device, the logits made a chunk at a time;
* ``fused (data x vocab)``: the tokens over ``data``, both LM heads over
  ``vocab`` (``axis_name="vocab"``), the global token count as ``normalizer``
  and a ``psum`` over ``data``.

Process 0 prints the losses per step (the three agree), the time per step and
the per-device memory of each compiled train step (XLA's memory analysis).

Run it three ways:

* ``python examples/multihost_distillation.py``: starts 2 processes on this
  machine (``--local-processes``), each with 4 CPU devices
  (``--cpu-devices``), joined by ``jax.distributed`` over loopback (gloo CPU
  collectives), and waits for them (``--timeout``);
* ``... --coordinator HOST:PORT --num-processes N --process-id I`` on each of
  N hosts: one process of a job you start yourself (add ``--cpu-devices D``
  for CPU hosts);
* ``... --cluster`` (or no flag under ``srun``/``mpirun``):
  ``jax.distributed.initialize()`` finds the job on a TPU pod slice, SLURM,
  Open MPI or Kubernetes (``--local-device-ids 0,1,2,3`` for one process per
  host under SLURM, whose detection gives each task one GPU).

See docs/beyond-one-machine.md.
"""

import argparse
import faulthandler
import ipaddress
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import kldiv_jax

Params = dict[str, jax.Array]
VERSIONS = ("materialised", "fused (data)", "fused (data x vocab)")


# -- the model ----------------------------------------------------------------------------------


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
    "head": jax.random.normal(k2, (hidden, vocab)) * (3.0 / np.sqrt(hidden)),
  }


def student_hidden(params: Params, tokens: jax.Array) -> jax.Array:
  """``[batch, seq]`` token ids to ``[batch, seq, hidden]`` hidden states."""
  x = jnp.take(params["embed"], tokens, axis=0)
  return jnp.tanh(x @ params["dense"] + params["dense_bias"][None, None, :])


def teacher_hidden(teacher: Params, tokens: jax.Array) -> jax.Array:
  return jax.lax.stop_gradient(jnp.tanh(jnp.take(teacher["embed"], tokens, axis=0)))


def sequences(key: jax.Array, rows: range, seq: int, vocab: int) -> np.ndarray:
  """Rows ``rows`` of a batch of Zipf-distributed token ids (one key per row).

  A process makes (or loads) only the rows its devices hold.
  """
  zipf = -1.1 * jnp.log(jnp.arange(1, vocab + 1.0))
  keys = jnp.stack([jax.random.fold_in(key, r) for r in rows])
  return np.asarray(jax.vmap(lambda k: jax.random.categorical(k, zipf, shape=(seq,)))(keys))


# -- the three versions of the loss ---------------------------------------------------------------


def make_losses(mesh: jax.sharding.Mesh, temperature: float) -> dict[str, Callable[..., Any]]:
  """``loss(params, teacher, tokens)`` per version."""
  flat = Mesh(mesh.devices.reshape(-1), ("devices",), axis_types=(jax.sharding.AxisType.Auto,))

  def materialised(params, teacher, tokens):
    logits = student_hidden(params, tokens) @ params["head"]
    target = teacher_hidden(teacher, tokens) @ teacher["head"]
    return kldiv_jax.distillation_loss(logits, target, temperature=temperature)

  def fused_over(on, token_axes, vocab_axis):
    head_spec, token_spec = P(None, vocab_axis), P(token_axes, None, None)

    def local(h, w, th, tw, count):
      # This device's tokens (and vocabulary slice); the global token count as
      # normalizer, so that the psum over the token axes is the mean.
      loss = kldiv_jax.fused_distillation_loss(
        h, w, th, tw, temperature=temperature, normalizer=count, axis_name=vocab_axis
      )
      return jax.lax.psum(loss, token_axes)

    sharded = jax.shard_map(
      local,
      mesh=on,
      in_specs=(token_spec, head_spec, token_spec, head_spec, P()),
      out_specs=P(),
    )

    def loss(params, teacher, tokens):
      count = jnp.asarray(tokens.size, jnp.float32)  # global: tokens is the global batch
      th = teacher_hidden(teacher, tokens)
      return sharded(student_hidden(params, tokens), params["head"], th, teacher["head"], count)

    return loss

  return {
    "materialised": materialised,
    # The tokens over every device: the same devices as one mesh axis. (Over
    # ("data", "vocab"), jax 0.7 lowers the gradient's psum with the devices in
    # another order than the loss's, and gloo's CPU collectives may then hang;
    # jax 0.10 does not. Remove the flat mesh once the floor is past 0.7.)
    "fused (data)": fused_over(flat, "devices", None),
    "fused (data x vocab)": fused_over(mesh, "data", "vocab"),
  }


def specs(name: str) -> tuple[dict[str, P], dict[str, P], P]:
  """Where a version keeps the student's and the teacher's parameters, and the batch."""
  head = P(None, "vocab") if name == "fused (data x vocab)" else P()
  batch = P("data", None) if name == "fused (data x vocab)" else P(("data", "vocab"), None)
  student = {"embed": P(), "dense": P(), "dense_bias": P(), "head": head}
  return student, {"embed": P(), "head": head}, batch


def memory(compiled) -> dict[str, int]:
  stats = compiled.memory_analysis()
  return {
    "arguments": int(stats.argument_size_in_bytes),
    "outputs": int(stats.output_size_in_bytes),
    "temporaries": int(stats.temp_size_in_bytes),
  }


def mib(n: int) -> str:
  return f"{n / 2**20:8.2f} MiB"


# -- one process's part of the job ----------------------------------------------------------------


def train(args: argparse.Namespace) -> dict[str, Any]:
  """The three versions' train steps on the mesh of every device of every process."""
  processes, local = jax.process_count(), jax.local_device_count()
  if args.batch % jax.device_count() or args.vocab % local:
    raise SystemExit(
      f"multihost_distillation: --batch must be a multiple of {jax.device_count()} (devices) "
      f"and --vocab of {local} (devices per process)"
    )
  # One row of the mesh per process: "vocab" inside a process (its collectives
  # run per token), "data" across processes (one psum of the gradients per step).
  devices = mesh_utils.create_hybrid_device_mesh(
    (1, local), (processes, 1), process_is_granule=True
  )
  mesh = Mesh(devices, ("data", "vocab"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  leader = jax.process_index() == 0
  say = print if leader else (lambda *a, **k: None)
  say(
    f"mesh {dict(mesh.shape)}: {processes} process(es) x {local} {jax.devices()[0].platform} "
    f"device(s), process index of each device {devices_of(mesh)}; batch {args.batch}x{args.seq} "
    f"tokens, vocab {args.vocab}, hidden {args.hidden}, T={args.temperature}"
  )
  k_student, k_teacher, k_data = jax.random.split(jax.random.key(args.seed), 3)
  step_keys = jax.random.split(k_data, args.steps)
  optimizer = optax.adam(args.learning_rate)
  replicated = NamedSharding(mesh, P())

  results: dict[str, Any] = {}
  for name, loss_fn in make_losses(mesh, args.temperature).items():
    student_spec, teacher_spec, batch_spec = specs(name)
    shard = lambda tree: jax.tree.map(lambda s: NamedSharding(mesh, s), tree)  # noqa: E731
    p_sh, t_sh, batch_sh = shard(student_spec), shard(teacher_spec), NamedSharding(mesh, batch_spec)
    # Every device makes its own shard of the parameters (no host copy of the whole).
    params = jax.jit(init_student, static_argnums=(1, 2, 3), out_shardings=p_sh)(
      k_student, args.vocab, args.embed, args.hidden
    )
    teacher = jax.jit(init_teacher, static_argnums=(1, 2), out_shardings=t_sh)(
      k_teacher, args.vocab, args.hidden
    )
    # The optimizer state sharded like the parameters it mirrors.
    o_sh = optax.tree_utils.tree_map_params(
      optimizer,
      lambda _, s: s,
      jax.eval_shape(optimizer.init, params),
      p_sh,
      transform_non_params=lambda _: replicated,
    )
    opt_state = jax.jit(optimizer.init, out_shardings=o_sh)(params)
    # Each process feeds only the rows of the batch its devices hold.
    rows = local_rows(batch_sh, args.batch)
    batches = [
      jax.make_array_from_process_local_data(
        batch_sh, sequences(k, rows, args.seq, args.vocab), (args.batch, args.seq)
      )
      for k in step_keys
    ]

    def step(params, opt_state, teacher, tokens, loss_fn=loss_fn):
      loss, grads = jax.value_and_grad(loss_fn)(params, teacher, tokens)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    jitted = jax.jit(step, out_shardings=(p_sh, o_sh, replicated), donate_argnums=(0, 1))
    compiled = jitted.lower(params, opt_state, teacher, batches[0]).compile()
    losses, start = [], time.perf_counter()
    for tokens in batches:
      params, opt_state, loss = compiled(params, opt_state, teacher, tokens)
      losses.append(float(loss))  # replicated: every process holds the value
    seconds = (time.perf_counter() - start) / args.steps
    results[name] = {"losses": losses, "memory": memory(compiled), "seconds_per_step": seconds}
    say(
      f"\n{name}: loss per step "
      + " ".join(f"{x:.6f}" for x in losses)
      + f"  ({1e3 * seconds:.1f} ms per step)"
    )

  say("\nper-device memory of the compiled train step (XLA memory analysis):")
  say(f"  {'version':22} {'arguments':>12} {'outputs':>12} {'temporaries':>12}")
  for name, r in results.items():
    m = r["memory"]
    say(f"  {name:22} {mib(m['arguments'])} {mib(m['outputs'])} {mib(m['temporaries'])}")
  say(
    f"  (one side's float32 logits for the whole batch: {mib(args.batch * args.seq * args.vocab * 4).strip()})"
  )
  return results


def devices_of(mesh: Mesh) -> list[list[int]]:
  return [[d.process_index for d in row] for row in mesh.devices]


def local_rows(sharding: NamedSharding, num_rows: int) -> range:
  """The rows of a ``[num_rows, ...]`` batch that this process's devices hold."""
  slices = [i[0] for i in sharding.addressable_devices_indices_map((num_rows, 1)).values()]
  return range(min(s.start or 0 for s in slices), max(s.stop or num_rows for s in slices))


def single_device_losses(args: argparse.Namespace) -> list[float]:
  """The same train steps on one device (no mesh): the losses every version should print."""
  k_student, k_teacher, k_data = jax.random.split(jax.random.key(args.seed), 3)
  params = jax.jit(init_student, static_argnums=(1, 2, 3))(
    k_student, args.vocab, args.embed, args.hidden
  )
  teacher = jax.jit(init_teacher, static_argnums=(1, 2))(k_teacher, args.vocab, args.hidden)
  optimizer = optax.adam(args.learning_rate)
  opt_state = optimizer.init(params)

  @jax.jit
  def step(params, opt_state, tokens):
    logits_of = lambda p: student_hidden(p, tokens) @ p["head"]  # noqa: E731
    target = teacher_hidden(teacher, tokens) @ teacher["head"]
    loss, grads = jax.value_and_grad(
      lambda p: kldiv_jax.distillation_loss(logits_of(p), target, temperature=args.temperature)
    )(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for k in jax.random.split(k_data, args.steps):
    tokens = sequences(k, range(args.batch), args.seq, args.vocab)
    params, opt_state, loss = step(params, opt_state, tokens)
    losses.append(float(loss))
  return losses


# -- starting the job -------------------------------------------------------------------------


def loopback_problem() -> str | None:
  """Why gloo's CPU collectives would not stay on loopback here, or ``None``.

  Gloo listens on the address the host name resolves to (JAX has no option
  for its interface), so local processes stay on loopback only where the host
  name resolves to loopback addresses (e.g. ``127.0.1.1 myhost`` in
  ``/etc/hosts``).
  """
  name = socket.gethostname()
  try:
    addresses = {info[4][0] for info in socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)}
  except OSError as err:
    return f"the host name {name!r} does not resolve ({err})"
  public = sorted(a for a in addresses if not ipaddress.ip_address(a.split("%")[0]).is_loopback)
  return f"the host name {name!r} resolves to {', '.join(public)}" if public else None


def is_loopback(host: str) -> bool:
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:  # a host name
    return False


def mute_native_stdout() -> None:
  """Keeps Python's output but sends the native libraries' stdout to ``/dev/null``.

  Gloo prints a ``[Gloo] Rank ... is connected to ... peer ranks`` line per
  connection to C++'s ``std::cout`` (file descriptor 1), in the middle of the
  report's lines; errors go to stderr, which is kept.
  """
  sys.stdout.flush()
  python_stdout = os.dup(1)
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 1)
  os.close(devnull)
  sys.stdout = os.fdopen(python_stdout, "w", buffering=1)


def launch(args: argparse.Namespace, argv: Sequence[str]) -> int:
  """Starts ``--local-processes`` copies of this script on loopback and waits for them."""
  problem = loopback_problem()
  if problem:
    raise SystemExit(
      f"multihost_distillation: not starting local processes: {problem}, and gloo would "
      "listen there. Start the processes yourself (--coordinator/--num-processes/--process-id)."
    )
  with socket.socket() as s:  # a free port for the coordinator
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  n = args.local_processes
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  # Each process sets its own device count (--cpu-devices); drop one forced here.
  flags = env.get("XLA_FLAGS", "").split()
  env["XLA_FLAGS"] = " ".join(f for f in flags if "xla_force_host_platform_device_count" not in f)
  common = [sys.executable, os.path.abspath(__file__), *argv]
  common += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n)]
  # The processes give up first, with their stacks on stderr; then this waits no longer.
  deadline = max(args.timeout - 5, 0.8 * args.timeout)
  common += ["--cpu-devices", str(args.cpu_devices or 4), "--deadline", str(deadline)]
  procs, logs = [], []
  start = time.perf_counter()
  try:
    for i in range(n):
      # Process 0 writes here; the others to files, shown if something fails.
      log = None if i == 0 else tempfile.TemporaryFile("w+")
      logs.append(log)
      procs.append(
        subprocess.Popen([*common, "--process-id", str(i)], env=env, stdout=log, stderr=log)
      )
    while any(p.poll() is None for p in procs):
      if any(p.returncode for p in procs) or time.perf_counter() - start > args.timeout:
        break
      time.sleep(0.05)
  finally:
    for p in procs:  # on an error, a timeout or Ctrl-C: stop the others
      if p.poll() is None:
        p.kill()
        p.wait()
  codes = [p.returncode for p in procs]
  if any(codes):
    for i, log in enumerate(logs):
      if log is not None:
        log.seek(0)
        print(f"--- process {i} (exit {codes[i]}):\n{log.read()[-3000:]}", file=sys.stderr)
    print(f"multihost_distillation: exit codes {codes}", file=sys.stderr)
    return 1
  print(
    f"\n{n} processes, {time.perf_counter() - start:.1f} s in all (start-up and compiling included)"
  )
  return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=8)
  p.add_argument("--batch", type=int, default=8, help="sequences per step (global)")
  p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
  p.add_argument("--vocab", type=int, default=8192)
  p.add_argument("--hidden", type=int, default=128, help="student's and teacher's hidden size")
  p.add_argument("--embed", type=int, default=64)
  p.add_argument("--temperature", type=float, default=2.0)
  p.add_argument("--learning-rate", type=float, default=3e-2)
  p.add_argument("--seed", type=int, default=0)
  job = p.add_argument_group("the job")
  job.add_argument("--local-processes", type=int, default=2, help="processes to start here")
  job.add_argument("--timeout", type=float, default=300.0, help="seconds before giving up")
  job.add_argument("--coordinator", help="HOST:PORT of process 0: run one process of a job")
  job.add_argument("--num-processes", type=int)
  job.add_argument("--process-id", type=int)
  job.add_argument(
    "--cpu-devices", type=int, help="CPU devices per process: a CPU job (gloo); default 4 locally"
  )
  job.add_argument(
    "--cluster", action="store_true", help="jax.distributed.initialize() finds the job"
  )
  job.add_argument(
    "--local-device-ids",
    type=lambda text: [int(i) for i in text.split(",")],
    help="this process's devices, e.g. 0,1,2,3 (SLURM's detection gives each task one GPU)",
  )
  job.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
  return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  # A task of srun or mpirun: the job is theirs.
  under_launcher = "SLURM_PROCID" in os.environ or "OMPI_COMM_WORLD_SIZE" in os.environ
  if args.cluster or (under_launcher and args.coordinator is None):
    # TPU pod slices, SLURM, Open MPI, Kubernetes: the job found from the environment.
    jax.distributed.initialize(local_device_ids=args.local_device_ids)
  elif args.coordinator is not None:
    if args.deadline:  # started by launch(): never outlive it
      faulthandler.dump_traceback_later(args.deadline, exit=True)
      mute_native_stdout()
    on_loopback = is_loopback(args.coordinator.rsplit(":", 1)[0].strip("[]"))
    if args.cpu_devices is not None:
      jax.config.update("jax_platforms", "cpu")
      jax.config.update("jax_num_cpu_devices", args.cpu_devices)
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
      coordinator_address=args.coordinator,
      num_processes=args.num_processes,
      process_id=args.process_id,
      local_device_ids=args.local_device_ids,
      # Loopback coordinator: listen there only (the default is every interface).
      coordinator_bind_address=args.coordinator if on_loopback else None,
      initialization_timeout=60 if on_loopback else 300,
    )
  else:
    return launch(args, argv)
  try:
    train(args)
  finally:
    jax.distributed.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main())
