"""The PopDist guide's PyTorch listing (4.3.1): Horovod initialised beside PopDist.

Run: poprun --horovod --num-instances 2 --num-replicas 4 python examples/popdist_horovod.py --replicas 4

As the guide has it, with ``popdist_py`` for ``popdist`` and Horovod's PyTorch API from
``poprun --horovod``. There is no IPU, so no PopTorch: where the listing makes PopTorch's
options (``popdist.poptorch.Options()``: this instance's replicas from PopRun; ``poptorch.Options()``
without PopRun), this makes popdist_py.engine's runtime, which is configured the same way. The
last lines (not in the guide) print what each instance ended with.
"""

import argparse

import horovod.torch as hvd

import popdist_py as popdist
from popdist_py.engine import Runtime


def command_line_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="PopDist PyTorch example")
    parser.add_argument("--replicas", type=int, default=1, help="Number of replicas")
    return parser.parse_args()


def init_popdist(args: argparse.Namespace) -> None:
    hvd.init()
    args.use_popdist = True
    if popdist.getNumTotalReplicas() != args.replicas:
        print(f"The number of replicas is overridden by PopRun. The new value is {popdist.getNumTotalReplicas()}.")
    args.replicas = int(popdist.getNumLocalReplicas())

    args.popdist_rank = popdist.getInstanceIndex()
    args.popdist_size = popdist.getNumInstances()


def create_model(opts: argparse.Namespace) -> Runtime:
    if opts.use_popdist:  # noqa: SIM108  (the guide's shape)
        model_opts = Runtime()  # the guide: popdist.poptorch.Options(), this instance's replicas from PopRun
    else:
        model_opts = Runtime(replication=opts.replicas)  # the guide: poptorch.Options()
    return model_opts


if __name__ == "__main__":
    opts = command_line_arguments()

    # Initialise PopDist
    if popdist.isPopdistEnvSet():
        init_popdist(opts)
    else:
        opts.use_popdist = False

    with create_model(opts) as runtime:
        horovod = (hvd.rank(), hvd.size()) if opts.use_popdist else None
        print(f"instance {runtime.instance_index} of {runtime.num_instances}: replicas "
              f"{list(runtime.local_replicas)} of {runtime.replication_factor}; Horovod rank and size {horovod}")
