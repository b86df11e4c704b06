"""Report where this instance runs and what reached it, then check host collectives across hosts.

Prints one JSON line: the host name, the launcher-given and forwarded variables, and (with
``--collectives``) the results of an all-reduce, all-gather and broadcast over every instance,
each checked against the value it must have.
"""

import json
import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

FORWARDED = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "VIRTUAL_ENV", "UCX_NET_DEVICES")

report = {
    "host": socket.gethostname(),
    "env": {k: v for k, v in os.environ.items()
            if k.startswith(("POPDIST_", "POPRUN_")) or k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")},
    "forwarded": {k: os.environ.get(k) for k in FORWARDED},
}
if "--collectives" in sys.argv:
    import numpy as np

    import popdist_py as popdist

    popdist.init()
    index, count = popdist.getInstanceIndex(), popdist.getNumInstances()
    big = np.full(1 << 20, index + 1, np.float32)  # 4 MiB: enough to see on the interfaces
    total = popdist.allreduce(big, op="sum")
    assert np.all(total == count * (count + 1) / 2), total[:4]
    rows = popdist.allgather(np.array([index, 10 * index], np.int64))
    assert rows.tolist() == [[i, 10 * i] for i in range(count)], rows
    sent = popdist.broadcast(np.arange(5, dtype=np.float64) + (100 if index == 0 else -1), root=0)
    assert sent.tolist() == [100.0, 101.0, 102.0, 103.0, 104.0], sent
    popdist.barrier()
    report["collectives"] = "ok"
print(json.dumps(report), flush=True)
