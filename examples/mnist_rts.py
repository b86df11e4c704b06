"""MNIST with replication and RTS: a two-layer network trained data parallel by popdist_py.engine's Trainer.

One process with 4 replicas, or the same 4 replicas as 2 instances under poprun (same weights):

    python examples/mnist_rts.py --replication-factor 4
    poprun --num-instances 2 --num-replicas 4 python examples/mnist_rts.py --shard weights

Without ``--data-dir`` it trains on scikit-learn's bundled 8x8 handwritten digits; with it, on the
real MNIST IDX files in that directory (plain or ``.gz``; nothing is downloaded).

Each replica runs the forward and backward pass in numpy on micro-batches of ``--batch-size``
samples; the engine's Trainer accumulates ``--accumulation`` of them, averages the gradients over
all replicas and applies ``--optimizer``. ``--shard`` and ``--offchip`` say which classes of
tensors are sharded over the replicas (replicated tensor sharding) or kept off chip; none of
them changes a bit of the weights. ``--rts`` is ``--shard weights``.

The last line of stdout, printed by every instance (they agree), is
``final: test_accuracy=<accuracy> weights_sha256=<sha256 of W0, b0, W1, b1 as float32>``.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import numpy as np
from mnist import checkpoint, datasets
from mnist.datasets import NUM_CLASSES, Dataset, Replicas
from mnist.idx import IdxError
from mnist.model import Params, init_params
from mnist.trainer import LEVELS, OPTIMIZERS, Network, make_optimizer, training_options
from tqdm import tqdm

import popdist_py as popdist
from popdist_py import MissingPart
from popdist_py.engine import Runtime
from popdist_py.engine.batch_invariant import check_kernels

log = logging.getLogger("mnist_rts")


class InputError(Exception):
    """Bad data, checkpoint or options: reported as one line and exit status 2, no traceback."""


class Parser(argparse.ArgumentParser):
    """argparse, but a bad option is one line (the usage of a dozen options would bury it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None: those options say in their help what happens without them."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def add_training_arguments(p: Parser, accumulation: int, accumulation_help: str) -> None:
    """The flags both MNIST examples take: replicas, batches, epochs, optimizer, model, data."""
    p.add_argument("--replication-factor", type=int, default=None,
                   help="replicas in this process (default 1); under poprun the job's replicas are used instead")
    p.add_argument("--batch-size", type=int, default=8, help="samples per replica per micro-batch")
    p.add_argument("--accumulation", type=int, default=accumulation, help=accumulation_help)
    p.add_argument("--test-batch-size", type=int, default=32, help="test samples per replica per step")
    p.add_argument("--epochs", type=int, default=10,
                   help="epochs to train in all (with --checkpoint: counting those already trained)")
    p.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="sgd",
                   help="sgd, momentum (SGD with momentum 0.9), adam or lamb")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate (default: the optimizer's, "
                   + ", ".join(f"{n} {lr:g}" for n, (_, lr) in OPTIMIZERS.items()) + ")")
    p.add_argument("--hidden-size", type=int, default=64, help="units in the hidden layer")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and each epoch's shuffle")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="directory with the MNIST IDX files (default: scikit-learn's bundled 8x8 digits)")


def check_training_arguments(p: Parser, args: argparse.Namespace, *counts: str) -> None:
    """One usage error for a count below its minimum (``counts``: more flags that must be >= 1) or a bad --lr."""
    for name, minimum in (("replication_factor", 1), ("batch_size", 1), ("accumulation", 1),
                          ("test_batch_size", 1), ("epochs", 0), ("hidden_size", 1), ("seed", 0),
                          *((c, 1) for c in counts)):
        value = getattr(args, name)
        if value is not None and value < minimum:
            p.error(f"--{name.replace('_', '-')}={value} is invalid: it must be >= {minimum}")
    if args.lr is not None and not (args.lr > 0 and math.isfinite(args.lr)):
        p.error(f"--lr={args.lr} is invalid: it must be a finite number > 0")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    add_training_arguments(p, 1, "micro-batches accumulated per replica before each weight update")
    p.add_argument("--shard", choices=LEVELS, default=None,
                   help="replicated tensor sharding: the optimizer state, or the weights and their state "
                        "(default: none)")
    p.add_argument("--offchip", choices=LEVELS, default="none",
                   help="off chip (memory-mapped, read ahead): the optimizer state, or the weights and their state")
    p.add_argument("--rts", action="store_true", help="the same as --shard weights")
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="resume from this file if it exists; save to it after every epoch")
    args = p.parse_args(argv)
    check_training_arguments(p, args)
    if args.rts and args.shard not in (None, "weights"):
        p.error(f"--rts means --shard weights; it contradicts --shard {args.shard}")
    args.shard = "weights" if args.rts else args.shard or "none"
    return args


def make_runtime(replication_factor: int | None) -> Runtime:
    """The job's replicas under poprun (the environment decides), else ``--replication-factor``."""
    if popdist.isPopdistEnvSet():
        if replication_factor is not None:
            log.warning("--replication-factor %d is ignored under poprun, which runs %d replicas "
                        "(--num-replicas)", replication_factor, popdist.getNumTotalReplicas())
        return Runtime()
    return Runtime(replication=replication_factor or 1)


def digest(params: Params) -> str:
    """SHA-256 of W0, b0, W1, b1 in that order, as float32 C-contiguous bytes."""
    h = hashlib.sha256()
    for array in params:
        h.update(np.ascontiguousarray(array, np.float32).tobytes())
    return h.hexdigest()


def checkpoint_exists(path: Path) -> bool:
    """Whether instance 0 sees ``path`` (it alone reads it), the same answer on every instance."""
    if popdist.getNumInstances() == 1:
        return path.exists()
    return bool(popdist.broadcast(np.array([path.exists()], np.int8), root=0)[0])


def train(net: Network, data: Dataset, args: argparse.Namespace, replicas: Replicas, first_epoch: int,
          meta: dict[str, object]) -> None:
    """Epochs ``first_epoch .. args.epochs - 1``; a checkpoint after each one when asked for."""
    instance0 = popdist.getInstanceIndex() == 0
    steps = datasets.steps_per_epoch(len(data.train_x), args.batch_size, replicas, args.accumulation)
    global_batch = args.batch_size * args.accumulation * replicas.total
    for epoch in range(first_epoch, args.epochs):
        batches = datasets.train_batches(data.train_x, data.train_y, args.batch_size, replicas,
                                         seed=args.seed, epoch=epoch, accumulation=args.accumulation)
        bar = tqdm(batches, total=steps, desc=f"epoch {epoch + 1}/{args.epochs}", unit="step",
                   disable=not (instance0 and sys.stderr.isatty()), leave=False)
        start, losses = time.perf_counter(), []
        for x, y in bar:
            losses.append(net.train_step(x, y))
            rate = len(losses) * global_batch / (time.perf_counter() - start)
            bar.set_postfix(loss=f"{losses[-1]:.4f}", samples_s=f"{rate:.0f}", refresh=False)
        bar.close()
        elapsed = time.perf_counter() - start
        log.info("epoch %d/%d: mean loss %.4f, %.0f samples/s", epoch + 1, args.epochs,
                 float(np.mean(losses)), steps * global_batch / elapsed)
        if args.checkpoint is not None:
            checkpoint.save(net.trainer, args.checkpoint, epoch + 1, meta)  # collective: instance 0 writes
            log.info("saved %s (%d epochs)", args.checkpoint, epoch + 1)


def evaluate(net: Network, data: Dataset, batch_size: int, replicas: Replicas) -> float:
    """Accuracy over the whole test set, evaluated data parallel on all replicas."""
    weights = net.host_params()
    right = 0
    for x, y, mask in datasets.eval_batches(data.test_x, data.test_y, batch_size, replicas):
        right += net.evaluate_batch(weights, x, y, mask)
    return right / len(data.test_x)


def load_data(data_dir: str | None) -> Dataset:
    """The dataset (``--data-dir``, else the bundled digits); an unreadable one is an InputError."""
    try:
        return datasets.load(data_dir)
    except (FileNotFoundError, IdxError) as exc:
        raise InputError(exc) from None


def place(rt: Runtime, data: Dataset, args: argparse.Namespace) -> tuple[Replicas, int]:
    """This runtime's replicas and the global batch, which must fit in the training set."""
    replicas = Replicas(rt.replication_factor, rt.instance_replication_factor, rt.replica_index_offset)
    global_batch = args.batch_size * args.accumulation * replicas.total
    if len(data.train_x) < global_batch:
        raise InputError(f"the global batch of {global_batch} samples (--batch-size {args.batch_size} x "
                         f"--accumulation {args.accumulation} x {replicas.total} replicas) exceeds the "
                         f"{len(data.train_x)} training samples")
    return replicas, global_batch


def run(args: argparse.Namespace) -> tuple[float, str]:
    data = load_data(args.data_dir)
    with make_runtime(args.replication_factor) as rt:
        replicas, global_batch = place(rt, data, args)
        optimizer = make_optimizer(args.optimizer, args.lr)
        log.info("%s", data.describe())
        log.info("%d replica(s) as %d instance(s) x %d; global batch %d (%d x %d micro-batch(es) of %d); "
                 "%s, lr %g; RTS %s (--shard %s), off chip: %s", replicas.total, replicas.total // replicas.local,
                 replicas.local, global_batch, replicas.total, args.accumulation, args.batch_size, args.optimizer,
                 optimizer.lr, "on" if args.shard != "none" and replicas.total > 1 else "off", args.shard,
                 args.offchip)
        params = init_params(data.input_size, args.hidden_size, NUM_CLASSES, args.seed)
        options = training_options(args.accumulation, args.shard, args.offchip)
        with Network(rt, params, optimizer, options, args.batch_size) as net:
            del params  # the trainer holds the weights now (as shards with --shard weights)
            for line in net.describe():
                log.info("  %s", line)
            first_epoch = 0
            meta = {"dataset": data.name, "seed": args.seed, "hidden_size": args.hidden_size,
                    "optimizer": args.optimizer}
            if args.checkpoint is not None and checkpoint_exists(args.checkpoint):
                try:
                    first_epoch, info = checkpoint.load(net.trainer, args.checkpoint, args.optimizer)
                except ValueError as exc:
                    raise InputError(exc) from None
                log.info("resumed from %s after %d epoch(s)", args.checkpoint, first_epoch)
                if first_epoch >= args.epochs:
                    log.info("nothing to train: the checkpoint has %d epoch(s), --epochs is %d; evaluating it",
                             first_epoch, args.epochs)
                if (info.get("dataset"), info.get("seed")) != (data.name, args.seed):
                    log.warning("%s was saved with dataset %r and --seed %s; continuing with %r and --seed %d",
                                args.checkpoint, info.get("dataset"), info.get("seed"), data.name, args.seed)
            train(net, data, args, replicas, first_epoch, meta)
            accuracy = evaluate(net, data, args.test_batch_size, replicas)
            return accuracy, digest(net.host_params())


def run_main(parse: Callable[[list[str] | None], argparse.Namespace],
             run_job: Callable[[argparse.Namespace], tuple[float, str]], argv: list[str] | None) -> int:
    """Parse, train, print the final line (or one error line and 2): the examples' shared ``main``."""
    args = parse(argv)
    instance0 = popdist.getInstanceIndex() == 0
    logging.basicConfig(level=logging.INFO if instance0 else logging.WARNING, format="%(message)s")
    start = time.perf_counter()
    try:
        check_kernels()  # the model's products: refused here in one line where they were not built
        accuracy, weights_hash = run_job(args)
    except (InputError, MissingPart) as exc:
        print(f"{Path(sys.argv[0]).name}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    log.info("done in %.1f s", time.perf_counter() - start)
    print(f"final: test_accuracy={accuracy:.4f} weights_sha256={weights_hash}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
