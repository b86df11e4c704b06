"""An unmodified torch DDP training script, as torchrun runs it: gloo, env:// initialisation
(``dist.init_process_group("gloo")`` with no other argument), a small model, a few steps.

Each rank prints one JSON line at the end: its rank, the step it resumed from, torchrun's variables
as it saw them, and a hash of its parameters, which every rank checks equal across ranks
(all_gather_object) before printing. Options the tests use:

- ``--checkpoint FILE``: rank 0 saves model and optimizer after every step (then a barrier), and a
  restarted job (TORCHELASTIC_RESTART_COUNT > 0) resumes from it;
- ``--fail-at-step K --fail-rank R``: on the first start only, rank R raises in ``fail_on_purpose``
  at step K (under ``@record``, so torch writes TORCHELASTIC_ERROR_FILE), while the other ranks
  hold there (they do not fail by themselves: the failure is R's alone);
- ``--hold-at-step K --marker-dir D``: on the first start only, at step K every rank writes
  ``D/rank<r>`` (its PID) and waits for ``D/go``, which no test writes: a test kills one of them
  (or its host) there.

Holding ranks give up after HOLD_SECONDS and exit 3, so nothing waits for ever.

Two things here are for torch itself, not for poprun. Without them torch 2.13 (CPU, gloo) aborts
at exit in about one run of six on two busy cores, under torchrun too ("terminate called without
an active exception", SIGABRT): gloo's runloop thread drops its reference to a work just after
signalling its completion, and a work holds tensors (or thread-local state) whose Python objects
it must release under the GIL. When that reference is the last and the main thread, holding the
GIL, has gone on to finalize Python meanwhile, the runloop thread is ended as it waits for the GIL.
(destroy_process_group would join those threads, but once DDP has wrapped a model the process
group outlives it.) So the last collective is asynchronous and its work is kept (``KEPT``): the
main thread releases it, last. And at exit, before Python finalizes, the main thread lets go of the
GIL for a moment, for a work released on the way out (a failing rank's last backward or barrier).
"""

import argparse
import atexit
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel

HOLD_SECONDS = 60
#: The last collective's work, released by the main thread at exit (see the module's docstring).
KEPT: list[object] = []
atexit.register(time.sleep, 0.05)  # the GIL for gloo's threads, before Python finalizes (ditto)
TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
            "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
            "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
            "TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS")


def hold(path: str) -> None:
    deadline = time.monotonic() + HOLD_SECONDS
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(3)
        time.sleep(0.05)


def fail_on_purpose(step: int) -> None:
    raise RuntimeError(f"step {step} failed on purpose")


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=generator)
    return x, x.sum(dim=1, keepdim=True).sin()


def parameters_hash(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def train(args: argparse.Namespace, rank: int, restart: int) -> tuple[int, str]:
    """The steps; (the step it resumed from, the parameters' hash)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start = 0
    if restart > 0 and args.checkpoint and os.path.exists(args.checkpoint):
        state = torch.load(args.checkpoint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    ddp = DistributedDataParallel(model)
    for step in range(start, args.steps):
        if step == args.fail_at_step and restart == 0:
            if rank == args.fail_rank:
                fail_on_purpose(step)
            hold(os.devnull + ".never")  # the failure is the failing rank's alone
        if step == args.hold_at_step and restart == 0:
            marker = os.path.join(args.marker_dir, f"rank{rank}")
            with open(marker + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(marker + ".tmp", marker)
            hold(os.path.join(args.marker_dir, "go"))
        x, y = batch(step, rank)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()  # type: ignore[no-untyped-call]  # torch: unannotated
        optimizer.step()
        if args.checkpoint:
            if rank == 0:
                state = {"step": step + 1, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
                torch.save(state, args.checkpoint + ".tmp")
                os.replace(args.checkpoint + ".tmp", args.checkpoint)
            dist.barrier()  # nobody passes step + 1 before its checkpoint is complete
    return start, parameters_hash(model)


@record
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--checkpoint")
    parser.add_argument("--fail-at-step", type=int)
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--hold-at-step", type=int)
    parser.add_argument("--marker-dir")
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        start, digest = train(args, rank, int(os.environ["TORCHELASTIC_RESTART_COUNT"]))
        mine = torch.tensor(list(bytes.fromhex(digest)), dtype=torch.uint8)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        work = dist.all_gather(every, mine, async_op=True)
        KEPT.extend([work, every, mine])
        work.wait()
        assert all(torch.equal(other, mine) for other in every), f"parameters differ across ranks: {every}"
        print(json.dumps({"rank": rank, "resumed_from": start, "steps": args.steps, "params_sha256": digest,
                          "env": {name: os.environ.get(name) for name in TORCHRUN}}), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
