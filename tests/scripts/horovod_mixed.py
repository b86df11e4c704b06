"""A Horovod program with what makes collectives hard, run unchanged under ``poprun --horovod``.

Every rank trains with DistributedOptimizer (whose hooks submit gradients in autograd's order)
and reduces two metrics per batch, submitted in opposite orders on odd and even ranks; rank r
has 3 + r batches, so ranks run out of data at different times and ``hvd.join()`` carries them.
After the join every rank takes the parameters of the last to join and prints one JSON line
with a digest of them. ``--raise-at B``: the last rank raises ValueError at its batch B instead.
"""

import argparse
import hashlib
import json

import horovod.torch as hvd
import torch

parser = argparse.ArgumentParser()
parser.add_argument("--raise-at", type=int, default=-1)
args = parser.parse_args()

hvd.init()
rank, size = hvd.rank(), hvd.size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                     named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
data = torch.Generator().manual_seed(rank)
seen = 0.0
for batch in range(3 + rank):
    if batch == args.raise_at and rank == size - 1:
        raise ValueError(f"rank {rank} cannot read batch {batch}")
    x, y = torch.randn(4, 8, generator=data), torch.randn(4, 1, generator=data)
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()  # type: ignore[no-untyped-call]  # torch: unannotated
    optimizer.step()
    names = ["loss", "samples"] if rank % 2 == 0 else ["samples", "loss"]
    values = {"loss": loss.detach().reshape(1), "samples": torch.tensor([float(len(x))])}
    handles = {name: hvd.allreduce_async(values[name], name=f"{name}.{batch}", op=hvd.Sum) for name in names}
    seen += hvd.synchronize(handles["samples"]).item()
last = hvd.join()
hvd.broadcast_parameters(model.state_dict(), root_rank=last)
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
print(json.dumps({"rank": rank, "last_to_join": last, "samples_seen": seen, "digest": digest[:16]}), flush=True)
