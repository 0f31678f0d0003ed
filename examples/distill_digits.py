"""Knowledge distillation on scikit-learn's digits with a kldiv_jax loss.

Trains a teacher MLP on the 8x8 digits (shipped with scikit-learn: no
download), then two students of the same small size inside jitted Optax train
steps: one on the labels only, one distilled from the teacher (Hinton et al.,
2015) with

    alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T))
        + (1 - alpha) * cross_entropy(student, labels)

which is ``kldiv_jax.distillation_loss`` (one call, from the logits). One
distilled student is trained per temperature (``--temperatures``, default
1, 2 and 4) to show its effect. Prints a table of parameters, test accuracy
and test KL(teacher || model), and saves the loss curves as a PNG.

Run:  python examples/distill_digits.py [--epochs 60 --temperatures 1,2,4 --alpha 0.9]
"""

import argparse
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import kldiv_jax

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after choosing the backend

Params = list[tuple[jax.Array, jax.Array]]

TEACHER_SIZES = (64, 256, 256, 10)
STUDENT_SIZES = (64, 16, 10)
BATCH_SIZE = 64
DEFAULT_OUT = Path(__file__).resolve().parent / "output" / "distill_digits.png"


# --- model -------------------------------------------------------------------


def init_mlp(key: jax.Array, sizes: Sequence[int]) -> Params:
  """He-normal weights and zero biases for a ReLU MLP with layer ``sizes``."""
  keys = jax.random.split(key, len(sizes) - 1)
  init = jax.nn.initializers.he_normal()
  return [
    (init(k, (n_in, n_out), jnp.float32), jnp.zeros((n_out,), jnp.float32))
    for k, n_in, n_out in zip(keys, sizes[:-1], sizes[1:])
  ]


def mlp(params: Params, x: jax.Array) -> jax.Array:
  """Logits ``[batch, 10]`` of a ReLU MLP."""
  *hidden, (w_out, b_out) = params
  for w, b in hidden:
    x = jax.nn.relu(x @ w + b)
  return x @ w_out + b_out


def num_params(params: Params) -> int:
  return sum(leaf.size for leaf in jax.tree.leaves(params))


# --- losses ------------------------------------------------------------------


def label_loss(logits: jax.Array, teacher_logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Cross-entropy with the labels only (``teacher_logits`` unused)."""
  del teacher_logits
  return optax.losses.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def kl_from_teacher(logits: jax.Array, teacher_logits: jax.Array) -> jax.Array:
  """Mean over examples of KL(softmax(teacher) || softmax(model)), at T = 1."""
  return kldiv_jax.kl_divergence_with_log_targets(
    jax.nn.log_softmax(logits), jax.nn.log_softmax(teacher_logits)
  ).mean()


# --- training ----------------------------------------------------------------

Objective = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def make_epoch(objective: Objective, optimizer: optax.GradientTransformation):
  """A jitted function running one epoch of minibatch steps with ``lax.scan``."""

  def loss_of_params(params, x, teacher_logits, labels):
    return objective(mlp(params, x), teacher_logits, labels)

  def step(carry, batch):
    params, opt_state = carry
    x, teacher_logits, labels = batch
    loss, grads = jax.value_and_grad(loss_of_params)(params, x, teacher_logits, labels)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  @jax.jit
  def epoch(params, opt_state, key, x, teacher_logits, labels):
    n_steps = x.shape[0] // BATCH_SIZE
    perm = jax.random.permutation(key, x.shape[0])[: n_steps * BATCH_SIZE]
    idx = perm.reshape(n_steps, BATCH_SIZE)
    batches = (x[idx], teacher_logits[idx], labels[idx])
    (params, opt_state), losses = jax.lax.scan(step, (params, opt_state), batches)
    return params, opt_state, losses.mean()

  return epoch


@jax.jit
def evaluate(params: Params, x: jax.Array, labels: jax.Array, teacher_logits: jax.Array):
  """Test cross-entropy, accuracy and KL(teacher || model)."""
  logits = mlp(params, x)
  ce = optax.losses.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  accuracy = jnp.mean(jnp.argmax(logits, axis=-1) == labels)
  return ce, accuracy, kl_from_teacher(logits, teacher_logits)


def train(
  name: str,
  sizes: Sequence[int],
  objective: Objective,
  data: dict[str, jax.Array],
  *,
  epochs: int,
  learning_rate: float,
  key: jax.Array,
) -> tuple[Params, dict[str, list[float]]]:
  """Trains an MLP of ``sizes`` on ``objective``; returns it and its curves."""
  init_key, key = jax.random.split(key)
  params = init_mlp(init_key, sizes)
  optimizer = optax.adam(learning_rate)
  opt_state = optimizer.init(params)
  epoch = make_epoch(objective, optimizer)
  history: dict[str, list[float]] = {"train_loss": [], "test_ce": [], "test_kl": []}
  epoch_keys = jax.random.split(key, epochs)
  bar = tqdm(range(epochs), desc=f"{name:<19}", unit="epoch", ncols=90)
  for i in bar:
    params, opt_state, loss = epoch(
      params, opt_state, epoch_keys[i], data["x_train"], data["teacher_train"], data["y_train"]
    )
    ce, accuracy, kl = evaluate(params, data["x_test"], data["y_test"], data["teacher_test"])
    history["train_loss"].append(float(loss))
    history["test_ce"].append(float(ce))
    history["test_kl"].append(float(kl))
    bar.set_postfix(loss=f"{float(loss):.3f}", test_acc=f"{float(accuracy):.3f}")
  bar.close()
  return params, history


# --- main --------------------------------------------------------------------


def load_data(seed: int) -> dict[str, jax.Array]:
  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  x_train, x_test, y_train, y_test = train_test_split(
    x, digits.target, test_size=0.3, random_state=seed, stratify=digits.target
  )
  return {
    "x_train": jnp.asarray(x_train),
    "x_test": jnp.asarray(x_test),
    "y_train": jnp.asarray(y_train, jnp.int32),
    "y_test": jnp.asarray(y_test, jnp.int32),
  }


def plot(histories: dict[str, dict[str, list[float]]], out: Path) -> None:
  fig, axes = plt.subplots(1, 3, figsize=(14, 4), constrained_layout=True)
  titles = {
    "train_loss": "training objective",
    "test_ce": "test cross-entropy",
    "test_kl": "test KL(teacher ‖ model)",
  }
  colors = {name: f"C{i}" for i, name in enumerate(histories)}
  for ax, (key, title) in zip(axes, titles.items()):
    for name, history in histories.items():
      if key == "test_kl" and name == "teacher":
        continue  # KL(teacher || teacher) = 0 has no place on a log scale
      epochs = np.arange(1, len(history[key]) + 1)
      ax.plot(epochs, history[key], label=name, color=colors[name])
    ax.set_title(title)
    ax.set_xlabel("epoch")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=110)
  plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=int, default=60, help="student epochs (default 60)")
  parser.add_argument("--teacher-epochs", type=int, default=20, help="teacher epochs (default 20)")
  parser.add_argument(
    "--temperatures",
    type=str,
    default="1,2,4",
    help="comma-separated softmax temperatures T, one distilled student each",
  )
  parser.add_argument("--alpha", type=float, default=0.9, help="weight of the KL term in [0, 1]")
  parser.add_argument("--seed", type=int, default=0, help="seed of the split, inits and batches")
  parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="path of the PNG plot")
  args = parser.parse_args(argv)
  try:
    temperatures = [float(t) for t in args.temperatures.split(",")]
  except ValueError:
    parser.error(f"--temperatures must be numbers separated by commas; got {args.temperatures!r}")
  if not temperatures or min(temperatures) <= 0:
    parser.error(f"--temperatures must be positive; got {args.temperatures!r}")
  if not 0.0 <= args.alpha <= 1.0:
    parser.error(f"--alpha must be in [0, 1]; got {args.alpha}")

  start = time.perf_counter()
  data = load_data(args.seed)
  n_train, n_test = data["x_train"].shape[0], data["x_test"].shape[0]
  print(
    f"digits: {n_train} train / {n_test} test images, teacher {TEACHER_SIZES}, "
    f"students {STUDENT_SIZES}, T={','.join(f'{t:g}' for t in temperatures)}, "
    f"alpha={args.alpha:g}, "
    f"seed={args.seed}, {jax.default_backend()}"
  )
  # Both students share one key: same initial weights and batch order, so the
  # loss is the only difference between them.
  key_teacher, key_student = jax.random.split(jax.random.key(args.seed))
  # The teacher stops early (20 epochs): trained to zero training loss, its
  # softened outputs on the training images become near one-hot and carry
  # little beyond the labels. Its own "teacher logits" are unused by
  # label_loss: zeros of the right shape.
  data["teacher_train"] = jnp.zeros((n_train, 10), jnp.float32)
  data["teacher_test"] = jnp.zeros((n_test, 10), jnp.float32)
  teacher, teacher_hist = train(
    "teacher",
    TEACHER_SIZES,
    label_loss,
    data,
    epochs=args.teacher_epochs,
    learning_rate=1e-3,
    key=key_teacher,
  )
  data["teacher_train"] = mlp(teacher, data["x_train"])
  data["teacher_test"] = mlp(teacher, data["x_test"])
  teacher_hist["test_kl"] = [0.0] * args.teacher_epochs

  def distill(temperature: float) -> Objective:
    def objective(student_logits, teacher_logits, labels):
      # alpha T^2 KL(teacher_T || student_T) + (1 - alpha) CE, mean over the batch.
      return kldiv_jax.distillation_loss(
        student_logits, teacher_logits, labels, temperature=temperature, alpha=args.alpha
      )

    return objective

  students = {}
  histories = {"teacher": teacher_hist}
  runs = [("student (labels)", label_loss)]
  runs += [(f"student (KD, T={t:g})", distill(t)) for t in temperatures]
  for name, objective in runs:
    students[name], histories[name] = train(
      name,
      STUDENT_SIZES,
      objective,
      data,
      epochs=args.epochs,
      learning_rate=1e-2,
      key=key_student,
    )
  plot(histories, args.out)

  results = {}
  print()
  print(f"{'model':<20} {'params':>7} {'test acc':>9} {'test KL(teacher‖model)':>23}")
  for name, params in {"teacher": teacher, **students}.items():
    _, accuracy, kl = evaluate(params, data["x_test"], data["y_test"], data["teacher_test"])
    results[name] = {"params": num_params(params), "accuracy": float(accuracy), "kl": float(kl)}
    print(f"{name:<20} {num_params(params):>7,} {float(accuracy):>9.2%} {float(kl):>23.4f}")
  print(f"\nplot: {args.out}   time: {time.perf_counter() - start:.1f} s")
  return results


if __name__ == "__main__":
  main()
