"""MNIST pipelined: the two-layer network of mnist_rts.py split into two stages on two devices per replica.

Stage 0, the hidden layer, runs on device 0 of each replica; stage 1, the output layer and the
loss, on device 1 (``examples/mnist/stages.py``). popdist_py.engine's Trainer feeds each replica
``--accumulation`` micro-batches per weight update; they flow through the stages in the
``--schedule`` order (1F1B or GPipe), activations forward and their gradients back between the
devices' threads, the pipeline is flushed, and the gradients are averaged over all replicas and
applied as in mnist_rts.py. ``--no-pipeline`` runs the same stages one after the other on one
device instead (``Pipeline.sequential``): bitwise the same weights, as is mnist_rts.py with the
same options. One process with 2 replicas, or 4 replicas as 2 instances under poprun::

    python examples/mnist_pipeline.py --ipus-per-replica 2 --accumulation 8 --replication-factor 2
    poprun --num-instances 2 --num-replicas 4 --ipus-per-replica 2 python examples/mnist_pipeline.py

The last line of stdout, printed by every instance (they agree), is
``final: test_accuracy=<accuracy> weights_sha256=<sha256 of W0, b0, W1, b1 as float32>``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import numpy as np
from mnist import stages
from mnist.datasets import NUM_CLASSES
from mnist.model import init_params
from mnist.trainer import Network, make_optimizer, training_options
from mnist_rts import (
    HelpFormatter,
    Parser,
    add_training_arguments,
    check_training_arguments,
    digest,
    evaluate,
    load_data,
    make_runtime,
    place,
    run_main,
    train,
)

import popdist_py as popdist
from popdist_py.engine.pipeline import ONE_F_ONE_B, SCHEDULES, Pipeline
from popdist_py.engine.pipeline.trace import Event, write_chrome_trace

log = logging.getLogger("mnist_pipeline")

#: Devices per replica without poprun and without --ipus-per-replica: one per stage.
DEFAULT_DEVICES = stages.NUM_STAGES
#: An event's kind as an integer, to gather the trace of every instance in one array.
EVENT_KINDS = ("forward", "backward", "input", "output")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    p.add_argument("--ipus-per-replica", type=int, default=None,
                   help="devices per replica; the stages go on devices 0 and 1 (default: poprun's "
                        f"--ipus-per-replica under poprun, else {DEFAULT_DEVICES})")
    add_training_arguments(p, 8, "micro-batches per replica per weight update, all in the pipeline before it is "
                                 "flushed (1: continuous pipelining, stale weights)")
    p.add_argument("--schedule", choices=SCHEDULES, default=ONE_F_ONE_B,
                   help="each device's order of forwards and backwards: 1F1B (one forward, one backward) or GPipe "
                        "(all forwards, then all backwards)")
    p.add_argument("--no-pipeline", action="store_true",
                   help="run the stages one after the other on one device (the reference: the same weights)")
    p.add_argument("--trace", type=Path, default=None,
                   help="write the last training step's timeline here as Chrome trace JSON (chrome://tracing, "
                        "ui.perfetto.dev): a process per replica, a thread per device")
    p.set_defaults(checkpoint=None)  # mnist_rts.train saves checkpoints when given one; not this example
    args = p.parse_args(argv)
    check_training_arguments(p, args, "ipus_per_replica")
    if args.trace is not None and args.no_pipeline:
        p.error("--trace records the pipeline's timeline; there is none with --no-pipeline")
    args.devices = devices_per_replica(p, args.ipus_per_replica, args.no_pipeline)
    return args


def devices_per_replica(p: Parser, flag: int | None, no_pipeline: bool) -> int:
    """``--ipus-per-replica``, which must agree with poprun's under poprun; its default is poprun's,
    else one device per stage. Too few devices for the stages is an error (not with --no-pipeline)."""
    job = popdist.getNumIpusPerReplica() if popdist.isPopdistEnvSet() else None
    if flag is not None and job is not None and flag != job:
        p.error(f"--ipus-per-replica={flag} does not match poprun's --ipus-per-replica {job}: "
                "poprun gives each replica its devices")
    devices, K = flag or job or DEFAULT_DEVICES, stages.NUM_STAGES
    if devices < K and not no_pipeline:
        if flag is not None:
            given, fix = f"--ipus-per-replica={devices}", f"give --ipus-per-replica {K} or more"
        else:
            given, fix = f"poprun's --ipus-per-replica {devices}", f"run poprun with --ipus-per-replica {K}"
        p.error(f"{given} is too few: the model's {K} pipeline stages need {K} devices per replica; {fix}, "
                "or run them on one device with --no-pipeline")
    return devices


def write_trace(pipe: Pipeline, path: Path) -> None:
    """The last training step's timeline of every replica as Chrome trace JSON. Collective: under
    poprun instance 0 gathers the others' events and writes the file; each instance's times count
    from its own first op of the step (the clocks of hosts need not agree)."""
    if popdist.getNumInstances() == 1:
        pipe.write_trace(path)
        return
    mine = [e for events in pipe.events.values() for e in events]
    origin = min((e.start_ns for e in mine), default=0)
    rows = np.array([(e.replica, e.device, EVENT_KINDS.index(e.kind), e.stage, e.micro_batch, e.start_ns - origin,
                      e.end_ns - origin) for e in mine], np.int64).reshape(-1, 7)
    counts = popdist.allgather(np.array([len(rows)], np.int64))[:, 0]
    padded = np.zeros((int(counts.max()), 7), np.int64)
    padded[:len(rows)] = rows
    every = popdist.allgather(padded)
    if popdist.getInstanceIndex() == 0:
        write_chrome_trace([Event(int(r), int(d), EVENT_KINDS[k], int(s), int(m), int(a), int(b))
                            for part, n in zip(every, counts, strict=True) for r, d, k, s, m, a, b in part[:n]], path)


def run(args: argparse.Namespace) -> tuple[float, str]:
    data = load_data(args.data_dir)
    with make_runtime(args.replication_factor) as rt:
        replicas, global_batch = place(rt, data, args)
        optimizer = make_optimizer(args.optimizer, args.lr)
        pipe = stages.pipeline(max(args.devices, stages.NUM_STAGES), args.schedule)
        log.info("%s", data.describe())
        log.info("%d replica(s) as %d instance(s) x %d; global batch %d (%d x %d micro-batch(es) of %d); %s, lr %g",
                 replicas.total, replicas.total // replicas.local, replicas.local, global_batch, replicas.total,
                 args.accumulation, args.batch_size, args.optimizer, optimizer.lr)
        if args.no_pipeline:
            log.info("no pipeline: the %d stages one after the other on one device per replica", len(pipe.stages))
        else:
            idle = f" ({args.devices - stages.NUM_STAGES} idle)" if args.devices > stages.NUM_STAGES else ""
            log.info("pipeline on %d device(s) per replica%s, %s schedule: %s", args.devices, idle, args.schedule,
                     ", ".join(f"{stage.label(s)} on device {stage.device}" for s, stage in enumerate(pipe.stages)))
        params = init_params(data.input_size, args.hidden_size, NUM_CLASSES, args.seed)
        options = training_options(args.accumulation, "none", "none")
        model = pipe.sequential if args.no_pipeline else pipe
        with Network(rt, params, optimizer, options, args.batch_size, model) as net:
            del params
            train(net, data, args, replicas, 0, {})
            if args.trace is not None:
                if not any(pipe.events.values()):
                    log.warning("no training step ran (--epochs %d): %s has no events", args.epochs, args.trace)
                write_trace(pipe, args.trace)
                log.info("wrote the last step's timeline to %s", args.trace)
            accuracy = evaluate(net, data, args.test_batch_size, replicas)
            return accuracy, digest(net.host_params())


def main(argv: list[str] | None = None) -> int:
    return run_main(parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
