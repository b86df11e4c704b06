"""Pipelined replicas across instances (``mpiexec -n 2|3|4 python -m pytest --with-mpi``): every
split of 4 replicas, each on 3 devices, gives the weights of the stages run one after the other
in one process, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from popdist_py.engine import Pipeline, Runtime, Trainer, TrainingOptions
from popdist_py.engine._training.training import LossAndGrads
from popdist_py.engine.optimizers import Adam
from tests.engine.pipeline_model import SAMPLES, SIZES, STEPS, X, Y, batch, init, mlp
from tests.engine_helpers import on_every_split

pytestmark = pytest.mark.engine  # under both executors (tests/conftest.py)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipelined_replicas_give_one_process_sequential_weights_on_every_split(schedule: str) -> None:
    R, A = 4, 2
    micro = SAMPLES // (R * A)

    def fit(rt: Runtime, model: LossAndGrads | Pipeline) -> list[np.ndarray]:
        L, off = rt.instance_replication_factor, rt.replica_index_offset
        opts = TrainingOptions(accumulation_factor=A)
        opts.optimizer_state_tensor_location_settings.location.replicated_tensor_sharding = True
        with Trainer(rt, init(), model, Adam(0.01), [(micro, SIZES[0]), (micro, SIZES[-1])], opts) as trainer:
            for s in range(STEPS):
                trainer.step(batch(X[s], R, A)[:, off:off + L], batch(Y[s], R, A)[:, off:off + L])
            weights = trainer.weights()
        return [weights[n] for n in sorted(weights)]

    with Runtime(replication=R) as rt:
        expect = fit(rt, mlp(schedule=schedule).sequential)

    def body(rt: Runtime) -> list[np.ndarray]:
        got = fit(rt, mlp(schedule=schedule))
        assert all(g.tobytes() == e.tobytes() for g, e in zip(got, expect, strict=True))
        return got

    on_every_split(R, body)


@pytest.mark.mpi(min_size=2)
def test_continuous_pipelines_update_alike_on_every_split() -> None:
    """No accumulation: each stage's updates (a reduction across replicas and instances each) run
    in the pipeline's update order on every replica, so every split gives one process's bits."""
    R, B = 4, 4
    micro = SAMPLES // (R * B)

    def body(rt: Runtime) -> list[np.ndarray]:
        L, off = rt.instance_replication_factor, rt.replica_index_offset
        opts = TrainingOptions()
        opts.optimizer_state_tensor_location_settings.location.replicated_tensor_sharding = True
        opts.weight_tensor_location_settings.location.replicated_tensor_sharding = True  # gathered after updates
        with Trainer(rt, init(), mlp(), Adam(0.01), [(micro, SIZES[0]), (micro, SIZES[-1])], opts) as trainer:
            assert trainer.continuous
            x = X[0].reshape(B, R, micro, -1)[:, off:off + L]
            y = Y[0].reshape(B, R, micro, -1)[:, off:off + L]
            trainer.step(x, y)
            weights = trainer.weights()
        return [weights[n] for n in sorted(weights)]

    on_every_split(R, body)
