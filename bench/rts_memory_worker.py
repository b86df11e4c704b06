"""One configuration per process: build a large variable plus Adam-like optimizer state at L=4,
run one update step that touches all of it, and print the state's resident memory as JSON.

    rts_memory_worker.py replicated|rts|rts_offchip ELEMENTS

Resident memory is read from /proc/self/status: RssAnon (RAM the process owns) before and after
creating and updating the state; file-backed remote buffers show up in RssFile (page cache the
kernel may drop), not in RssAnon.
"""

from __future__ import annotations

import gc
import json
import sys

import numpy as np

from popdist_py.engine import Runtime, Shard, StepContext, Variable, ops

L = 4
LR, B1, B2, EPS = 1e-3, 0.9, 0.999, 1e-8


def rss() -> dict[str, int]:
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "RssShmem"):
                fields[key] = int(value.split()[0]) * 1024
    return fields


def main() -> None:
    mode, n = sys.argv[1], int(sys.argv[2])
    rt = Runtime(replication=L)
    rt.run(lambda ctx: None)  # start the replica threads before the baseline
    gc.collect()
    before = rss()
    init = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    zeros = np.zeros(n, np.float32)
    w: Variable | Shard
    m: Variable | Shard
    v: Variable | Shard
    if mode == "replicated":
        w, m, v = (rt.variable(a, name=name) for a, name in ((init, "w"), (zeros, "m"), (zeros, "v")))

        def step(ctx: StepContext, seed: np.ndarray) -> None:
            g = np.full(n, 1e-3 * (int(seed) + 1), np.float32)
            mm = B1 * ctx[m] + (1 - B1) * g
            vv = B2 * ctx[v] + (1 - B2) * g * g
            ctx[m], ctx[v] = mm, vv
            ctx[w] = ctx[w] - LR * mm / (np.sqrt(vv) + EPS)
    else:
        _, w = rt.replica_sharded_variable(init, name="w")
        if mode == "rts":
            _, m = rt.replica_sharded_variable(zeros, name="m")
            _, v = rt.replica_sharded_variable(zeros, name="v")
        else:
            shard = (-(-n // L),)
            buf = rt.remote_buffer(shard, np.float32, entries=2, location="file")
            rt.remote_replica_sharded_variable(zeros, buf, 0, name="m")
            rt.remote_replica_sharded_variable(zeros, buf, 1, name="v")

        def step(ctx: StepContext, seed: np.ndarray) -> None:
            g = ops.replica_sharded_slice(np.full(n, 1e-3 * (int(seed) + 1), np.float32))
            if mode == "rts":
                old_m, old_v = ctx[m], ctx[v]
            else:
                old_m, old_v = ops.remote_load(buf, 0), ops.remote_load(buf, 1)
            mm = B1 * old_m + (1 - B1) * g
            vv = B2 * old_v + (1 - B2) * g * g
            if mode == "rts":
                ctx[m], ctx[v] = mm, vv
            else:
                ops.remote_store(buf, 0, mm)
                ops.remote_store(buf, 1, vv)
            ctx[w] = ctx[w] - LR * mm / (np.sqrt(vv) + EPS)

    del init, zeros
    rt.run(step, np.arange(L))
    gc.collect()
    after = rss()
    print(json.dumps({"ram_bytes": after["RssAnon"] - before["RssAnon"],
                      "file_resident_bytes": after["RssFile"] - before["RssFile"],
                      "accounted": rt.state_nbytes()}), flush=True)
    rt.close()


if __name__ == "__main__":
    main()
