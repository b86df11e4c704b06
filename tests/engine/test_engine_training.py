"""The engine's training step: accumulation, reduction, fused buckets, sharded optimizer state,
checkpoints, and bad input; every setting gives bitwise-identical weights."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from popdist_py.engine import CommGroup, Runtime
from popdist_py.engine._collectives.reduce import reduce_sequence
from popdist_py.engine._training.locations import TensorLocation, TrainingOptions
from popdist_py.engine._training.training import STEP_VARIABLE, PairwiseSum, Trainer, canonical_sum
from popdist_py.engine.optimizers import SGD, Adam
from tests.engine.training_model import (
    B0,
    OPTIMIZERS,
    PLACEMENTS,
    SAMPLES,
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


@pytest.mark.determinism
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
        assert trainer.placements["W"].update_sharded  # 15 elements
        assert not trainer.placements["b"].update_sharded  # 3 elements
        sharded = rt.state_nbytes()["memory"]
    opts.tensor_location_settings_override = {"W/exp_avg": TensorLocation(), "W/exp_avg_sq": TensorLocation()}
    with Runtime(replication=4) as rt:
        trainer = Trainer(rt, {"W": W0, "b": B0}, linear_model, Adam(0.01), [(4, 5), (4, 3)], opts)
        assert not trainer.placements["W"].update_sharded
        whole = rt.state_nbytes()["memory"]
    # W's two Adam states, float32, on each of 4 replicas: 15 elements whole, a shard of 4 sharded
    assert whole - sharded == 2 * 4 * (15 - 4) * 4


@pytest.mark.determinism
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
    (lambda o: o.tensor_location_settings_override.update(V=TensorLocation()),
     r"names 'V', which is not a weight, optimizer state or accumulator of this trainer \(valid: 'W', 'W/exp_avg'"),
    (lambda o: setattr(o.optimizer_state_tensor_location_settings, "location",
                       TensorLocation(replicated_tensor_sharding=True, sharding_domain=CommGroup.consecutive(3))),
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


@pytest.mark.one_executor  # no Runtime
@pytest.mark.determinism
def test_canonical_sum_is_the_accumulators_order() -> None:
    values = np.random.default_rng(3).standard_normal((24, 7)).astype(np.float32) * 1e3
    for block in (1, 2, 4, 8):  # micro-batches of a power-of-two size, accumulated
        acc = PairwiseSum()
        for start in range(0, 24, block):
            acc.add(canonical_sum(values[start:start + block]))
        assert acc.total().tobytes() == canonical_sum(values).tobytes()
    assert STEP_VARIABLE == "trainer/step"


@pytest.mark.determinism
@pytest.mark.parametrize("opt", ["momentum", "adam", "lamb"])
def test_every_location_setting_gives_the_same_bits(opt: str, executor: str) -> None:
    reference, _ = train(1, 1, opt)
    for replicas, accumulation in ((2, 2), (4, 1)):
        for how in PLACEMENTS:
            weights, _ = train(replicas, accumulation, opt, located(accumulation, **how), executor)
            for name in reference:
                assert weights[name].tobytes() == reference[name].tobytes(), (replicas, how, name)
    for how in PLACEMENTS:  # a domain of 2 of 4 replicas: scattered inside it, then reduced across
        weights, _ = train(4, 1, opt, located(1, domain=CommGroup.consecutive(2), **how), executor)
        assert all(weights[n].tobytes() == reference[n].tobytes() for n in reference), how


def test_three_replicas_and_a_domain_of_three_agree_with_replicated() -> None:
    """Not a power of two: a domain of 3 of 6 replicas is reduced over all replicas first."""
    def run(opts: TrainingOptions, replicas: int) -> dict[str, np.ndarray]:
        with Runtime(replication=replicas) as rt, \
                Trainer(rt, {"W": W0, "b": B0}, linear_model, Adam(0.01), [(2, 5), (2, 3)], opts) as trainer:
            for s in range(STEPS):
                trainer.step(host_batch(X[s][:2 * replicas], replicas, 1), host_batch(Y[s][:2 * replicas], replicas, 1))
            return trainer.weights()

    for replicas, domain in ((3, None), (6, CommGroup.consecutive(3))):
        reference = run(located(), replicas)
        for how in PLACEMENTS:
            got = run(located(domain=domain, **how), replicas)
            assert all(got[n].tobytes() == reference[n].tobytes() for n in reference), (replicas, how)


def test_placements_follow_the_settings_minimums_and_overrides() -> None:
    opts = located(weights="io", state="off-sharded")
    opts.weight_tensor_location_settings.min_elements_for_off_chip = 10
    opts.optimizer_state_tensor_location_settings.min_elements_for_replicated_tensor_sharding = 10
    opts.tensor_location_settings_override["W/exp_avg_sq"] = TensorLocation(replicated_tensor_sharding=True)
    opts.tensor_location_settings_override["W/exp_avg"] = TensorLocation(replicated_tensor_sharding="On")
    with Runtime(replication=4) as rt, \
            Trainer(rt, {"W": W0, "b": B0}, linear_model, Adam(0.01), [(4, 5), (4, 3)], opts) as trainer:
        w, b = trainer.placements["W"], trainer.placements["b"]
        assert (w.weight.off_chip, w.weight.sharded, w.weight.read_ahead) == (True, True, True)  # 15 elements
        assert (b.weight.off_chip, b.weight.sharded) == (False, True)  # 3 < 10 elements: on chip
        assert not w.states["exp_avg"].off_chip and w.update_sharded  # overridden: on chip, still sharded
        assert w.states["exp_avg"].describe() == "W/exp_avg: on chip, sharded over stride=1, group_size=4"
        assert not b.update_sharded and b.states["exp_avg"].off_chip  # below the state's minimum for sharding
        assert rt.state_nbytes()["file"] > 0


def test_off_chip_state_is_not_resident_and_is_read_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    from popdist_py.engine._state import pages

    threads: set[str] = set()
    prefault = pages.prefault

    def spy(view: np.ndarray) -> None:
        threads.add(threading.current_thread().name.split("_")[0])
        prefault(view)

    monkeypatch.setattr(pages, "prefault", spy)
    big = {"W": np.ones((256, 64), np.float32), "b": np.zeros(64, np.float32)}

    def model(p: dict[str, np.ndarray], x: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
        return 0.0, {"W": np.full_like(p["W"], x.sum()), "b": np.zeros_like(p["b"])}

    memory = {}
    for how in ("whole", "io"):
        with Runtime(replication=2) as rt, \
                Trainer(rt, big, model, Adam(0.01), [(1,)], located(weights=how, state=how)) as trainer:
            trainer.step(np.ones((2, 1), np.float32))
            memory[how] = rt.state_nbytes()["memory"]
    assert memory["io"] <= memory["whole"] // 10, memory
    assert "read-ahead" in threads, threads


def test_checkpoint_moves_between_location_settings(tmp_path: Path) -> None:
    reference, _ = train(4, 1, "lamb")
    path = tmp_path / "ck.npz"
    with Runtime(replication=4) as rt, Trainer(rt, {"W": W0, "b": B0}, linear_model, OPTIMIZERS["lamb"](),
                                               [(4, 5), (4, 3)], located(weights="io", state="io")) as trainer:
        trainer.step(host_batch(X[0], 4, 1), host_batch(Y[0], 4, 1))
        trainer.save(path, {"epoch": 1})
    with Runtime(replication=2) as rt, Trainer(rt, {"W": np.zeros_like(W0), "b": B0}, linear_model,
                                               OPTIMIZERS["lamb"](), [(4, 5), (4, 3)], located(2)) as trainer:
        assert trainer.load(path) == {"epoch": 1}
        assert trainer.updates == 1
        for s in range(1, STEPS):
            trainer.step(host_batch(X[s], 2, 2), host_batch(Y[s], 2, 2))
        assert all(trainer.weights()[n].tobytes() == reference[n].tobytes() for n in reference)
        state = trainer.optimizer_state()
        assert set(state) == {"W/exp_avg", "W/exp_avg_sq", "b/exp_avg", "b/exp_avg_sq"}
        assert state["W/exp_avg"].shape == W0.shape
    manifest = np.load(path, allow_pickle=False)["__manifest__"][()]
    assert '"optimizer": "LAMB"' in str(manifest)


def test_weights_can_be_written_under_every_placement() -> None:
    for how in ("whole", "sharded", "io"):
        with Runtime(replication=2) as rt, Trainer(rt, {"W": W0, "b": B0}, linear_model, SGD(0.1),
                                                   [(8, 5), (8, 3)], located(weights=how)) as trainer:
            trainer.write_weights({"W": W0 * 2})
            assert trainer.weights()["W"].tobytes() == (W0 * 2).tobytes()
            with pytest.raises(ValueError, match="write_weights: 'V' is not a weight of this trainer"):
                trainer.write_weights({"V": W0})


def test_fused_buckets_equal_one_collective_per_tensor_for_every_layout() -> None:
    for how in (dict(), dict(weights="sharded", state="sharded"), dict(state="io", domain=CommGroup.consecutive(2))):
        one_each, _ = train(4, 1, "adam", located(fused_reduction_bytes=1, **how))
        fused_, _ = train(4, 1, "adam", located(fused_reduction_bytes=1 << 20, **how))
        assert all(one_each[n].tobytes() == fused_[n].tobytes() for n in fused_), how


def _shard_the_accumulator_only(o: TrainingOptions) -> None:
    """The accumulator sharded over the whole group, the optimizer state (and so the update) whole."""
    o.accumulator_tensor_location_settings.location.replicated_tensor_sharding = True
    o.optimizer_state_tensor_location_settings.location = TensorLocation()


@pytest.mark.parametrize("change,message", [
    (lambda o: setattr(o.accumulator_tensor_location_settings, "location", TensorLocation(
        replicated_tensor_sharding=True, sharding_domain=CommGroup.consecutive(2))),
     (r"the accumulator of weight 'W' is sharded over stride=1, group_size=2 but the weight's update runs on "
      r"shards over stride=1, group_size=4")),
    (_shard_the_accumulator_only,
     (r"the accumulator of weight 'W' is sharded over stride=1, group_size=4 but the weight's update runs on the "
      r"whole tensor")),
    (lambda o: setattr(o.weight_tensor_location_settings.location, "storage", "disk"),
     r"location.storage='disk' is not valid: use TensorStorage.ON_CHIP, TensorStorage.OFF_CHIP"),
    (lambda o: setattr(o.weight_tensor_location_settings.location, "load_tile_set", "fast"),
     r"load_tile_set='fast' is not valid: use TileSet.COMPUTE, TileSet.IO"),
    (lambda o: setattr(o.weight_tensor_location_settings, "min_elements_for_off_chip", -1),
     r"weight_tensor_location_settings.min_elements_for_off_chip=-1 is invalid"),
    (lambda o: o.tensor_location_settings_override.update({"W/exp_avg": TensorLocation()}),
     "the optimizer state tensors of weight 'W' are sharded differently"),
    (lambda o: o.tensor_location_settings_override.update(W=TensorLocation(
        replicated_tensor_sharding=True, sharding_domain=CommGroup.consecutive(2))),
     r"weight 'W' is sharded over stride=1, group_size=2 but its optimizer state over stride=1, group_size=4"),
    (lambda o: setattr(o.weight_tensor_location_settings.location, "sharding_domain", CommGroup.orthogonal(2)),
     r"sharding domain CommGroup\(Orthogonal, 2\) does not split"),
    (lambda o: setattr(o, "reduction", "NoReduction"), r"reduction='NoReduction' is not valid"),
])
def test_bad_locations_are_one_clear_error_before_anything_changes(change: Any, message: str) -> None:
    opts = located(state="sharded")
    change(opts)
    with Runtime(replication=4) as rt:
        with pytest.raises((ValueError, TypeError), match=message):
            Trainer(rt, {"W": W0, "b": B0}, linear_model, Adam(0.01), [(4, 5), (4, 3)], opts)
        assert len(rt.variables) == 0 and rt.state_nbytes() == {"memory": 0, "file": 0}


def test_popart_spellings_are_accepted() -> None:
    opts = TrainingOptions(reduction="Sum")
    opts.weight_tensor_location_settings.location = TensorLocation("OffChip", "On", None, "IO")
    with Runtime(replication=2) as rt, Trainer(rt, {"W": W0, "b": B0}, linear_model, SGD(0.1), [(8, 5), (8, 3)],
                                               opts) as trainer:
        assert trainer.op == "add"
        described = trainer.placements["W"].weight.describe()
        assert described == "W: off chip, read ahead, sharded over stride=1, group_size=2"


def test_accumulating_three_micro_batches_of_four_equals_one_of_twelve() -> None:
    """B a power of two is enough: (sum / 4) / 3 rounds once, as sum / 12 does."""
    def run(accumulation: int, micro: int) -> dict[str, np.ndarray]:
        with Runtime(replication=1) as rt, Trainer(rt, {"W": W0, "b": B0}, linear_model, Adam(0.01),
                                                   [(micro, 5), (micro, 3)], options(accumulation)) as trainer:
            for s in range(STEPS):
                trainer.step(X[s][:12].reshape(accumulation, micro, 5), Y[s][:12].reshape(accumulation, micro, 3))
            return trainer.weights()

    one, three = run(1, 12), run(3, 4)
    assert all(one[n].tobytes() == three[n].tobytes() for n in one)


def test_a_scalar_weight_trains_alike_under_every_placement() -> None:
    """A 0-d weight is sharded like any tensor (one element, padded) and goes off chip like any."""
    def model(p: dict[str, np.ndarray], x: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
        return float(x.sum()), {"s": np.asarray(x.sum() * p["s"]), "v": x.sum() * p["v"]}

    results = []
    for how in ("whole", "sharded", "off", "io"):
        with Runtime(replication=4) as rt, Trainer(rt, {"s": np.float32(1.5), "v": np.ones(3, np.float32)}, model,
                                                   Adam(0.1), [(2,)], located(weights=how, state=how)) as trainer:
            trainer.step(np.arange(8, dtype=np.float32).reshape(4, 2))
            assert trainer.placements["s"].weight.off_chip == (how in ("off", "io"))
            results.append(trainer.weights())
    assert all(r[n].tobytes() == results[0][n].tobytes() for r in results for n in ("s", "v"))


def fit(replicas: int, accumulation: int, opts: TrainingOptions) -> dict[str, np.ndarray]:
    """Adam on the first samples of each batch that split into replicas x accumulation micro-batches."""
    micro = max(1, SAMPLES // (replicas * accumulation))
    n = replicas * accumulation * micro
    with Runtime(replication=replicas) as rt, Trainer(rt, {"W": W0, "b": B0}, linear_model, Adam(0.01),
                                                      [(micro, 5), (micro, 3)], opts) as trainer:
        for s in range(STEPS):
            trainer.step(host_batch(X[s][:n], replicas, accumulation), host_batch(Y[s][:n], replicas, accumulation))
        return trainer.weights()


@pytest.mark.determinism
@pytest.mark.parametrize("accumulation", [2, 3, 7, 8])
def test_off_chip_accumulators_give_the_same_bits(accumulation: int) -> None:
    """The pending partial sums wait in files between micro-batches: the same additions."""
    for state in ("whole", "sharded"):
        on_chip = fit(2, accumulation, with_accumulators(accumulation, "whole", state))
        off_chip = fit(2, accumulation, with_accumulators(accumulation, "off", state))
        assert all(off_chip[n].tobytes() == on_chip[n].tobytes() for n in on_chip), state
        assert not np.array_equal(on_chip["W"], W0)


def test_off_chip_accumulators_live_in_files_of_one_block_per_level() -> None:
    with Runtime(replication=2) as rt:
        trainer = Trainer(rt, {"W": W0, "b": B0}, linear_model, Adam(0.01), [(1, 5), (1, 3)],
                          with_accumulators(8, "off"))
        spilled = trainer._spills["W"]
        assert spilled.is_memory_mapped and spilled.entries == 4 and spilled.shape == (5, 3)  # 8 = 0b1000: 4 levels
        assert spilled.nbytes == 2 * 4 * 15 * 4 and trainer._spills["b"].nbytes == 2 * 4 * 3 * 4  # replicas x slots
        assert rt.state_nbytes()["file"] == 0  # scratch of a step, not variables
        trainer.step(host_batch(X[0], 2, 8), host_batch(Y[0], 2, 8))
        trainer.close()


def test_sharded_accumulators_sum_over_replicas_first() -> None:
    """Each micro-batch's gradient is reduce-scattered; the accumulator holds this replica's shard.
    Checked against a reference that sums in that order: replicas (the engine's tree), then
    micro-batches (the pairwise tree), then divides by A and by R."""
    R, A = 4, 2
    micro = SAMPLES // (R * A)
    opt = SGD(0.1, momentum=0.9)
    opts = with_accumulators(A, "sharded", state="sharded")
    with Runtime(replication=R) as rt, Trainer(rt, {"W": W0, "b": B0}, linear_model, opt, [(micro, 5), (micro, 3)],
                                               opts) as trainer:
        assert trainer.placements["W"].accumulator.sharded and not trainer.fusion.buckets
        for s in range(STEPS):
            trainer.step(host_batch(X[s], R, A), host_batch(Y[s], R, A))
        got = trainer.weights()
    expect = {"W": W0.copy(), "b": B0.copy()}
    state = {n: opt.init_state(w.shape, w.dtype) for n, w in expect.items()}
    for s in range(STEPS):
        xs, ys = host_batch(X[s], R, A), host_batch(Y[s], R, A)  # [A, R, micro, ...]
        per = [[linear_model(expect, xs[a, r], ys[a, r])[1] for r in range(R)] for a in range(A)]
        for n, w in expect.items():
            over_replicas = np.stack([reduce_sequence([per[a][r][n] for r in range(R)]) for a in range(A)])
            g = canonical_sum(over_replicas) / np.float32(A) / np.float32(R)
            opt.update(w, g, state[n], s + 1)
    for n in expect:
        assert got[n].tobytes() == expect[n].tobytes(), n
    whole, _ = train(R, A, "momentum", options(A, True))  # whole accumulators: the same up to rounding
    sharded, _ = train(R, A, "momentum", with_accumulators(A, "off-sharded", "sharded"))
    np.testing.assert_allclose(whole["W"], sharded["W"], rtol=1e-5)


def test_sharded_accumulators_with_one_micro_batch_equal_whole_ones() -> None:
    """A = 1: a reduce-scatter then a division is what sharded optimizer state does anyway."""
    sharded, _ = train(4, 1, "adam", with_accumulators(1, "sharded", state="sharded"))
    whole, _ = train(4, 1, "adam", options(1, True))
    assert all(sharded[n].tobytes() == whole[n].tobytes() for n in whole)


def test_two_trainers_share_a_runtime_under_their_own_names() -> None:
    with Runtime(replication=2) as rt:
        first = Trainer(rt, {"W": W0, "b": B0}, linear_model, SGD(0.1), [(8, 5), (8, 3)])

        def renamed(params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
            loss, grads = linear_model({"W": params["W2"], "b": params["b2"]}, x, y)
            return loss, {"W2": grads["W"], "b2": grads["b"]}

        second = Trainer(rt, {"W2": W0, "b2": B0}, renamed, SGD(0.1), [(8, 5), (8, 3)], name="probe")
        assert first.step_var.name == "trainer/step" and second.step_var.name == "probe/step"
        second.step(host_batch(X[0], 2, 1), host_batch(Y[0], 2, 1))
        assert (first.updates, second.updates) == (0, 1)
        with pytest.raises(ValueError, match=r"already has variables named 'W2', 'b2', 'probe/step'.*another name="):
            Trainer(rt, {"W2": W0, "b2": B0}, renamed, SGD(0.1), [(8, 5), (8, 3)], name="probe")
        with pytest.raises(ValueError, match=r"Trainer name 'a/b' is not valid"):
            Trainer(rt, {"W3": W0}, renamed, SGD(0.1), [(8, 5)], name="a/b")

