"""``hvd.elastic.run`` over poprun's restarts: on the job's first start (POPDIST_RESTART_COUNT=0)
rank 1 kills itself with SIGKILL in epoch ``--die-in``; the next start resumes from the last
commit. Each rank prints a JSON line per committed epoch and one at the end with a digest of the
parameters and the digest of the same training done here, in one process, without interruption
(every rank's gradient summed in rank order and divided by the ranks, as the allreduce does)."""

import argparse
import hashlib
import json
import os
import signal

import horovod.torch as hvd
import torch

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--die-in", type=int, default=-1)
args = parser.parse_args()

hvd.init()
start = int(os.environ.get("POPDIST_RESTART_COUNT", "0"))
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5),
                                     named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model, optimizer, epoch=0)


@hvd.elastic.run  # type: ignore[untyped-decorator]  # horovod: untyped here
def train(state: "hvd.elastic.TorchState") -> str:
    while state.epoch < args.epochs:
        x = torch.full((2, 4), float(state.epoch + hvd.rank() + 1))
        optimizer.zero_grad()
        model(x).pow(2).sum().backward()
        optimizer.step()
        if state.epoch == args.die_in and hvd.rank() == 1 and start == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        state.epoch += 1
        state.commit()
        print(json.dumps({"start": start, "rank": hvd.rank(), "committed_epoch": state.epoch}), flush=True)
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]


def digest(module: torch.nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in module.parameters())).hexdigest()[:16]


def uninterrupted(size: int) -> str:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    for epoch in range(args.epochs):
        grads = []
        for rank in range(size):
            model.zero_grad()
            model(torch.full((2, 4), float(epoch + rank + 1))).pow(2).sum().backward()
            grads.append([torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            total = grads[0][i]
            for g in grads[1:]:
                total = total + g[i]
            p.grad = total / size
        optimizer.step()
    return digest(model)


print(json.dumps({"start": start, "rank": hvd.rank(), "digest": train(state),
                  "uninterrupted": uninterrupted(hvd.size())}), flush=True)
