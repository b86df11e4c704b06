"""PopART's tensor location settings and training options in Python spelling, and the one
placement each tensor gets from them.

PopART decides where whole classes of tensors live through settings rather than tensor by tensor;
here the same reads::

    opts = TrainingOptions(accumulation_factor=4)
    opts.optimizer_state_tensor_location_settings.location.replicated_tensor_sharding = True
    opts.optimizer_state_tensor_location_settings.min_elements_for_replicated_tensor_sharding = R
    opts.optimizer_state_tensor_location_settings.location.sharding_domain = CommGroup.consecutive(L)
    opts.weight_tensor_location_settings.location.storage = TensorStorage.OFF_CHIP
    opts.weight_tensor_location_settings.location.load_tile_set = TileSet.IO   # read ahead
    opts.tensor_location_settings_override["W0/exp_avg"] = TensorLocation()    # this one on chip, whole

:func:`place_weights` turns them into one :class:`Placement` per tensor (the weight ``"W0"``, each
optimizer state ``"W0/<state>"``, the accumulator ``"W0/accumulator"``), checking every value
before anything is created. For a tensor of ``n`` elements with class settings ``s`` and location
``loc = override.get(name, s.location)``:

- off chip when ``loc.storage`` is OFF_CHIP and (class settings only) ``n >= s.min_elements_for_off_chip``
  (0-d tensors included);
- sharded when ``loc.replicated_tensor_sharding`` and (class settings only) ``n >=
  s.min_elements_for_replicated_tensor_sharding``, over ``loc.sharding_domain`` (None: all
  replicas; otherwise runs of consecutive replicas such as ``CommGroup.consecutive(L)``);
- read ahead when off chip with ``load_tile_set`` IO (PopART's loadTileSet=IO);
- the update of a weight runs on shards when its optimizer state is sharded (ZeRO-1/2), or, for an
  optimizer without state, when the weight is; a weight's states are placed alike (they are
  updated together), and a sharded weight updated on shards shares their domain (PopART: linked
  tensors need the same sharding domain). A sharded weight whose state is whole is gathered for
  the update and keeps only its shard (ZeRO-3 for the weight alone).
- accumulators sum a batch's micro-batch gradients. Whole, each holds one replica's own sum,
  reduced across replicas once per batch. Off chip, the pending partial sums wait in file-backed
  slots between micro-batches (the same additions, so the same bits). Sharded, each micro-batch's
  gradient is reduce-scattered at once and the accumulator holds this replica's shard of the
  replicas' sum (PopART's accumulator RTS: memory of a shard, a collective per micro-batch); that
  adds over replicas before micro-batches, so the weights equal those of whole accumulators up to
  rounding, not bit for bit (they stay bitwise equal across splits into instances). A sharded
  accumulator needs its weight's update on shards of the same domain (sharded optimizer state, or
  for an optimizer without state a sharded weight): the accumulated shard feeds that update.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from popdist_py import validate
from popdist_py.engine._placement.grouping import CommGroup, ReplicaGrouping
from popdist_py.engine._placement.sharding import sharding_domain

#: PopART's ReductionType names (any case) -> the engine's collective op.
REDUCTIONS = {"mean": "mean", "sum": "add"}


class _Named(enum.Enum):
    """An enum that also takes its names as strings, in PopART's spelling too (``"OffChip"``, ``"io"``)."""

    @classmethod
    def _missing_(cls, value: object) -> Any:
        if isinstance(value, str):
            key = value.replace("_", "").lower()
            for member in cls:
                if member.name.replace("_", "").lower() == key:
                    return member
        return None

    @classmethod
    def parse(cls, value: object, what: str) -> Any:
        try:
            return cls(value)
        except ValueError:
            valid = ", ".join(f"{cls.__name__}.{m.name}" for m in cls)
            raise ValueError(f"{what}={value!r} is not valid: use {valid} (or the name as a string)") from None


class TensorStorage(_Named):
    """PopART's TensorStorage: in process memory (ON_CHIP), or in remote buffers backed by
    memory-mapped files (OFF_CHIP), paged in only while a step uses them."""

    ON_CHIP = "on_chip"
    OFF_CHIP = "off_chip"


class TileSet(_Named):
    """PopART's TileSet, as ``load_tile_set`` of an off-chip tensor: COMPUTE loads it when it is
    needed; IO reads it ahead on a background thread while the tensor before it is worked on."""

    COMPUTE = "compute"
    IO = "io"


class ReplicatedTensorSharding(_Named):
    """PopART's ReplicatedTensorSharding (``replicated_tensor_sharding`` takes True/False too)."""

    OFF = "off"
    ON = "on"


ON_CHIP, OFF_CHIP = TensorStorage.ON_CHIP, TensorStorage.OFF_CHIP
COMPUTE, IO = TileSet.COMPUTE, TileSet.IO


@dataclass
class TensorLocation:
    """Where a tensor lives (PopART's TensorLocation): ``storage``, whether it is sharded over the
    replicas of ``sharding_domain`` (None: all replicas), and how an off-chip tensor is loaded."""

    storage: TensorStorage | str = TensorStorage.ON_CHIP
    replicated_tensor_sharding: bool | ReplicatedTensorSharding | str = False
    sharding_domain: CommGroup | ReplicaGrouping | None = None
    load_tile_set: TileSet | str = TileSet.COMPUTE


@dataclass
class TensorLocationSettings:
    """The location of a class of tensors and the sizes below which a tensor stays on chip or whole
    (PopART's TensorLocationSettings)."""

    location: TensorLocation = field(default_factory=TensorLocation)
    min_elements_for_off_chip: int = 0
    min_elements_for_replicated_tensor_sharding: int = 0


@dataclass
class TrainingOptions:
    """What PopART's SessionOptions say about training: accumulation, reduction, tensor locations.

    ``reduction``: how gradients and losses combine over micro-batches and replicas, ``"mean"`` or
    ``"sum"`` (PopART's ReductionType, any case). ``fused_reduction_bytes``: gradients are reduced in
    buckets of about this size (one collective per bucket, not per tensor).
    """

    accumulation_factor: int = 1
    reduction: str = "mean"
    weight_tensor_location_settings: TensorLocationSettings = field(default_factory=TensorLocationSettings)
    optimizer_state_tensor_location_settings: TensorLocationSettings = field(default_factory=TensorLocationSettings)
    accumulator_tensor_location_settings: TensorLocationSettings = field(default_factory=TensorLocationSettings)
    #: a pipeline's stashed activations: on chip, or off chip (arrays of at least min_elements_for_off_chip)
    activation_tensor_location_settings: TensorLocationSettings = field(default_factory=TensorLocationSettings)
    tensor_location_settings_override: dict[str, TensorLocation] = field(default_factory=dict)
    fused_reduction_bytes: int = 4 << 20

    def check(self) -> None:
        """One clear error for a value that cannot hold whatever the model (see also :func:`place_weights`)."""
        validate.count("TrainingOptions.accumulation_factor", self.accumulation_factor)
        validate.count("TrainingOptions.fused_reduction_bytes", self.fused_reduction_bytes)
        training_reduction(self.reduction)
        for kind in SETTINGS_KINDS:
            what = f"{kind}_tensor_location_settings"
            settings = getattr(self, what)
            if not isinstance(settings, TensorLocationSettings):
                raise TypeError(f"{what} is a {type(settings).__name__}, not a TensorLocationSettings")
            validate.non_negative(f"{what}.min_elements_for_off_chip", settings.min_elements_for_off_chip)
            validate.non_negative(f"{what}.min_elements_for_replicated_tensor_sharding",
                                  settings.min_elements_for_replicated_tensor_sharding)
            _check_location(settings.location, f"{what}.location")
        activations = _check_location(self.activation_tensor_location_settings.location,
                                      "activation_tensor_location_settings.location")
        if activations.sharded:
            raise ValueError("activation_tensor_location_settings.location: replicated_tensor_sharding is not "
                             "supported for activations: each replica's stash holds its own micro-batches' values")
        if not isinstance(self.tensor_location_settings_override, dict):
            raise TypeError("tensor_location_settings_override must be a dict of tensor name -> TensorLocation, got "
                            f"{self.tensor_location_settings_override!r}")
        for name, location in self.tensor_location_settings_override.items():
            _check_location(location, f"tensor_location_settings_override[{name!r}]")


KINDS = ("weight", "optimizer_state", "accumulator")
#: Every class of tensors with location settings (activations: a pipeline's stash, not placed per tensor).
SETTINGS_KINDS = (*KINDS, "activation")


def training_reduction(value: object) -> str:
    """The engine's op for PopART's ReductionType ``value`` ("mean"/"sum" in any case, or an enum
    member of that name); ValueError naming the value otherwise."""
    name = getattr(value, "name", value)
    if isinstance(name, str) and name.lower() in REDUCTIONS:
        return REDUCTIONS[name.lower()]
    raise ValueError(f"TrainingOptions.reduction={value!r} is not valid; use 'mean' or 'sum' "
                     "(PopART's ReductionType Mean or Sum)")


@dataclass(frozen=True)
class Location:
    """A TensorLocation with every field checked and normalised."""

    storage: TensorStorage
    sharded: bool
    domain_arg: CommGroup | ReplicaGrouping | None
    load_tile_set: TileSet


def _check_location(location: object, where: str) -> Location:
    if not isinstance(location, TensorLocation):
        raise TypeError(f"{where} is a {type(location).__name__}, not a TensorLocation")
    rts = location.replicated_tensor_sharding
    if isinstance(rts, (bool, np.bool_)):
        sharded = bool(rts)
    else:
        parsed = ReplicatedTensorSharding.parse(rts, f"{where}.replicated_tensor_sharding")
        sharded = parsed is ReplicatedTensorSharding.ON
    domain = location.sharding_domain
    if domain is not None and not isinstance(domain, (CommGroup, ReplicaGrouping)):
        raise TypeError(f"{where}.sharding_domain={domain!r} is not a CommGroup or ReplicaGrouping")
    return Location(TensorStorage.parse(location.storage, f"{where}.storage"), sharded, domain,
                    TileSet.parse(location.load_tile_set, f"{where}.load_tile_set"))


@dataclass(frozen=True)
class Placement:
    """The resolved location of one tensor."""

    name: str
    off_chip: bool
    sharded: bool
    domain: ReplicaGrouping  # the sharding domain (meaningful when sharded)
    read_ahead: bool

    def describe(self) -> str:
        where = ("off chip" + (", read ahead" if self.read_ahead else "")) if self.off_chip else "on chip"
        return f"{self.name}: {where}, " + (f"sharded over {self.domain.describe()}" if self.sharded else "whole")


@dataclass(frozen=True)
class WeightPlacement:
    """A weight, its optimizer state tensors and its accumulator, and how its update runs."""

    name: str
    weight: Placement
    states: dict[str, Placement]
    accumulator: Placement
    #: the update runs on this replica's shard of ``domain`` (ZeRO); else on the whole tensor
    update_sharded: bool
    domain: ReplicaGrouping

    def tensors(self) -> list[Placement]:
        return [self.weight, *self.states.values(), self.accumulator]


def state_name(weight: str, state: str) -> str:
    return f"{weight}/{state}"


def accumulator_name(weight: str) -> str:
    return f"{weight}/accumulator"


def place_weights(options: TrainingOptions, everyone: ReplicaGrouping, shapes: dict[str, tuple[int, ...]],
            state_names: tuple[str, ...]) -> dict[str, WeightPlacement]:
    """Every weight's placement (weights ``shapes``: name -> shape, in order) for an optimizer
    with ``state_names`` over the replicas of ``everyone``. Raises TypeError/ValueError naming the
    setting that cannot hold and what would be valid (see the module docstring for the rules)."""
    options.check()
    names = [n for w in shapes for n in (w, *(state_name(w, s) for s in state_names), accumulator_name(w))]
    unknown = [k for k in options.tensor_location_settings_override if k not in names]
    if unknown:
        shown = ", ".join(map(repr, names[:12])) + (", ..." if len(names) > 12 else "")
        raise ValueError(f"tensor_location_settings_override names {', '.join(map(repr, unknown))}, which "
                         f"{'is' if len(unknown) == 1 else 'are'} not a weight, optimizer state or accumulator "
                         f"of this trainer (valid: {shown})")
    out = {}
    for w, shape in shapes.items():
        weight = _place(options, everyone, w, "weight", shape)
        states = {s: _place(options, everyone, state_name(w, s), "optimizer_state", shape) for s in state_names}
        accumulator = _place(options, everyone, accumulator_name(w), "accumulator", shape)
        out[w] = _link(w, weight, states, accumulator)
    return out


def _place(options: TrainingOptions, everyone: ReplicaGrouping, name: str, kind: str,
           shape: tuple[int, ...]) -> Placement:
    n = math.prod(shape)
    override = options.tensor_location_settings_override.get(name)
    settings: TensorLocationSettings = getattr(options, f"{kind}_tensor_location_settings")
    if override is not None:
        where = f"tensor_location_settings_override[{name!r}]"
        loc, min_off, min_rts = _check_location(override, where), 0, 0
    else:
        where = f"{kind}_tensor_location_settings.location"
        loc = _check_location(settings.location, where)
        min_off = settings.min_elements_for_off_chip
        min_rts = settings.min_elements_for_replicated_tensor_sharding
    domain = sharding_domain(everyone, loc.domain_arg, where)  # a domain that does not fit: one error naming it
    off_chip = loc.storage is OFF_CHIP and n >= min_off
    sharded = loc.sharded and n >= min_rts and domain.group_size > 1
    return Placement(name, off_chip, sharded, domain, off_chip and loc.load_tile_set is IO)


def _link(name: str, weight: Placement, states: dict[str, Placement], accumulator: Placement) -> WeightPlacement:
    """How one weight's update runs; ValueError when its linked tensors disagree."""
    if states:
        kinds = {(p.sharded, p.domain if p.sharded else None) for p in states.values()}
        if len(kinds) > 1:
            raise ValueError(f"the optimizer state tensors of weight {name!r} are sharded differently ("
                             + "; ".join(p.describe() for p in states.values())
                             + "); they are updated together, so give them one sharding and domain")
        first = next(iter(states.values()))
        update_sharded, domain = first.sharded, first.domain
    else:
        update_sharded, domain = weight.sharded, weight.domain
    if weight.sharded and update_sharded and weight.domain != domain:
        raise ValueError(f"weight {name!r} is sharded over {weight.domain.describe()} but its optimizer state over "
                         f"{domain.describe()}; a sharded weight is updated with its state's shards, so give both "
                         "one sharding_domain (PopART's rule for linked tensors)")
    if accumulator.sharded and not (update_sharded and accumulator.domain == domain):
        update = f"runs on shards over {domain.describe()}" if update_sharded else "runs on the whole tensor"
        raise ValueError(f"the accumulator of weight {name!r} is sharded over {accumulator.domain.describe()} but the "
                         f"weight's update {update}; a sharded accumulator feeds the update of its shard, so shard the "
                         "optimizer state (for an optimizer without state: the weight) over the same sharding_domain")
    return WeightPlacement(name, weight, states, accumulator, update_sharded, domain)



__all__ = [
    "COMPUTE",
    "IO",
    "OFF_CHIP",
    "ON_CHIP",
    "REDUCTIONS",
    "Placement",
    "ReplicatedTensorSharding",
    "TensorLocation",
    "TensorLocationSettings",
    "TensorStorage",
    "TileSet",
    "TrainingOptions",
    "WeightPlacement",
    "accumulator_name",
    "place_weights",
    "state_name",
    "training_reduction",
]
