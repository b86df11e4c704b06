"""Collectives on inputs in pieces and the fused gradient reduction across instances (``mpiexec -n
2|3|4 python -m pytest --with-mpi``): every split of the replicas into instances gives the results
of one process bit for bit, with pieces sent to peers as partials or as they are."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from popdist_py.engine import CommGroup, Runtime, fused, ops
from popdist_py.engine._collectives.segments import Segments
from tests.engine.segments_data import MIXED, gradients, pieces
from tests.engine_helpers import on_every_split, valid_groupings

pytestmark = pytest.mark.engine  # under both executors (tests/conftest.py)


@pytest.mark.parametrize("R", [4, 6])
def test_collectives_on_pieces_on_every_split(R: int) -> None:
    rng = np.random.default_rng(R)
    data = [pieces(rng, MIXED) for _ in range(R)]

    def body(rt: Runtime) -> list[np.ndarray]:
        def step(ctx: Any) -> tuple[np.ndarray, ...]:
            mine = Segments(data[ctx.replica_index], np.float32)
            out = []
            for rg in valid_groupings(R):
                out.append(ops.replicated_all_reduce(mine, op="mean", group=rg))
                out.append(ops.replicated_reduce_scatter(mine, op="add", group=rg))
            return tuple(out)

        return list(rt.run(step))

    on_every_split(R, body)


def test_fused_reduction_on_every_split() -> None:
    R = 4
    shapes, grads = gradients(np.random.default_rng(5), R)

    def body(rt: Runtime) -> list[np.ndarray]:
        everyone = rt.replica_grouping()
        results = []
        for domain in (None, everyone, CommGroup.consecutive(2).to_replica_grouping(R)):
            fusion = fused.plan_buckets({n: (int(np.prod(s)), np.dtype(np.float32), domain) for n, s in shapes.items()},
                                1 << 30)

            def step(ctx: Any, fusion: Any = fusion) -> tuple[np.ndarray, ...]:
                got = fused.reduce(fusion, grads[ctx.replica_index], "mean", ctx.replica_index, everyone)
                return tuple(np.asarray(got[n]) for n in shapes)

            results += list(rt.run(step))
        return results

    on_every_split(R, body)
