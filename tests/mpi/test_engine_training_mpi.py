"""The engine's Trainer across instances (``mpiexec -n 2|3|4 python -m pytest --with-mpi``): every
split of the replicas into instances, with replicated or sharded optimizer state (sharded within
an instance, PopART's recipe, or across instances, which PopART could not do), gives the weights
of one process bit for bit, and checkpoints move between splits."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from popdist_py.engine import CommGroup, Runtime
from popdist_py.engine._training.training import Trainer
from tests.engine.training_model import (
    B0,
    OPTIMIZERS,
    PLACEMENTS,
    STEPS,
    W0,
    X,
    Y,
    host_batch,
    linear_model,
    located,
    options,
    with_accumulators,
)
from tests.engine_helpers import instances, on_every_split, shared_dir, world

pytestmark = pytest.mark.engine  # under both executors (tests/conftest.py)


def run_trainer(rt: Runtime, opt: str, accumulation: int, shard: Any, steps: range = range(STEPS),
                opts: Any = None) -> Trainer:
    R, L, off = rt.replication_factor, rt.instance_replication_factor, rt.replica_index_offset
    micro = len(X[0]) // (R * accumulation)
    trainer = Trainer(rt, {"W": W0, "b": B0}, linear_model, OPTIMIZERS[opt](), [(micro, 5), (micro, 3)],
                      opts or options(accumulation, shard))
    for s in steps:  # this instance's replicas' share of the batch
        mine = slice(off, off + L)
        trainer.step(host_batch(X[s], R, accumulation)[:, mine], host_batch(Y[s], R, accumulation)[:, mine])
    return trainer


def resume(rt: Runtime, trainer: Trainer) -> dict[str, np.ndarray]:
    """The updates after the first on this instance's share of the batches; the weights then."""
    R, L, off = rt.replication_factor, rt.instance_replication_factor, rt.replica_index_offset
    assert trainer.updates == 1
    for s in range(1, STEPS):
        trainer.step(host_batch(X[s], R, 1)[:, off:off + L], host_batch(Y[s], R, 1)[:, off:off + L])
    return trainer.weights()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("opt", ["momentum", "adam", "lamb"])
@pytest.mark.parametrize("shard", [None, True, "per-instance"])
def test_trainer_weights_are_identical_for_every_split(opt: str, shard: Any) -> None:
    def body(rt: Runtime) -> list[np.ndarray]:
        domain = CommGroup.consecutive(rt.instance_replication_factor) if shard == "per-instance" else shard
        weights = run_trainer(rt, opt, 2, domain).weights()
        return [weights["W"], weights["b"]]

    on_every_split(4, body)


@pytest.mark.mpi(min_size=2)
def test_a_checkpoint_written_by_one_split_resumes_in_another() -> None:
    with Runtime(replication=4) as rt:
        expect = run_trainer(rt, "adam", 1, True).weights()
    with shared_dir() as d:
        path = d / "trainer.npz"
        with Runtime(replication=4) as rt:  # one process, sharded state, one update
            run_trainer(rt, "adam", 1, True, range(1))
            if world().rank == 0:
                rt.save(path)
        world().Barrier()
        with instances(2) as comm:
            if comm is None:
                return
            with Runtime(replication=4, comm=comm, timeout=60) as rt:  # 2 instances, replicated state
                trainer = run_trainer(rt, "adam", 1, None, range(0))
                rt.load(path)
                got = resume(rt, trainer)
        assert all(got[n].tobytes() == expect[n].tobytes() for n in expect)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("how", PLACEMENTS, ids=lambda how: "-".join(f"{k}={v}" for k, v in how.items()))
@pytest.mark.parametrize("domain", ["all", "per-instance"])
def test_every_location_setting_gives_one_process_weights_on_every_split(how: dict[str, Any], domain: str) -> None:
    """Sharded weights (ZeRO-3) and off-chip tensors, sharded across instances or within each."""
    with Runtime(replication=4) as rt:
        reference = run_trainer(rt, "lamb", 1, None).weights()

    def body(rt: Runtime) -> list[np.ndarray]:
        group = CommGroup.consecutive(rt.instance_replication_factor) if domain == "per-instance" else None
        with run_trainer(rt, "lamb", 1, None, opts=located(domain=group, **how)) as trainer:
            weights = trainer.weights()
        assert all(weights[n].tobytes() == reference[n].tobytes() for n in reference)
        return [weights["W"], weights["b"]]

    on_every_split(4, body)


@pytest.mark.mpi(min_size=2)
def test_a_checkpoint_of_sharded_off_chip_state_resumes_whole_in_another_split() -> None:
    with Runtime(replication=4) as rt:
        expect = run_trainer(rt, "adam", 1, None).weights()
    with shared_dir() as d:
        path = d / "trainer.npz"
        with instances(2) as comm:
            if comm is not None:
                # 2 x 2: weights and state off chip, sharded
                with Runtime(replication=4, comm=comm, timeout=60) as rt, \
                        run_trainer(rt, "adam", 1, None, range(1), located(weights="io", state="io")) as trainer:
                    trainer.save(path, {"epoch": 1})
        with Runtime(replication=4) as rt:  # 1 x 4, everything whole and on chip
            trainer = run_trainer(rt, "adam", 1, None, range(0))
            assert trainer.load(path) == {"epoch": 1}
            got = resume(rt, trainer)
        assert all(got[n].tobytes() == expect[n].tobytes() for n in expect)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("accumulators", ["off", "sharded", "off-sharded"])
@pytest.mark.parametrize("domain", ["all", "per-instance"])
def test_off_chip_and_sharded_accumulators_give_one_process_weights_on_every_split(accumulators: str,
                                                                                  domain: str) -> None:
    """Accumulation 2: off-chip accumulators keep the bits of whole ones; sharded ones reduce-scatter
    each micro-batch (across instances or within each), the same bits on every split."""
    def placed(rt: Runtime) -> Any:
        # per instance (at least pairs: one replica alone shards nothing, whole accumulators sum in another order)
        group = CommGroup.consecutive(max(2, rt.instance_replication_factor)) if domain == "per-instance" else None
        opts = with_accumulators(2, accumulators, state="sharded")
        for settings in (opts.optimizer_state_tensor_location_settings, opts.accumulator_tensor_location_settings):
            settings.location.sharding_domain = group
        return opts

    def body(rt: Runtime) -> list[np.ndarray]:
        with run_trainer(rt, "adam", 2, None, opts=placed(rt)) as trainer:
            weights = trainer.weights()
        return [weights["W"], weights["b"]]

    on_every_split(4, body)  # (per instance: one process's domain is all 4; the tree is the same)
