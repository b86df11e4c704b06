"""A torch job whose one failure takes the others down before it has left itself, as torch jobs
often fail: gloo, env:// initialisation, torch's ``@record``, the process group destroyed in a
``finally``.

Rank ``--fail-rank`` raises ``ValueError`` where the others wait for it in an all_reduce (with
``--error reset``, ``ConnectionResetError``, as code of its own whose connection was reset: its
words then say "reset by peer" too). Its
``finally`` destroys its process group, which closes its connections, and only then does ``@record``
write its error file: the others fail at once on the closed connections ("Connection closed by
peer", "Connection reset by peer"), and record that (often before it has recorded its own), and
exit. The failing rank then lingers ``--linger`` seconds on its way out (an ``atexit`` hook), so
that it leaves last, or is stopped by poprun: the first to exit is not the one that failed first.
"""

import argparse
import atexit
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


def load_batch(step: int, error: str) -> None:
    if error == "reset":
        raise ConnectionResetError(f"[Errno 104] Connection reset by peer while loading batch {step}")
    raise ValueError(f"bad batch {step}")


@record
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--linger", type=float, default=3.0)
    parser.add_argument("--error", choices=["value", "reset"], default="value")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        total = torch.ones(4)
        dist.all_reduce(total)  # every rank has joined
        if dist.get_rank() == args.fail_rank:
            atexit.register(time.sleep, args.linger)
            load_batch(7, args.error)
        dist.all_reduce(total)  # waits for the failing rank, whose connections close
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
