"""Dataset sharding helpers: which samples this instance (or replica) reads, and batch shapes.

Every instance must read a disjoint part of the same dataset in the same order, so every index
list is computed from ``n``, ``seed + epoch`` and the topology alone: any instance can recompute
any other's shard, and no communication is needed.

Two layouts of a shard over ``k`` shards exist; both pad (repeat the head of the index list) or
drop (cut the tail) so every shard has the same length, which keeps every instance doing the same
number of steps (an instance with one batch fewer would hang its peers at the next collective):

``"strided"`` (torch ``DistributedSampler``): shard ``r`` takes ``indices[r::k]``.
    The default for instance-level sharding (``shard_indices``, ``shard``,
    ``DistributedSampler``), so PyTorch-style programs behave as they do with torch.
``"contiguous"``: shard ``r`` takes the block ``indices[r*p:(r+1)*p]``.
    The default for replica-level sharding (``replica_shard_indices``,
    ``local_replica_shard_indices``), because only with blocks does the split of R replicas into
    I instances x L local replicas not matter: global replica ``g = offset + r`` owns block ``g``,
    instance ``i`` owns the union of blocks ``i*L .. i*L+L-1``, which is itself one block, the
    same way ``instance_batch_slice`` cuts a global batch.

Defaults come from the PopDist environment (``popdist_py.topology`` / ``popdist_py.api``); without it
everything answers as one instance with one replica, i.e. no sharding.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Sequence, Sized
from typing import Any, Literal, TypeVar, get_args, overload

import numpy as np

from popcontract import compiled
from popdist_py import validate
from popdist_py.api import getInstanceIndex, getNumInstances, getNumLocalReplicas
from popdist_py.topology import Topology, read_topology

__all__ = [
    "TORCH_RANDPERM_MAX_N",
    "DistributedSampler",
    "global_batch_size",
    "instance_batch_slice",
    "local_replica_shard_indices",
    "replica_shard_indices",
    "shard",
    "shard_indices",
    "shuffle_buffer_size",
    "split_for_replicas",
    "torch_randperm",
]

#: How a dataset is cut into shards: every k-th sample (``strided``) or consecutive blocks.
SplitOrder = Literal["strided", "contiguous"]
SPLIT_ORDERS: tuple[SplitOrder, ...] = get_args(SplitOrder)

T = TypeVar("T")


# --------------------------------------------------------------------------------------------
# argument checks: messages name the value and what would be valid


def _split_order(value: object) -> SplitOrder:
    """The ``layout=`` argument, one of :data:`SPLIT_ORDERS`."""
    for order in SPLIT_ORDERS:
        if value == order:
            return order
    raise ValueError(f"layout={value!r} is invalid: it must be one of {', '.join(map(repr, SPLIT_ORDERS))}")


def _length(dataset_or_length: object) -> int:
    if isinstance(dataset_or_length, (int, np.integer)) and not isinstance(dataset_or_length, (bool, np.bool_)):
        return validate.integer("dataset length", dataset_or_length, 0)
    if isinstance(dataset_or_length, Sized):
        return len(dataset_or_length)
    raise TypeError(
        f"dataset_or_length must be an integer length or an object with __len__, got {dataset_or_length!r} "
        f"of type {type(dataset_or_length).__name__}"
    )


#: torch's ``randperm`` on the CPU uses the swap pass below only for ``n`` under this
#: (``std::numeric_limits<uint32_t>::max() / 20``); from it on, another algorithm on 64-bit draws.
TORCH_RANDPERM_MAX_N = 0xFFFFFFFF // 20

#: The seeds torch's ``Generator.manual_seed`` accepts: an int64 or a uint64.
_TORCH_SEEDS = range(-(2**63), 2**64)


def mt19937(seed: int) -> np.random.MT19937:
    """An MT19937 seeded as torch's (and the reference ``init_genrand``): from the low 32 bits of ``seed``.

    numpy's ``MT19937(seed)`` seeds through a SeedSequence instead, so the state is built here and
    set through the public ``state`` setter; ``pos=624`` makes the first draw regenerate the key.
    """
    key = [seed & 0xFFFFFFFF]
    for j in range(1, 624):
        key.append((1812433253 * (key[-1] ^ (key[-1] >> 30)) + j) & 0xFFFFFFFF)
    generator = np.random.MT19937()
    generator.state = {"bit_generator": "MT19937", "state": {"key": np.array(key, dtype=np.uint32), "pos": 624}}
    return generator


def torch_randperm(n: int, seed: int) -> np.ndarray:
    """``torch.randperm(n, generator=g).tolist()`` after ``g.manual_seed(seed)``, on the CPU, without torch.

    torch (``randperm_cpu``) swaps ``r[i]`` with ``r[i + z]``, ``z = next32() % (n - i)``, for
    ``i = 0 .. n-2`` over ``r = 0 .. n-1``, where ``next32`` is its mt19937 seeded with the low 32
    bits of ``seed`` (any ``seed`` torch accepts, negative ones as their two's complement). The
    n-1 draws are made at once; the swaps are a compiled loop (``_swaps.c``; about 0.1 s for n = 10**7).
    ``n >= TORCH_RANDPERM_MAX_N`` (214748364) raises ValueError: torch uses another algorithm there,
    which is not reproduced. A seed outside torch's ``[-2**63, 2**64)`` raises ValueError, as torch.
    """
    n, seed = validate.integer("n", n, 0), validate.integer("seed", seed)
    if n >= TORCH_RANDPERM_MAX_N:
        raise ValueError(
            f"shuffling n={n} samples is not supported: torch's randperm order is reproduced only for "
            f"n < {TORCH_RANDPERM_MAX_N}"
        )
    if seed not in _TORCH_SEEDS:
        raise ValueError(f"seed + epoch = {seed} is outside the seeds torch accepts, [-2**63, 2**64)")
    if n < 2:
        return np.arange(n, dtype=np.int64)
    order = np.arange(n, dtype=np.int64)
    _swap_pass(order, mt19937(seed).random_raw(n - 1))  # raw 32-bit outputs, as uint64
    return order


def swap_pass_in_python(order: np.ndarray, draws: np.ndarray) -> None:
    """``order[i]`` swapped with ``order[i + draws[i] % (n - i)]`` for each ``i`` in turn:
    ``_swaps.swap_pass`` where it was not built (about 50 times slower)."""
    n = len(order)
    targets = (draws % np.arange(n, n - len(draws), -1, dtype=np.uint64)
               + np.arange(len(draws), dtype=np.uint64)).tolist()
    listed = order.tolist()
    for i, j in enumerate(targets):
        listed[i], listed[j] = listed[j], listed[i]
    order[:] = listed


_swaps = compiled.load(compiled.SWAPS)
_swap_pass = swap_pass_in_python if _swaps is None else _swaps.swap_pass


def _order(n: int, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """The dataset order before sharding: the same on every instance, which keeps shards disjoint.

    Shuffled, it is torch's ``randperm(n)`` from ``seed + epoch`` (``torch_randperm``), as in
    torch's ``DistributedSampler``.
    """
    if shuffle:
        return torch_randperm(n, seed + epoch)
    return np.arange(n, dtype=np.int64)


def _per_shard(n: int, num_shards: int, drop_last: bool) -> int:
    # torch writes the drop_last case as ceil((n - k) / k) when k does not divide n: that is n // k.
    return n // num_shards if drop_last else -(-n // num_shards)


def _fit(indices: np.ndarray, total: int) -> np.ndarray:
    """Cut the tail, or pad by repeating the list from its head as often as needed (as torch)."""
    if total <= len(indices):
        return indices[:total]
    return np.resize(indices, total)  # np.resize repeats cyclically: head, head, ...


def _take(full: np.ndarray, num_shards: int, index: int, layout: SplitOrder) -> np.ndarray:
    if layout == "strided":
        return full[index::num_shards]
    per = len(full) // num_shards
    return full[index * per : (index + 1) * per]


def _sharded(n: int, num_shards: int, shuffle: bool, seed: int, epoch: int, drop_last: bool) -> np.ndarray:
    """The ordered, padded or cut list of ``num_shards x per_shard`` indices that shards are cut from."""
    return _fit(_order(n, shuffle, seed, epoch), num_shards * _per_shard(n, num_shards, drop_last))


def _common(
    n: object, seed: object, epoch: object, shuffle: object, drop_last: object
) -> tuple[int, int, int, bool, bool]:
    return (
        validate.integer("n", n, 0),
        validate.integer("seed", seed),  # any int, as torch: the shuffle uses its low 32 bits
        validate.integer("epoch", epoch, 0),
        _flag("shuffle", shuffle),
        _flag("drop_last", drop_last),
    )


def _flag(name: str, value: object) -> bool:
    """True or False, or the integers 0 and 1 that torch programs also pass (``shuffle=1``)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)):
        if value in (0, 1):
            return bool(value)
        raise ValueError(f"{name}={value!r} is invalid: it must be True, False, 0 or 1")
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be True, False, 0 or 1, got {value!r} of type {type(value).__name__}")


# --------------------------------------------------------------------------------------------
# instance-level sharding


def shard_indices(
    n: int,
    num_shards: int | None = None,
    index: int | None = None,
    *,
    shuffle: bool = False,
    seed: int = 0,
    epoch: int = 0,
    drop_last: bool = False,
    layout: SplitOrder = "strided",
) -> np.ndarray:
    """The int64 indices of shard ``index`` of ``num_shards`` (default: this instance of all instances).

    Same contract as ``DistributedSampler``: ``ceil(n/k)`` indices per shard, padded by repeating
    the head of the list, or ``floor(n/k)`` with ``drop_last`` (tail cut). Shuffling permutes as
    torch's ``randperm`` from ``seed + epoch`` (``torch_randperm``: any int seed, ``n < 214748364``)
    before sharding, identically on every instance.
    ``layout`` picks ``indices[index::k]`` ("strided", torch) or the ``index``-th block ("contiguous").
    """
    n, seed, epoch, shuffle, drop_last = _common(n, seed, epoch, shuffle, drop_last)
    layout = _split_order(layout)
    num_shards = validate.integer("num_shards", getNumInstances() if num_shards is None else num_shards, 1)
    index = validate.index("index", getInstanceIndex() if index is None else index, "num_shards", num_shards)
    return _take(_sharded(n, num_shards, shuffle, seed, epoch, drop_last), num_shards, index, layout)


@overload
def shard(data: np.ndarray, num_shards: int | None = ..., index: int | None = ..., **options: Any) -> np.ndarray: ...
@overload
def shard(data: Sequence[T], num_shards: int | None = ..., index: int | None = ..., **options: Any) -> list[T]: ...
@overload
def shard(data: Any, num_shards: int | None = ..., index: int | None = ..., **options: Any) -> list[Any]: ...


def shard(data: Any, num_shards: int | None = None, index: int | None = None, **options: Any) -> np.ndarray | list[Any]:
    """This instance's part of ``data`` (any sequence or array), by ``shard_indices(len(data), ...)``.

    Arrays are fancy-indexed along their first axis (a copy, so later writes to ``data`` do not
    leak into the shard); other indexable sequences give a list of their items.
    ``options`` are ``shard_indices``'s keywords (shuffle, seed, epoch, drop_last, layout).
    """
    if not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        raise TypeError(
            f"data must be a sequence or array (with __getitem__ and __len__), got {type(data).__name__}"
        )
    if isinstance(data, np.ndarray):
        if data.ndim == 0:
            raise ValueError(f"data is a 0-d array ({data!r}); it has no leading axis to shard")
        part: np.ndarray = data[shard_indices(len(data), num_shards, index, **options)]
        return part
    return [data[i] for i in shard_indices(len(data), num_shards, index, **options).tolist()]


class DistributedSampler:
    """A sampler with the contract of ``torch.utils.data.DistributedSampler`` (duck-typed, no torch).

    Defaults shard by instance: each instance feeds all its local replicas from its shard, so the
    instance, not the replica, is the unit of data loading. Pass it as ``DataLoader(sampler=...)``
    and call ``set_epoch(epoch)`` every epoch, or every epoch repeats the same order.

    The order is torch's, shuffled too: ``randperm`` from ``seed + epoch`` is reproduced exactly
    (``torch_randperm``). Shuffling a dataset of 214748364 samples or more raises ValueError at
    construction, since torch switches algorithm there (no fallback). ``shuffle`` and ``drop_last``
    take bools or 0/1; ``seed`` any int (torch uses the low 32 bits of ``seed + epoch``; a sum
    outside torch's ``[-2**63, 2**64)`` raises ValueError at iteration, as torch does).
    """

    def __init__(
        self,
        dataset_or_length: Sized | int,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        self.dataset = dataset_or_length
        self.num_replicas: int = validate.count("num_replicas",
                                                getNumInstances() if num_replicas is None else num_replicas)
        self.rank: int = validate.index("rank", getInstanceIndex() if rank is None else rank, "num_replicas",
                                        self.num_replicas)
        self.shuffle: bool = _flag("shuffle", shuffle)
        self.seed: int = validate.integer("seed", seed)
        self.drop_last: bool = _flag("drop_last", drop_last)
        self.epoch: int = 0
        # Fixed now, as torch does: every rank must agree on the length for the whole run.
        self._n: int = _length(dataset_or_length)
        if self.shuffle and self._n >= TORCH_RANDPERM_MAX_N:
            torch_randperm(self._n, self.seed)  # raises now, not at the first epoch
        self.num_samples: int = _per_shard(self._n, self.num_replicas, self.drop_last)
        self.total_size: int = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        full = _sharded(self._n, self.num_replicas, self.shuffle, self.seed, self.epoch, self.drop_last)
        # Plain ints: numpy scalars surprise code that checks isinstance(i, int) or serialises them.
        return iter(full[self.rank :: self.num_replicas].tolist())

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Reseed the shuffle with ``seed + epoch``; all ranks must pass the same epoch."""
        self.epoch = validate.integer("epoch", epoch, 0)

    def __repr__(self) -> str:
        return (
            f"DistributedSampler(n={self._n}, num_replicas={self.num_replicas}, rank={self.rank}, "
            f"shuffle={self.shuffle}, seed={self.seed}, drop_last={self.drop_last}, epoch={self.epoch})"
        )


# --------------------------------------------------------------------------------------------
# replica-level sharding


def _replicas(
    num_total_replicas: int | None, num_local_replicas: int | None, replica_index_offset: int | None
) -> tuple[int, int, int]:
    """R, L and offset: given values win, the rest come from the environment, then are cross-checked."""
    given = (num_total_replicas, num_local_replicas, replica_index_offset)
    topo = read_topology() if any(value is None for value in given) else Topology()
    total = validate.count("num_total_replicas",
                           topo.num_total_replicas if num_total_replicas is None else num_total_replicas)
    local = validate.count("num_local_replicas",
                           topo.num_local_replicas if num_local_replicas is None else num_local_replicas)
    offset = validate.integer(
        "replica_index_offset", topo.replica_index_offset if replica_index_offset is None else replica_index_offset, 0
    )
    if offset + local > total:
        raise ValueError(
            f"replica_index_offset={offset} + num_local_replicas={local} exceeds num_total_replicas={total}: "
            f"the offset must be at most {total - local}"
        )
    return total, local, offset


def replica_shard_indices(
    n: int,
    local_replica: int = 0,
    *,
    num_total_replicas: int | None = None,
    num_local_replicas: int | None = None,
    replica_index_offset: int | None = None,
    shuffle: bool = False,
    seed: int = 0,
    epoch: int = 0,
    drop_last: bool = False,
    layout: SplitOrder = "contiguous",
) -> np.ndarray:
    """The indices of one replica's shard over all R replicas: global replica ``offset + local_replica``.

    For programs that feed each replica separately. ``layout="contiguous"`` (default) keeps
    replica ``g``'s block inside its instance's block (see the module docstring); "strided" gives
    torch's ``indices[g::R]``. Topology values default to the PopDist environment.
    """
    n, seed, epoch, shuffle, drop_last = _common(n, seed, epoch, shuffle, drop_last)
    layout = _split_order(layout)
    total, local, offset = _replicas(num_total_replicas, num_local_replicas, replica_index_offset)
    local_replica = validate.index("local_replica", local_replica, "num_local_replicas", local)
    full = _sharded(n, total, shuffle, seed, epoch, drop_last)
    return _take(full, total, offset + local_replica, layout)


def local_replica_shard_indices(
    n: int,
    *,
    num_total_replicas: int | None = None,
    num_local_replicas: int | None = None,
    replica_index_offset: int | None = None,
    shuffle: bool = False,
    seed: int = 0,
    epoch: int = 0,
    drop_last: bool = False,
    layout: SplitOrder = "contiguous",
) -> np.ndarray:
    """This instance's L replica shards stacked ``[L, per_replica]``: row r is ``replica_shard_indices(n, r)``.

    Indexing data with it gives the ``[L, B, ...]`` arrays the engine takes. With the default
    "contiguous" layout, ``.reshape(-1)`` is the instance's one block of the R-way split, and
    ``split_for_replicas`` of that block gives these rows back: sharding by instance then by
    local replica equals sharding by global replica, whatever ``n``.
    """
    n, seed, epoch, shuffle, drop_last = _common(n, seed, epoch, shuffle, drop_last)
    layout = _split_order(layout)
    total, local, offset = _replicas(num_total_replicas, num_local_replicas, replica_index_offset)
    full = _sharded(n, total, shuffle, seed, epoch, drop_last)
    per = len(full) // total
    if layout == "contiguous":
        return full[offset * per : (offset + local) * per].reshape(local, per)
    return full.reshape(per, total)[:, offset : offset + local].T.copy()


def instance_batch_slice(
    global_batch_size: int,
    *,
    num_total_replicas: int | None = None,
    num_local_replicas: int | None = None,
    replica_index_offset: int | None = None,
) -> slice:
    """This instance's part ``[i*L*B, (i+1)*L*B)`` of a global batch of ``R*B`` samples.

    A global batch is split over replicas in global replica order (docs/design.md), so every instance
    can load the same global batch, cut this block and ``split_for_replicas`` it: replica ``g``
    then gets samples ``[g*B, (g+1)*B)``, independent of how replicas are spread over instances.
    """
    size = validate.integer("global_batch_size", global_batch_size, 0)
    total, local, offset = _replicas(num_total_replicas, num_local_replicas, replica_index_offset)
    if size % total:
        raise ValueError(
            f"global_batch_size={size} is not divisible by num_total_replicas={total}: "
            f"use a multiple of {total} so every replica gets the same micro-batch"
        )
    per_replica = size // total
    return slice(offset * per_replica, (offset + local) * per_replica)


# --------------------------------------------------------------------------------------------
# batch shapes and sizes


@overload
def split_for_replicas(batch: np.ndarray, num_local_replicas: int | None = ...) -> np.ndarray: ...
@overload
def split_for_replicas(
    batch: tuple[Any, ...] | list[Any], num_local_replicas: int | None = ...
) -> tuple[np.ndarray, ...]: ...


def split_for_replicas(
    batch: np.ndarray | tuple[Any, ...] | list[Any], num_local_replicas: int | None = None
) -> np.ndarray | tuple[np.ndarray, ...]:
    """Reshape an instance's host batch ``[L*B, ...]`` to ``[L, B, ...]`` (a view when possible).

    Replica ``r`` gets rows ``[r*B, (r+1)*B)``, the same contiguous order as ``instance_batch_slice``.
    A tuple or list of arrays (inputs, labels, ...) is split element-wise and returned as a tuple.
    """
    local = validate.count("num_local_replicas",
                           getNumLocalReplicas() if num_local_replicas is None else num_local_replicas)
    if isinstance(batch, (tuple, list)):
        return tuple(_split_one(f"batch[{i}]", item, local) for i, item in enumerate(batch))
    return _split_one("batch", batch, local)


def _split_one(name: str, batch: Any, local: int) -> np.ndarray:
    array = np.asarray(batch)
    if array.ndim == 0:
        raise ValueError(f"{name} is a 0-d value ({array!r}); it needs a leading batch axis of size L*B")
    lead = array.shape[0]
    if lead % local:
        raise ValueError(
            f"{name} has leading size {lead}, which is not divisible by num_local_replicas={local}: "
            f"it must be a multiple of {local} (L*B)"
        )
    return array.reshape(local, lead // local, *array.shape[1:])


def global_batch_size(
    micro_batch_size: int, gradient_accumulation: int = 1, *, num_total_replicas: int | None = None
) -> int:
    """Samples per weight update: micro-batch x gradient accumulation x total replicas (R, default from PopDist).

    Learning-rate scaling and epoch step counts depend on this, not on the per-replica batch.
    """
    micro = validate.integer("micro_batch_size", micro_batch_size, 1)
    accumulation = validate.integer("gradient_accumulation", gradient_accumulation, 1)
    if num_total_replicas is None:
        num_total_replicas = read_topology().num_total_replicas
    total = validate.integer("num_total_replicas", num_total_replicas, 1)
    return micro * accumulation * total


def shuffle_buffer_size(n: int, *, num_instances: int | None = None) -> int:
    """This instance's share of ``n`` samples: ``ceil(n / num_instances)`` (default from PopDist).

    A shuffle buffer applied after sharding (as TF programs do) only ever holds this instance's
    shard, so a buffer this large shuffles the whole shard; ceil so the largest shard also fits.
    ``n == 0`` gives 0; frameworks that need a positive buffer should use ``max(1, ...)``.
    """
    n = validate.integer("n", n, 0)
    instances = validate.integer("num_instances", getNumInstances() if num_instances is None else num_instances, 1)
    return -(-n // instances)
