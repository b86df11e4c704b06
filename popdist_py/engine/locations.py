"""PopART's tensor location settings and training options, in Python spelling.

PopART decides where whole classes of tensors live through settings rather than tensor by tensor:
``opts.optimizerStateTensorLocationSettings.location.replicatedTensorSharding = On`` shards every
optimizer state tensor with at least ``minElementsForReplicatedTensorSharding`` elements over its
``shardingDomain``, and ``tensorLocationSettingsOverride[name]`` places one tensor differently.
Here the same reads::

    opts = TrainingOptions(accumulation_factor=4)
    opts.optimizer_state_tensor_location_settings.location.replicated_tensor_sharding = True
    opts.optimizer_state_tensor_location_settings.min_elements_for_replicated_tensor_sharding = R
    opts.optimizer_state_tensor_location_settings.location.sharding_domain = CommGroup.consecutive(L)
    opts.tensor_location_settings_override["W0/exp_avg"] = TensorLocation()   # this one replicated

What is built: placement of optimizer state (replicated, or sharded ZeRO-1/2 style over a domain).
Weights and accumulators stay replicated and on chip; off-chip storage is not part of these
settings yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from popdist_py import validate
from popdist_py.engine.grouping import CommGroup, ReplicaGrouping

#: PopART's ReductionType names (either spelling) -> the engine's collective op.
REDUCTIONS = {"mean": "mean", "Mean": "mean", "sum": "add", "Sum": "add"}


@dataclass
class TensorLocation:
    """Where one tensor lives: sharded over the replicas of ``sharding_domain`` (default: all
    replicas) when ``replicated_tensor_sharding``, else a full copy on every replica."""

    replicated_tensor_sharding: bool = False
    sharding_domain: CommGroup | ReplicaGrouping | None = None


@dataclass
class TensorLocationSettings:
    """A location for a class of tensors, and the size below which a tensor stays replicated."""

    location: TensorLocation = field(default_factory=TensorLocation)
    min_elements_for_replicated_tensor_sharding: int = 0


@dataclass
class TrainingOptions:
    """What PopART's SessionOptions say about training: accumulation, reduction, state placement.

    ``fused_reduction_bytes``: gradients are reduced in buckets of about this size (one collective
    per bucket, not per tensor).
    """

    accumulation_factor: int = 1
    reduction: str = "mean"
    optimizer_state_tensor_location_settings: TensorLocationSettings = field(default_factory=TensorLocationSettings)
    tensor_location_settings_override: dict[str, TensorLocation] = field(default_factory=dict)
    fused_reduction_bytes: int = 4 << 20

    def check(self) -> None:
        """One clear error for a value that cannot hold, before anything is built."""
        validate.count("TrainingOptions.accumulation_factor", self.accumulation_factor)
        validate.count("TrainingOptions.fused_reduction_bytes", self.fused_reduction_bytes)
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"TrainingOptions.reduction={self.reduction!r} is not valid; use 'mean' or 'sum' "
                             "(PopART's ReductionType Mean or Sum)")
        settings = self.optimizer_state_tensor_location_settings
        validate.non_negative("optimizer_state_tensor_location_settings.min_elements_for_replicated_tensor_sharding",
                              settings.min_elements_for_replicated_tensor_sharding)
        for where, location in [("optimizer_state_tensor_location_settings.location", settings.location),
                                *((f"tensor_location_settings_override[{name!r}]", loc)
                                  for name, loc in self.tensor_location_settings_override.items())]:
            if not isinstance(location, TensorLocation):
                raise TypeError(f"{where} is a {type(location).__name__}, not a TensorLocation")
            validate.flag(f"{where}.replicated_tensor_sharding", location.replicated_tensor_sharding)
            domain = location.sharding_domain
            if domain is not None and not isinstance(domain, CommGroup | ReplicaGrouping):
                raise TypeError(f"{where}.sharding_domain={domain!r} is not a CommGroup or ReplicaGrouping")


__all__ = ["REDUCTIONS", "TensorLocation", "TensorLocationSettings", "TrainingOptions"]
