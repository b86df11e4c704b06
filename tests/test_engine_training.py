"""The engine's training step: accumulation, reduction, fused buckets, sharded optimizer state,
checkpoints, and bad input; every setting gives bitwise-identical weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from popdist_py.engine import CommGroup, Runtime
from popdist_py.engine.locations import TensorLocation, TrainingOptions
from popdist_py.engine.optimizers import LAMB, SGD, Adam, AdamW, Optimizer
from popdist_py.engine.training import STEP_VARIABLE, PairwiseSum, Trainer, canonical_sum

SAMPLES = 16  # per batch, over all replicas and micro-batches
STEPS = 3
rng = np.random.default_rng(14)
W0 = rng.standard_normal((5, 3)).astype(np.float32)
B0 = np.zeros(3, np.float32)
X = rng.standard_normal((STEPS, SAMPLES, 5)).astype(np.float32)
Y = rng.standard_normal((STEPS, SAMPLES, 3)).astype(np.float32)

OPTIMIZERS: dict[str, Callable[[], Optimizer]] = {
    "sgd": lambda: SGD(0.1),
    "momentum": lambda: SGD(0.05, momentum=0.9, nesterov=True),
    "adam": lambda: Adam(0.01, weight_decay=0.01),
    "adamw": lambda: AdamW(0.01),
    "lamb": lambda: LAMB(0.01, weight_decay=0.01),
}


def linear_model(params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
    """Mean squared error of ``x @ W + b``; per-sample gradients summed with canonical_sum."""
    err = x @ params["W"] + params["b"] - y
    n = np.float32(len(x))
    grads = {"W": canonical_sum(np.float32(2) * x[:, :, None] * err[:, None, :]) / n,
             "b": canonical_sum(np.float32(2) * err) / n}
    return float(np.mean(err * err)), grads


def host_batch(x: np.ndarray, replicas: int, accumulation: int) -> np.ndarray:
    """Samples of one batch as [A, L, B, ...]: replica r takes the r-th block, micro-batch a its a-th part."""
    micro = len(x) // (replicas * accumulation)
    return x.reshape(replicas, accumulation, micro, *x.shape[1:]).transpose(1, 0, 2, *range(3, x.ndim + 2))


def options(accumulation: int = 1, shard: Any = None, **kw: Any) -> TrainingOptions:
    opts = TrainingOptions(accumulation_factor=accumulation, **kw)
    if shard is not None:
        opts.optimizer_state_tensor_location_settings.location = TensorLocation(True, None if shard is True else shard)
    return opts


def train(replicas: int, accumulation: int, opt: str, opts: TrainingOptions | None = None,
          executor: str | None = None) -> tuple[dict[str, np.ndarray], np.ndarray]:
    opts = opts or options(accumulation)
    micro = SAMPLES // (replicas * accumulation)
    with Runtime(replication=replicas, executor=executor) as rt:
        trainer = Trainer(rt, {"W": W0, "b": B0}, linear_model, OPTIMIZERS[opt](), [(micro, 5), (micro, 3)], opts)
        losses = [trainer.step(host_batch(X[s], replicas, accumulation), host_batch(Y[s], replicas, accumulation))
                  for s in range(STEPS)]
        assert trainer.updates == STEPS
        return trainer.weights(), np.concatenate(losses)


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_every_split_accumulation_and_placement_gives_the_same_bits(opt: str, executor: str) -> None:
    reference, losses = train(1, 1, opt)
    settings = [(1, 2, None), (1, 4, None), (2, 1, None), (2, 2, True), (4, 1, True), (4, 2, CommGroup.consecutive(2)),
                (4, 4, True)]
    for replicas, accumulation, shard in settings:
        weights, got = train(replicas, accumulation, opt, options(accumulation, shard), executor)
        for name in reference:
            assert weights[name].tobytes() == reference[name].tobytes(), (replicas, accumulation, shard, name)
        np.testing.assert_allclose(got, losses, rtol=1e-6)
    assert not np.array_equal(reference["W"], W0)  # it trained


def test_fused_buckets_equal_one_collective_per_tensor() -> None:
    one_each, _ = train(4, 1, "adam", options(1, True, fused_reduction_bytes=1))
    fused, _ = train(4, 1, "adam", options(1, True, fused_reduction_bytes=1 << 20))
    assert all(one_each[n].tobytes() == fused[n].tobytes() for n in fused)


def test_sum_reduction_and_schedules() -> None:
    lr = lambda step: 0.01 / step  # noqa: E731
    with Runtime(replication=2) as rt:
        trainer = Trainer(rt, {"W": W0, "b": B0}, linear_model, SGD(lr), [(4, 5), (4, 3)],
                          options(2, reduction="Sum"))
        trainer.step(host_batch(X[0], 2, 2), host_batch(Y[0], 2, 2))
        summed = trainer.weights()["W"]
    with Runtime(replication=2) as rt:
        trainer = Trainer(rt, {"W": W0, "b": B0}, linear_model, SGD(lambda step: 0.04 / step), [(4, 5), (4, 3)],
                          options(2, reduction="mean"))
        trainer.step(host_batch(X[0], 2, 2), host_batch(Y[0], 2, 2))
        meaned = trainer.weights()["W"]
    np.testing.assert_allclose(summed, meaned, rtol=1e-6)  # sum of 4 = 4 x mean


def test_state_is_sharded_only_above_the_minimum_and_as_overridden() -> None:
    opts = options(1, True)
    opts.optimizer_state_tensor_location_settings.min_elements_for_replicated_tensor_sharding = 10
    with Runtime(replication=4) as rt:
        trainer = Trainer(rt, {"W": W0, "b": B0}, linear_model, Adam(0.01), [(4, 5), (4, 3)], opts)
        assert trainer.placements["W"].domain is not None  # 15 elements
        assert trainer.placements["b"].domain is None  # 3 elements
        assert rt.state_nbytes()  # the runtime accounts for the state
    opts.tensor_location_settings_override = {"W/exp_avg": TensorLocation(), "W/exp_avg_sq": TensorLocation()}
    with Runtime(replication=4) as rt:
        trainer = Trainer(rt, {"W": W0, "b": B0}, linear_model, Adam(0.01), [(4, 5), (4, 3)], opts)
        assert trainer.placements["W"].domain is None


@pytest.mark.parametrize("saved_shard,loaded_shard", [(True, None), (None, True), (True, CommGroup.consecutive(2))])
def test_checkpoint_resumes_under_another_placement_and_split(tmp_path: Path, saved_shard: Any,
                                                               loaded_shard: Any) -> None:
    reference, _ = train(4, 1, "adam", options(1, saved_shard))
    path = tmp_path / "ck.npz"
    with Runtime(replication=4) as rt:
        trainer = Trainer(rt, {"W": W0, "b": B0}, linear_model, OPTIMIZERS["adam"](), [(4, 5), (4, 3)],
                          options(1, saved_shard))
        trainer.step(host_batch(X[0], 4, 1), host_batch(Y[0], 4, 1))
        rt.save(path)
    with Runtime(replication=2) as rt:  # another split, another placement
        trainer = Trainer(rt, {"W": np.zeros_like(W0), "b": B0}, linear_model, OPTIMIZERS["adam"](), [(4, 5), (4, 3)],
                          options(2, loaded_shard))
        rt.load(path)
        assert trainer.updates == 1
        for s in range(1, STEPS):
            trainer.step(host_batch(X[s], 2, 2), host_batch(Y[s], 2, 2))
        resumed = trainer.weights()
    assert all(resumed[n].tobytes() == reference[n].tobytes() for n in reference)


def test_data_shapes_with_size_one_axes_left_out() -> None:
    with Runtime(replication=1) as rt:
        trainer = Trainer(rt, {"W": W0, "b": B0}, linear_model, SGD(0.1), [(16, 5), (16, 3)])
        full = trainer.step(X[:2].reshape(2, 1, 1, 16, 5), Y[:2].reshape(2, 1, 1, 16, 3))
        assert full.shape == (2,)
        bare = trainer.step(X[0], Y[0])  # batches_per_step, accumulation and replicas all 1: left out
        assert bare.shape == (1,)
        with pytest.raises(ValueError, match=r"input 0 has shape \(3, 5\); it must end with the micro-batch shape"):
            trainer.step(X[0][:3], Y[0])
        with pytest.raises(ValueError, match="the inputs give different batches_per_step"):
            trainer.step(X[:2].reshape(2, 16, 5), Y[0])
    with Runtime(replication=2) as rt:
        trainer = Trainer(rt, {"W": W0, "b": B0}, linear_model, SGD(0.1), [(4, 5), (4, 3)], options(2))
        with pytest.raises(ValueError, match=r"leading axes \(3, 2\), expected \[batches_per_step, "
                                             r"accumulation_factor=2, replicas in this instance=2\]"):
            trainer.step(np.zeros((3, 2, 4, 5), np.float32), np.zeros((2, 2, 4, 3), np.float32))


@pytest.mark.parametrize("change,message", [
    (lambda o: setattr(o, "accumulation_factor", 0), "accumulation_factor"),
    (lambda o: setattr(o, "reduction", "avg"), r"reduction='avg' is not valid; use 'mean' or 'sum'"),
    (lambda o: o.tensor_location_settings_override.update(W=TensorLocation(True)),
     r"names 'W', which is not an optimizer state tensor of this trainer \(valid: W/exp_avg"),
    (lambda o: setattr(o.optimizer_state_tensor_location_settings, "location",
                       TensorLocation(True, CommGroup.consecutive(3))),
     r"replica_group_size=3 must divide the replication factor 4 \(one of \[1, 2, 4\]\)"),
])
def test_bad_settings_are_one_clear_error_before_anything_changes(change: Any, message: str) -> None:
    opts = options(1)
    change(opts)
    with Runtime(replication=4) as rt:
        with pytest.raises((ValueError, TypeError), match=message):
            Trainer(rt, {"W": W0, "b": B0}, linear_model, Adam(0.01), [(4, 5), (4, 3)], opts)
        Trainer(rt, {"W": W0, "b": B0}, linear_model, Adam(0.01), [(4, 5), (4, 3)])  # the names are still free


def test_gradients_that_do_not_fit_are_named() -> None:
    def wrong(params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
        return 0.0, {"W": np.zeros((3, 5), np.float32), "b": params["b"]}

    with Runtime(replication=2) as rt:
        trainer = Trainer(rt, {"W": W0, "b": B0}, wrong, SGD(0.1), [(8, 5), (8, 3)])
        with pytest.raises(ValueError, match=r"the gradient of 'W' has shape \(3, 5\), the weight \(5, 3\)"):
            trainer.step(host_batch(X[0], 2, 1), host_batch(Y[0], 2, 1))


def test_canonical_sum_is_the_accumulators_order() -> None:
    values = np.random.default_rng(3).standard_normal((24, 7)).astype(np.float32) * 1e3
    for block in (1, 2, 4, 8):  # micro-batches of a power-of-two size, accumulated
        acc = PairwiseSum()
        for start in range(0, 24, block):
            acc.add(canonical_sum(values[start:start + block]))
        assert acc.total().tobytes() == canonical_sum(values).tobytes()
    assert STEP_VARIABLE == "trainer/step"
