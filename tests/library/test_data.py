"""Dataset sharding helpers: exact values, torch's DistributedSampler algorithm, coverage properties."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import TypedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from popdist_py.data import (
    TORCH_RANDPERM_MAX_N,
    DistributedSampler,
    SplitOrder,
    global_batch_size,
    instance_batch_slice,
    local_replica_shard_indices,
    replica_shard_indices,
    shard,
    shard_indices,
    shuffle_buffer_size,
    split_for_replicas,
    torch_randperm,
)

PROPS = settings(max_examples=150, deadline=None)


class Topology(TypedDict):
    """The explicit topology keywords of the replica-level helpers."""

    num_total_replicas: int
    num_local_replicas: int
    replica_index_offset: int


class Shuffling(TypedDict, total=False):
    """The keyword options every sharding helper takes, but the layout."""

    shuffle: bool
    seed: int
    epoch: int
    drop_last: bool


class ShardOptions(Shuffling, total=False):
    """Every keyword option of the sharding helpers."""

    layout: SplitOrder


@pytest.fixture(autouse=True)
def no_popdist_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts outside poprun, whatever environment pytest was started in."""
    for name in list(os.environ):
        if name.startswith("POPDIST_"):
            monkeypatch.delenv(name)


@pytest.fixture
def instance_1_of_2(monkeypatch: pytest.MonkeyPatch) -> None:
    """R=8, L=4, offset 4: instance 1 of 2, global replicas 4..7."""
    monkeypatch.setenv("POPDIST_NUM_TOTAL_REPLICAS", "8")
    monkeypatch.setenv("POPDIST_NUM_LOCAL_REPLICAS", "4")
    monkeypatch.setenv("POPDIST_REPLICA_INDEX_OFFSET", "4")


class MT19937:
    """The reference Mersenne Twister (Matsumoto & Nishimura's mt19937ar.c), in plain Python.

    ``init_genrand`` seeding and ``genrand_int32`` output: the generator torch's CPU Generator
    wraps (``at::mt19937``, seeded with the low 32 bits of ``manual_seed``'s value).
    """

    N, M = 624, 397

    def __init__(self, seed: int) -> None:
        self.mt = [seed & 0xFFFFFFFF]
        for i in range(1, self.N):
            self.mt.append((1812433253 * (self.mt[i - 1] ^ (self.mt[i - 1] >> 30)) + i) & 0xFFFFFFFF)
        self.mti = self.N

    def next32(self) -> int:
        mt = self.mt
        if self.mti >= self.N:
            for kk in range(self.N):
                y = (mt[kk] & 0x80000000) | (mt[(kk + 1) % self.N] & 0x7FFFFFFF)
                mt[kk] = mt[(kk + self.M) % self.N] ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0)
            self.mti = 0
        y = mt[self.mti]
        self.mti += 1
        y ^= y >> 11
        y ^= (y << 7) & 0x9D2C5680
        y ^= (y << 15) & 0xEFC60000
        return y ^ (y >> 18)


def reference_randperm(n: int, seed: int) -> list[int]:
    """torch's CPU ``randperm`` for small n (``randperm_cpu``): a swap pass driven by mt19937."""
    generator, r = MT19937(seed), list(range(n))
    for i in range(n - 1):
        z = generator.next32() % (n - i)
        r[i], r[i + z] = r[i + z], r[i]
    return r


def torch_reference(n: int, k: int, rank: int, shuffle: bool, seed: int, epoch: int, drop_last: bool) -> list[int]:
    """torch.utils.data.DistributedSampler's algorithm (peers.md 2.4), with the reference randperm."""
    num_samples = math.ceil((n - k) / k) if drop_last and n % k != 0 else math.ceil(n / k)
    total_size = num_samples * k
    indices = reference_randperm(n, seed + epoch) if shuffle else list(range(n))
    if not drop_last:
        padding_size = total_size - len(indices)
        if padding_size <= len(indices):
            indices += indices[:padding_size]
        else:
            indices += (indices * math.ceil(padding_size / len(indices)))[:padding_size]
    else:
        indices = indices[:total_size]
    assert len(indices) == total_size
    indices = indices[rank:total_size:k]
    assert len(indices) == num_samples
    return indices


# ------------------------------------------------------------------------------------------
# exact values


def test_strided_padding_repeats_head() -> None:
    assert [shard_indices(10, 3, r).tolist() for r in range(3)] == [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]


def test_strided_drop_last_cuts_tail() -> None:
    assert [shard_indices(10, 3, r, drop_last=True).tolist() for r in range(3)] == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]


def test_padding_longer_than_dataset_repeats_several_times() -> None:
    assert [shard_indices(2, 5, r).tolist() for r in range(5)] == [[0], [1], [0], [1], [0]]
    assert [shard_indices(2, 5, r, drop_last=True).tolist() for r in range(5)] == [[]] * 5


def test_contiguous_blocks() -> None:
    got = [shard_indices(10, 3, r, layout="contiguous").tolist() for r in range(3)]
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
    got = [shard_indices(10, 3, r, layout="contiguous", drop_last=True).tolist() for r in range(3)]
    assert got == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_shuffle_uses_seed_plus_epoch() -> None:
    perm = np.array(reference_randperm(12, 7 + 3))
    assert shard_indices(12, 4, 1, shuffle=True, seed=7, epoch=3).tolist() == perm[1::4].tolist()
    # seed 8 epoch 2 is the same stream as seed 7 epoch 3, as in torch
    assert shard_indices(12, 4, 1, shuffle=True, seed=8, epoch=2).tolist() == perm[1::4].tolist()


def test_empty_dataset() -> None:
    assert shard_indices(0, 3, 2).tolist() == []
    assert shard_indices(0, 3, 2).dtype == np.int64
    assert len(DistributedSampler(0, 3, 2)) == 0
    assert list(DistributedSampler(0, 3, 2)) == []


def test_sampler_torch_attributes_and_len() -> None:
    sampler = DistributedSampler(list(range(10)), num_replicas=3, rank=2, shuffle=False)
    assert (len(sampler), sampler.num_samples, sampler.total_size) == (4, 4, 12)
    assert (sampler.num_replicas, sampler.rank, sampler.epoch, sampler.seed) == (3, 2, 0, 0)
    assert list(sampler) == [2, 5, 8, 1]
    dropped = DistributedSampler(10, num_replicas=3, rank=2, shuffle=False, drop_last=True)
    assert (len(dropped), dropped.total_size, list(dropped)) == (3, 9, [2, 5, 8])


def test_sampler_yields_plain_ints_and_reshuffles_per_epoch() -> None:
    sampler = DistributedSampler(range(40), num_replicas=2, rank=0, seed=5)
    first = list(sampler)
    assert all(type(i) is int for i in first)
    assert first == reference_randperm(40, 5)[0::2]
    assert list(sampler) == first  # no set_epoch: the same order again, as torch
    sampler.set_epoch(1)
    assert sampler.epoch == 1
    second = list(sampler)
    assert second == reference_randperm(40, 6)[0::2]
    assert second != first


def test_sampler_default_shuffles() -> None:
    assert list(DistributedSampler(30, 1, 0)) == reference_randperm(30, 0)


def test_sampler_accepts_numpy_integers() -> None:
    # numpy integers are typed out of the signature but accepted at run time (arg-type ignored)
    sampler = DistributedSampler(np.int64(9), np.int32(2), np.int64(1), shuffle=False)  # type: ignore[arg-type]
    assert (sampler.num_replicas, sampler.rank, list(sampler)) == (2, 1, [1, 3, 5, 7, 0])
    assert type(sampler.rank) is int


# ------------------------------------------------------------------------------------------
# torch's shuffled order


def test_reference_mt19937_is_the_standard_stream() -> None:
    # mt19937ar's default seed 5489: its published first outputs, and C++'s [rand.predef]
    # requirement that the 10000th output of a default-constructed std::mt19937 is 4123659995
    generator = MT19937(5489)
    first = [generator.next32() for _ in range(5)]
    assert first == [3499211612, 581869302, 3890346734, 3586334585, 545404204]
    for _ in range(10000 - 6):
        generator.next32()
    assert generator.next32() == 4123659995


def test_torch_randperm_published_torch_outputs() -> None:
    # torch.Generator().manual_seed(s); torch.randperm(10, generator=g).tolist(), as published
    known = {
        0: [4, 1, 7, 5, 3, 9, 0, 8, 6, 2],
        1: [5, 6, 1, 2, 0, 8, 9, 3, 7, 4],
        42: [2, 6, 1, 8, 4, 5, 0, 9, 3, 7],
        (1 << 32) + 1: [5, 6, 1, 2, 0, 8, 9, 3, 7, 4],  # only the low 32 bits seed mt19937
        (1 << 53) - 1: [1, 4, 6, 2, 0, 5, 8, 7, 9, 3],
    }
    for seed, expected in known.items():
        assert torch_randperm(10, seed).tolist() == expected
        assert reference_randperm(10, seed) == expected
    sampler = DistributedSampler(10, 1, 0, seed=0)
    assert list(sampler) == known[0]
    sampler.set_epoch(1)
    assert list(sampler) == known[1]
    assert list(DistributedSampler(10, 2, 1, seed=42)) == known[42][1::2]


def test_torch_randperm_small_and_dtype() -> None:
    assert torch_randperm(0, 3).tolist() == [] and torch_randperm(1, 3).tolist() == [0]
    assert torch_randperm(2, 3).dtype == np.int64 and sorted(torch_randperm(2, 3).tolist()) == [0, 1]
    assert torch_randperm(10, -(2**63)).tolist() == reference_randperm(10, 0)  # low 32 bits are 0


def test_negative_seed_is_its_low_32_bits() -> None:
    # torch.manual_seed(-1) takes the int64 as uint64 2**64 - 1, whose low 32 bits seed mt19937
    sampler = DistributedSampler(10, 1, 0, seed=-1)
    assert sampler.seed == -1
    assert list(sampler) == [1, 4, 6, 2, 0, 5, 8, 7, 9, 3] == torch_randperm(10, 2**32 - 1).tolist()
    sampler.set_epoch(1)  # seed + epoch = 0
    assert list(sampler) == [4, 1, 7, 5, 3, 9, 0, 8, 6, 2]
    assert shard_indices(10, 2, 0, shuffle=True, seed=-3, epoch=2).tolist() == [1, 6, 0, 8, 9]


def test_flags_accept_0_and_1_like_torch() -> None:
    # 0/1 and numpy flags are typed out of the signatures but accepted at run time (arg-type ignored)
    sampler = DistributedSampler(10, 3, 1, shuffle=1, drop_last=0)  # type: ignore[arg-type]
    assert (sampler.shuffle, sampler.drop_last) == (True, False)
    assert type(sampler.shuffle) is bool and len(sampler) == 4
    assert list(sampler) == torch_reference(10, 3, 1, True, 0, 0, False)
    unshuffled = DistributedSampler(10, 3, 1, shuffle=0, drop_last=1)  # type: ignore[arg-type]
    assert (unshuffled.shuffle, unshuffled.drop_last, list(unshuffled)) == (False, True, [1, 4, 7])
    assert shard_indices(
        10, 3, 1, shuffle=np.int64(0), drop_last=np.uint8(1)  # type: ignore[arg-type]
    ).tolist() == [1, 4, 7]
    assert shard_indices(10, 3, 1, shuffle=np.bool_(False)).tolist() == [1, 4, 7, 0]  # type: ignore[arg-type]


def test_largest_shuffled_length_is_accepted() -> None:
    sampler = DistributedSampler(TORCH_RANDPERM_MAX_N - 1, 1000, 999)  # constructed, not iterated
    assert len(sampler) == -(-(TORCH_RANDPERM_MAX_N - 1) // 1000)
    assert len(DistributedSampler(TORCH_RANDPERM_MAX_N, 1000, 0, shuffle=False)) == 214749


@settings(max_examples=300, deadline=None)
@given(n=st.integers(min_value=0, max_value=700), seed=st.integers(min_value=-(2**63), max_value=2**64 - 1))
def test_torch_randperm_equals_reference(n: int, seed: int) -> None:
    assert torch_randperm(n, seed).tolist() == reference_randperm(n, seed)


def test_torch_randperm_equals_torch_itself_at_sizes_a_dataset_has() -> None:
    torch = pytest.importorskip("torch")
    for n, seed in [(100_000, 0), (100_001, 12345), (1 << 17, 2**40 + 7), (250_000, 2**64 - 1)]:
        generator = torch.Generator()
        generator.manual_seed(seed)
        assert np.array_equal(torch_randperm(n, seed), torch.randperm(n, generator=generator).numpy()), (n, seed)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(min_value=1, max_value=300), seed=st.integers(min_value=0, max_value=2**32 - 1),
       data=st.data())
def test_the_compiled_swap_pass_and_its_python_fallback_agree(n: int, seed: int, data: st.DataObject) -> None:
    from popdist_py import _swaps
    from popdist_py.data import mt19937, swap_pass_in_python

    draws = mt19937(seed).random_raw(data.draw(st.integers(min_value=0, max_value=n), label="draws"))
    compiled, fallback = np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64)
    _swaps.swap_pass(compiled, draws)
    swap_pass_in_python(fallback, draws)
    assert compiled.tolist() == fallback.tolist()


def test_the_compiled_swap_pass_refuses_what_it_cannot_swap() -> None:
    from popdist_py import _swaps

    with pytest.raises(ValueError, match="draws has 3 values, more than order's 2"):
        _swaps.swap_pass(np.arange(2, dtype=np.int64), np.zeros(3, dtype=np.uint64))
    with pytest.raises(ValueError, match="order must be contiguous"):
        _swaps.swap_pass(np.arange(4, dtype=np.int64)[::2], np.zeros(1, dtype=np.uint64))


# ------------------------------------------------------------------------------------------
# shard()


def test_shard_numpy_array_is_fancy_indexed() -> None:
    data = np.arange(20).reshape(10, 2)
    got = shard(data, 3, 1)
    assert isinstance(got, np.ndarray)
    np.testing.assert_array_equal(got, data[[1, 4, 7, 0]])
    got[0, 0] = -1
    assert data[1, 0] == 2  # a copy, not a view


def test_shard_list_tuple_and_other_sequences() -> None:
    assert shard(list("abcdefg"), 2, 1) == ["b", "d", "f", "a"]
    assert shard(tuple("abcdefg"), 2, 1, drop_last=True) == ["b", "d", "f"]
    assert shard(range(100, 107), 2, 0, layout="contiguous") == [100, 101, 102, 103]
    assert shard("abcdef", 3, 2) == ["c", "f"]
    perm = reference_randperm(6, 1 + 2)
    assert shard(list(range(10, 16)), 2, 0, shuffle=True, seed=1, epoch=2) == [10 + int(i) for i in perm[0::2]]


def test_shard_rejects_non_sequences() -> None:
    with pytest.raises(TypeError, match=r"data must be a sequence or array.*got int"):
        shard(5, 2, 0)
    with pytest.raises(TypeError, match=r"got set"):
        shard({1, 2}, 2, 0)
    with pytest.raises(ValueError, match=r"0-d array"):
        shard(np.array(3), 1, 0)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'bogus'"):
        shard([1, 2], 1, 0, bogus=1)


# ------------------------------------------------------------------------------------------
# replica level, batches


def test_replica_shards_explicit_topology() -> None:
    topo: Topology = dict(num_total_replicas=4, num_local_replicas=2, replica_index_offset=2)
    # n=10 over R=4: blocks of 3 from [0..9, 0, 1]; this instance owns global replicas 2 and 3
    assert replica_shard_indices(10, 0, **topo).tolist() == [6, 7, 8]
    assert replica_shard_indices(10, 1, **topo).tolist() == [9, 0, 1]
    assert replica_shard_indices(10, 1, **topo, layout="strided").tolist() == [3, 7, 1]
    assert local_replica_shard_indices(10, **topo).tolist() == [[6, 7, 8], [9, 0, 1]]
    assert local_replica_shard_indices(10, **topo, layout="strided").tolist() == [[2, 6, 0], [3, 7, 1]]
    assert local_replica_shard_indices(10, **topo, drop_last=True).tolist() == [[4, 5], [6, 7]]
    assert instance_batch_slice(12, **topo) == slice(6, 12)


def test_split_for_replicas_is_a_view() -> None:
    batch = np.arange(24).reshape(6, 4)
    split = split_for_replicas(batch, 3)
    assert split.shape == (3, 2, 4)
    assert np.shares_memory(split, batch)
    np.testing.assert_array_equal(split[1], batch[2:4])


def test_split_for_replicas_tuple_and_list() -> None:
    x, y = np.zeros((8, 3)), np.arange(8)
    got = split_for_replicas((x, y), 4)
    assert isinstance(got, tuple) and [a.shape for a in got] == [(4, 2, 3), (4, 2)]
    got = split_for_replicas([x, y], 2)
    assert isinstance(got, tuple) and got[1].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_split_for_replicas_errors_name_size_and_l() -> None:
    with pytest.raises(ValueError, match=r"batch has leading size 7.*num_local_replicas=4"):
        split_for_replicas(np.zeros((7, 2)), 4)
    with pytest.raises(ValueError, match=r"batch\[1\] has leading size 5.*num_local_replicas=2"):
        split_for_replicas((np.zeros(4), np.zeros(5)), 2)
    with pytest.raises(ValueError, match=r"0-d"):
        split_for_replicas(np.float64(1.0), 1)  # type: ignore[call-overload]  # a scalar, refused
    with pytest.raises(ValueError, match=r"num_local_replicas=0.*>= 1"):
        split_for_replicas(np.zeros(4), 0)


def test_global_batch_and_shuffle_buffer_explicit() -> None:
    assert global_batch_size(20, 6, num_total_replicas=16) == 1920  # the reference's example
    assert global_batch_size(3) == 3
    assert shuffle_buffer_size(10, num_instances=4) == 3
    assert shuffle_buffer_size(12, num_instances=4) == 3
    assert shuffle_buffer_size(0, num_instances=4) == 0
    assert shuffle_buffer_size(7) == 7


# ------------------------------------------------------------------------------------------
# defaults from the PopDist environment


def test_defaults_without_env_are_one_instance_one_replica() -> None:
    assert shard_indices(5).tolist() == [0, 1, 2, 3, 4]
    sampler = DistributedSampler(5, shuffle=False)
    assert (sampler.num_replicas, sampler.rank, list(sampler)) == (1, 0, [0, 1, 2, 3, 4])
    assert split_for_replicas(np.arange(3)).shape == (1, 3)
    assert local_replica_shard_indices(4).tolist() == [[0, 1, 2, 3]]
    assert instance_batch_slice(6) == slice(0, 6)


def test_defaults_read_popdist_env(instance_1_of_2: None) -> None:
    assert shard_indices(11).tolist() == [1, 3, 5, 7, 9, 0]
    assert shard_indices(11, drop_last=True).tolist() == [1, 3, 5, 7, 9]
    assert shard(list("abcdef")) == ["b", "d", "f"]
    sampler = DistributedSampler(range(11), shuffle=False)
    assert (sampler.num_replicas, sampler.rank, len(sampler), list(sampler)) == (2, 1, 6, [1, 3, 5, 7, 9, 0])
    assert split_for_replicas(np.arange(8)).tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert replica_shard_indices(16, 0).tolist() == [8, 9]  # global replica 4
    assert replica_shard_indices(16, 3).tolist() == [14, 15]  # global replica 7
    assert local_replica_shard_indices(16).tolist() == [[8, 9], [10, 11], [12, 13], [14, 15]]
    assert local_replica_shard_indices(16, layout="strided").tolist() == [[4, 12], [5, 13], [6, 14], [7, 15]]
    assert instance_batch_slice(16) == slice(8, 16)
    assert global_batch_size(2, 3) == 48
    assert shuffle_buffer_size(11) == 6


def test_explicit_values_override_env(instance_1_of_2: None) -> None:
    assert shard_indices(6, 3, 0).tolist() == [0, 3]
    assert DistributedSampler(6, 3, 2, shuffle=False).rank == 2
    assert split_for_replicas(np.arange(6), 3).shape == (3, 2)
    # only the offset overridden: R=8 and L=4 still come from the environment
    assert local_replica_shard_indices(8, replica_index_offset=0).tolist() == [[0], [1], [2], [3]]
    assert global_batch_size(2, num_total_replicas=1) == 2
    assert shuffle_buffer_size(11, num_instances=1) == 11


def test_malformed_env_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POPDIST_NUM_TOTAL_REPLICAS", "8")
    monkeypatch.setenv("POPDIST_NUM_LOCAL_REPLICAS", "3")
    monkeypatch.setenv("POPDIST_REPLICA_INDEX_OFFSET", "0")
    with pytest.raises(ValueError, match=r"POPDIST_NUM_TOTAL_REPLICAS=8 is not a multiple"):
        shard_indices(10)


# ------------------------------------------------------------------------------------------
# errors name the value and what would be valid


TOPO: Topology = dict(num_total_replicas=4, num_local_replicas=2, replica_index_offset=2)


# The ignored arg-type errors below are the point: values the signatures refuse, which the
# run-time checks must refuse too, naming the value.
@pytest.mark.parametrize(
    ("call", "exc", "pattern"),
    [
        (lambda: shard_indices(10, 3, 3), ValueError, r"index=3 is outside the valid range \[0, 2\] for num_shards=3"),
        (lambda: shard_indices(10, 3, -1), ValueError, r"index=-1 is outside the valid range \[0, 2\]"),
        (lambda: shard_indices(10, 0, 0), ValueError, r"num_shards=0 .*>= 1"),
        (lambda: shard_indices(10, -2, 0), ValueError, r"num_shards=-2 .*>= 1"),
        (lambda: shard_indices(-1, 2, 0), ValueError, r"n=-1 .*>= 0"),
        (lambda: shard_indices(10.0, 2, 0), TypeError,  # type: ignore[arg-type]
         r"n must be an integer, got 10.0 of type float"),
        (lambda: shard_indices(True, 2, 0), TypeError, r"n must be an integer, got True of type bool"),
        (lambda: shard_indices(10, True, 0), TypeError, r"num_shards must be an integer, got True"),
        (lambda: shard_indices(10, 2, np.bool_(True)), TypeError,  # type: ignore[arg-type]
         r"index must be an integer, got .*True"),
        (lambda: shard_indices(10, 2, "1"), TypeError,  # type: ignore[arg-type]
         r"index must be an integer, got '1' of type str"),
        (lambda: shard_indices(10, 2, 0, shuffle=True, seed=2**64), ValueError,
         r"seed \+ epoch = 18446744073709551616 is outside the seeds torch accepts"),
        (lambda: shard_indices(10, 2, 0, shuffle=True, seed=-(2**63) - 1), ValueError, r"outside the seeds torch"),
        (lambda: shard_indices(10, 2, 0, epoch=-3), ValueError, r"epoch=-3 .*>= 0"),
        (lambda: shard_indices(10, 2, 0, shuffle=2), ValueError,  # type: ignore[arg-type]
         r"shuffle=2 is invalid: it must be True, False, 0 or 1"),
        (lambda: shard_indices(10, 2, 0, drop_last="no"), TypeError,  # type: ignore[arg-type]
         r"drop_last must be True, False, 0 or 1, got 'no' of type str"),
        (lambda: DistributedSampler(10, 2, 0, shuffle="yes"), TypeError,  # type: ignore[arg-type]
         r"shuffle must be True, False, 0 or 1, got 'yes' of type str"),
        (lambda: DistributedSampler(10, 2, 0, shuffle=2), ValueError,  # type: ignore[arg-type]
         r"shuffle=2 is invalid"),
        (lambda: DistributedSampler(10, 2, 0, drop_last=-1), ValueError,  # type: ignore[arg-type]
         r"drop_last=-1 is invalid"),
        (lambda: DistributedSampler(10, 2, 0, drop_last=None), TypeError,  # type: ignore[arg-type]
         r"drop_last must be .*got None"),
        (lambda: DistributedSampler(10, 2, 0, shuffle=1.0), TypeError,  # type: ignore[arg-type]
         r"shuffle must be .*got 1.0 of type float"),
        (lambda: DistributedSampler(TORCH_RANDPERM_MAX_N, 2, 0), ValueError,
         r"shuffling n=214748364 samples is not supported: .*only for n < 214748364"),
        (lambda: shard_indices(TORCH_RANDPERM_MAX_N, 2, 0, shuffle=True), ValueError, r"shuffling n=214748364"),
        (lambda: torch_randperm(-1, 0), ValueError, r"n=-1 .*>= 0"),
        (lambda: torch_randperm(3, 0.5), TypeError, r"seed must be an integer, got 0.5"),  # type: ignore[arg-type]
        (lambda: shard_indices(10, 2, 0, layout="blocks"), ValueError,  # type: ignore[arg-type]
         r"layout='blocks' .*'strided', 'contiguous'"),
        (lambda: DistributedSampler(10, 4, 4), ValueError,
         r"rank=4 is outside the valid range \[0, 3\] for num_replicas=4"),
        (lambda: DistributedSampler(10, 0, 0), ValueError, r"num_replicas=0 .*>= 1"),
        (lambda: DistributedSampler(10, 2, 0, seed=1.5), TypeError,  # type: ignore[arg-type]
         r"seed must be an integer, got 1.5"),
        (lambda: DistributedSampler(-5, 2, 0), ValueError, r"dataset length=-5 .*>= 0"),
        (lambda: DistributedSampler(object(), 2, 0), TypeError,  # type: ignore[arg-type]
         r"integer length or an object with __len__.*object"),
        (lambda: DistributedSampler(False, 2, 0), TypeError, r"got False of type bool"),
        (lambda: DistributedSampler(10, 2, 0).set_epoch(-1), ValueError, r"epoch=-1 .*>= 0"),
        (lambda: DistributedSampler(10, 2, 0).set_epoch(1.0), TypeError,  # type: ignore[arg-type]
         r"epoch must be an integer, got 1.0"),
        (lambda: replica_shard_indices(10, 2, **TOPO), ValueError,
         r"local_replica=2 is outside the valid range \[0, 1\] for num_local_replicas=2"),
        (lambda: replica_shard_indices(10, 0, num_total_replicas=4, num_local_replicas=2, replica_index_offset=3),
         ValueError,
         r"replica_index_offset=3 \+ num_local_replicas=2 exceeds num_total_replicas=4: the offset must be at most 2"),
        (lambda: local_replica_shard_indices(10, num_total_replicas=0, num_local_replicas=1, replica_index_offset=0),
         ValueError, r"num_total_replicas=0 .*>= 1"),
        (lambda: local_replica_shard_indices(10, num_total_replicas=4, num_local_replicas=2, replica_index_offset=-2),
         ValueError, r"replica_index_offset=-2 .*>= 0"),
        (lambda: instance_batch_slice(10, **TOPO), ValueError,
         r"global_batch_size=10 is not divisible by num_total_replicas=4.*multiple of 4"),
        (lambda: instance_batch_slice(-4, **TOPO), ValueError, r"global_batch_size=-4 .*>= 0"),
        (lambda: global_batch_size(0), ValueError, r"micro_batch_size=0 .*>= 1"),
        (lambda: global_batch_size(2, -1), ValueError, r"gradient_accumulation=-1 .*>= 1"),
        (lambda: global_batch_size(2, True), TypeError, r"gradient_accumulation must be an integer, got True"),
        (lambda: global_batch_size(2.5), TypeError,  # type: ignore[arg-type]
         r"micro_batch_size must be an integer, got 2.5"),
        (lambda: shuffle_buffer_size(-3), ValueError, r"n=-3 .*>= 0"),
        (lambda: shuffle_buffer_size(10, num_instances=0), ValueError, r"num_instances=0 .*>= 1"),
        (lambda: split_for_replicas(np.zeros(4), False), TypeError,
         r"num_local_replicas must be an integer, got False"),
    ],
)
def test_errors_name_the_value(call: Callable[[], object], exc: type[Exception], pattern: str) -> None:
    with pytest.raises(exc, match=pattern):
        call()


# ------------------------------------------------------------------------------------------
# properties


sizes = st.integers(min_value=0, max_value=120)
counts = st.integers(min_value=1, max_value=6)
seeds = st.integers(min_value=-(2**40), max_value=2**40)
epochs = st.integers(min_value=0, max_value=50)


@PROPS
@given(n=sizes, k=st.integers(min_value=1, max_value=9), shuffle=st.booleans(), seed=seeds, epoch=epochs,
       drop_last=st.booleans())
def test_strided_matches_torch_reference(n: int, k: int, shuffle: bool, seed: int, epoch: int, drop_last: bool) -> None:
    for rank in range(k):
        expected = torch_reference(n, k, rank, shuffle, seed, epoch, drop_last)
        got = shard_indices(n, k, rank, shuffle=shuffle, seed=seed, epoch=epoch, drop_last=drop_last)
        assert got.tolist() == expected
        sampler = DistributedSampler(n, k, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        sampler.set_epoch(epoch)
        assert len(sampler) == len(expected)
        assert list(sampler) == expected


def _check_cover(shards: list[np.ndarray], n: int, k: int, drop_last: bool) -> None:
    assert len(shards) == k
    flat = np.concatenate(shards) if shards else np.array([], dtype=np.int64)
    if drop_last:
        assert all(len(s) == n // k for s in shards)
        assert len(np.unique(flat)) == len(flat)  # disjoint
    else:
        assert all(len(s) == -(-n // k) for s in shards)
        assert set(flat.tolist()) == set(range(n))  # the union covers every index
        # only padding repeats: each index appears once, plus at most ceil(pad / n) more times
        if n:
            counts_ = np.bincount(flat, minlength=n)
            assert counts_.min() >= 1 and counts_.sum() - n == k * -(-n // k) - n


@PROPS
@given(n=sizes, instances=counts, local=counts, shuffle=st.booleans(), seed=seeds, epoch=epochs,
       drop_last=st.booleans(), layout=st.sampled_from(["strided", "contiguous"]))
def test_shards_over_instances_and_replicas_cover_the_data(
    n: int, instances: int, local: int, shuffle: bool, seed: int, epoch: int, drop_last: bool, layout: SplitOrder
) -> None:
    opts: ShardOptions = dict(shuffle=shuffle, seed=seed, epoch=epoch, drop_last=drop_last, layout=layout)
    total = instances * local
    by_instance = [shard_indices(n, instances, i, **opts) for i in range(instances)]
    _check_cover(by_instance, n, instances, drop_last)

    by_replica = []
    for i in range(instances):
        topo: Topology = dict(num_total_replicas=total, num_local_replicas=local, replica_index_offset=i * local)
        stacked = local_replica_shard_indices(n, **topo, **opts)
        rows = [replica_shard_indices(n, r, **topo, **opts) for r in range(local)]
        per = n // total if drop_last else -(-n // total)
        assert stacked.shape == (local, per)
        for r in range(local):
            np.testing.assert_array_equal(stacked[r], rows[r])
            # global replica offset + r gets the same shard as a plain shard over R replicas
            np.testing.assert_array_equal(rows[r], shard_indices(n, total, i * local + r, **opts))
        by_replica.extend(rows)
    _check_cover(by_replica, n, total, drop_last)


@PROPS
@given(n=sizes, instances=counts, local=counts, shuffle=st.booleans(), seed=seeds, epoch=epochs,
       drop_last=st.booleans())
def test_contiguous_instance_block_split_equals_global_replica_shards(
    n: int, instances: int, local: int, shuffle: bool, seed: int, epoch: int, drop_last: bool
) -> None:
    opts: Shuffling = dict(shuffle=shuffle, seed=seed, epoch=epoch, drop_last=drop_last)
    total = instances * local
    blocks = []
    for i in range(instances):
        topo: Topology = dict(num_total_replicas=total, num_local_replicas=local, replica_index_offset=i * local)
        stacked = local_replica_shard_indices(n, **topo, **opts)
        block = stacked.reshape(-1)  # the instance's one contiguous block
        blocks.append(block)
        split = split_for_replicas(block, local)
        for r in range(local):
            np.testing.assert_array_equal(split[r], replica_shard_indices(n, r, **topo, **opts))
    # instance blocks in instance order are the whole R-way list, as a global batch is split
    full = np.concatenate(blocks)
    np.testing.assert_array_equal(full, np.concatenate([shard_indices(n, total, g, layout="contiguous", **opts)
                                                        for g in range(total)]))


@PROPS
@given(per_replica_items=st.integers(min_value=0, max_value=10), instances=counts, local=counts,
       shuffle=st.booleans(), seed=seeds, epoch=epochs, drop_last=st.booleans())
def test_instance_shard_then_split_equals_replica_shard_when_divisible(
    per_replica_items: int, instances: int, local: int, shuffle: bool, seed: int, epoch: int, drop_last: bool
) -> None:
    total = instances * local
    n = per_replica_items * total
    opts: ShardOptions = dict(shuffle=shuffle, seed=seed, epoch=epoch, drop_last=drop_last, layout="contiguous")
    for i in range(instances):
        split = split_for_replicas(shard_indices(n, instances, i, **opts), local)
        topo: Topology = dict(num_total_replicas=total, num_local_replicas=local, replica_index_offset=i * local)
        np.testing.assert_array_equal(split, local_replica_shard_indices(n, **topo, **opts))


@PROPS
@given(micro=st.integers(min_value=1, max_value=8), instances=counts, local=counts)
def test_instance_batch_slices_split_a_global_batch_in_replica_order(micro: int, instances: int, local: int) -> None:
    total = instances * local
    global_batch = np.arange(global_batch_size(micro, num_total_replicas=total))
    for i in range(instances):
        topo: Topology = dict(num_total_replicas=total, num_local_replicas=local, replica_index_offset=i * local)
        part = split_for_replicas(global_batch[instance_batch_slice(len(global_batch), **topo)], local)
        assert part.shape == (local, micro)
        for r in range(local):
            g = i * local + r
            assert part[r].tolist() == list(range(g * micro, (g + 1) * micro))
            assert part[r].tolist() == replica_shard_indices(len(global_batch), r, **topo).tolist()


@PROPS
@given(n=st.integers(min_value=20, max_value=120), k=counts, seed=seeds, epoch=epochs)
def test_shuffle_identical_across_ranks_and_different_across_epochs(n: int, k: int, seed: int, epoch: int) -> None:
    def interleaved(e: int) -> np.ndarray:
        # drop_last keeps shards disjoint iff every rank used the same permutation
        shards = [shard_indices(n, k, r, shuffle=True, seed=seed, epoch=e, drop_last=True) for r in range(k)]
        out = np.empty(k * len(shards[0]), dtype=np.int64)
        for r, s in enumerate(shards):
            out[r::k] = s
        return out

    now, later = interleaved(epoch), interleaved(epoch + 1)
    perm = torch_randperm(n, seed + epoch)
    np.testing.assert_array_equal(now, perm[: len(now)])
    assert len(np.unique(now)) == len(now)
    assert not np.array_equal(now, later)


@PROPS
@given(n=sizes, instances=counts)
def test_shuffle_buffer_is_the_largest_instance_share(n: int, instances: int) -> None:
    size = shuffle_buffer_size(n, num_instances=instances)
    assert size == max(len(shard_indices(n, instances, i)) for i in range(instances))
    assert size * instances >= n > (size - 1) * instances or n == 0
