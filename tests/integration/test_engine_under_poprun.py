"""The engine's Runtime under a real poprun: a step that fails, on every instance or on one, is
caught by the program, and the runtime goes on (as it does in one process)."""

from __future__ import annotations

import pytest

from tests.helpers import OMP_SET, PYTHON, poprun

pytestmark = pytest.mark.slow

SCRIPT = """
import numpy as np
from popdist_py.engine import PeerAborted, Runtime, ops

with Runtime() as rt:
    me = rt.instance_index
    try:  # on every instance
        rt.run(lambda ctx: ops.replicated_all_reduce(np.ones(2), op="avg"))
    except ValueError as exc:
        print("every instance:", type(exc).__name__, flush=True)

    def one_fails(ctx):
        if me == 0:
            raise KeyError("instance 0 only")
        return ops.replicated_all_reduce(np.ones(1))

    try:  # on one instance: the other learns of it in its collective
        rt.run(one_fails)
    except (KeyError, PeerAborted) as exc:
        print("one instance:", type(exc).__name__, flush=True)
    total = rt.run(lambda ctx: ops.replicated_all_reduce(np.array([ctx.replica_index + 1.0])))
    print("after:", total.ravel().tolist(), flush=True)
"""


def test_a_runtime_goes_on_after_failed_steps_under_poprun() -> None:
    result = poprun("--num-instances", "2", "--num-replicas", "4", PYTHON, "-c", SCRIPT, env=OMP_SET)
    assert result.returncode == 0, result.stderr
    lines = set(result.stdout.splitlines())
    assert {"[0] every instance: ValueError", "[1] every instance: ValueError", "[0] one instance: KeyError",
            "[1] one instance: PeerAborted", "[0] after: [10.0, 10.0]", "[1] after: [10.0, 10.0]"} <= lines, \
        result.stdout + result.stderr
