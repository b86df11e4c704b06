"""Train a little on popdist_py.engine, saving/loading checkpoints, under any split (for tests).

    python tests/scripts/engine_checkpoint.py --replicas 4 --steps 3 --save a.npz
    poprun --num-instances 2 --num-replicas 4 python tests/scripts/engine_checkpoint.py --rts --load a.npz

Variables: ``w`` (plain, or replica-sharded with ``--rts``), ``m`` its momentum in a remote
buffer (sharded in a memory-mapped file with ``--rts``), ``b`` a plain bias, and ``--big-mb N``
extra 1 MiB variables (to make saves slow enough to interrupt). RTS or not, and whatever the
split, the same steps give the same bits. Every instance prints ``loaded-sha256 <hex>`` after a
load and ``final-sha256 <hex>`` at the end; ``saving``/``saved`` around a save.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from popdist_py.engine import Runtime, ops

SHAPE = (37, 29)


def build(rt: Runtime, rts: bool, big_mb: int) -> dict[str, object]:
    rng = np.random.default_rng(11)
    w0 = (rng.standard_normal(SHAPE) * 0.5).astype(np.float32)
    m0 = np.zeros(SHAPE, np.float32)
    R = rt.replication_factor
    if rts:
        w, ws = rt.replica_sharded_variable(w0, name="w")
        buf = rt.remote_buffer((ops.shard_size(SHAPE, R),), np.float32, location="file")
        m = rt.remote_replica_sharded_variable(m0, buf, 0, name="m")
    else:
        w, ws = rt.variable(w0, name="w"), None
        buf = rt.remote_buffer(SHAPE, np.float32)
        m = rt.remote_variable(m0, buf, 0, name="m")
    b = rt.variable(np.zeros(SHAPE[1], np.float32), name="b")
    for i in range(big_mb):
        data = np.full(1 << 18, i, np.float32)  # 1 MiB
        if rts:
            rt.replica_sharded_variable(data, name=f"big{i:03d}")
        else:
            rt.variable(data, name=f"big{i:03d}")
    return {"w": w, "ws": ws, "m": m, "buf": buf, "b": b}


def train(rt: Runtime, v: dict[str, object], rts: bool, steps: int, first: int) -> None:
    R, L, off = rt.replication_factor, rt.instance_replication_factor, rt.replica_index_offset
    lr, beta = np.float32(0.05), np.float32(0.9)
    w, ws, _m, buf, b = v["w"], v["ws"], v["m"], v["buf"], v["b"]

    def step(ctx, x):  # type: ignore[no-untyped-def]
        full = ops.replicated_all_gather(ws) if rts else ctx[w]
        g = np.tanh(full * x + ctx[b])
        gb = ops.replicated_all_reduce(g.sum(axis=0), op="mean")
        mom = ops.remote_load(buf, 0)
        if rts:
            mom = beta * mom + ops.replicated_reduce_scatter(g, op="mean",
                                                            configure_output_for_replicated_tensor_sharding=True)
            ctx[ws] -= lr * mom
        else:
            mom = beta * mom + ops.replicated_all_reduce(g, op="mean")
            ctx[w] = ctx[w] - lr * mom
        ops.remote_store(buf, 0, mom)
        ctx[b] = ctx[b] - lr * gb

    for s in range(first, first + steps):  # batches depend on the step index only: resumable
        x = np.random.default_rng([s, 5]).standard_normal((R, *SHAPE)).astype(np.float32)
        rt.run(step, x[off : off + L])


def digest(rt: Runtime) -> str:
    h = hashlib.sha256()
    for var in sorted(rt.variables, key=lambda v: v.name):
        h.update(var.name.encode())
        h.update(np.ascontiguousarray(rt.get_tensor_data(var)).tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, help="total replicas in this process (default: poprun's environment)")
    p.add_argument("--rts", action="store_true")
    p.add_argument("--load", type=Path)
    p.add_argument("--save", type=Path)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--big-mb", type=int, default=0)
    args = p.parse_args(argv)
    with Runtime(args.replicas) as rt:
        v = build(rt, args.rts, args.big_mb)
        first = 0
        if args.load is not None:
            first = int(rt.load(args.load)["steps"])
            print(f"loaded-sha256 {digest(rt)} steps={first}", flush=True)
        train(rt, v, args.rts, args.steps, first)
        if args.save is not None:
            print("saving", flush=True)
            rt.save(args.save, {"steps": first + args.steps})
            print("saved", flush=True)
        print(f"final-sha256 {digest(rt)} replicas={rt.replication_factor} instances={rt.num_instances}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
