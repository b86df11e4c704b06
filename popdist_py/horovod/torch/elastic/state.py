"""``TorchState``: a model's and an optimizer's state (and any attributes) as one elastic state."""

from __future__ import annotations

import copy
import io
from typing import Any

import torch

from popdist_py.horovod.common import basics
from popdist_py.horovod.common.elastic import ObjectState
from popdist_py.horovod.torch import functions


class TorchState(ObjectState):
    """The model's parameters, the optimizer's state, and the keyword attributes (``epoch=0``...)."""

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **kwargs: Any) -> None:
        self.model = model
        self.optimizer = optimizer
        self._saved_model = copy.deepcopy(model.state_dict()) if model is not None else None
        self._saved_optimizer = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None
        super().__init__(functions.broadcast_object, basics.rank, **kwargs)

    def save(self) -> None:
        if self.model is not None:
            self._saved_model = copy.deepcopy(self.model.state_dict())
        if self.optimizer is not None:
            self._saved_optimizer = copy.deepcopy(self.optimizer.state_dict())
        super().save()

    def restore(self) -> None:
        if self.model is not None and self._saved_model is not None:
            self.model.load_state_dict(self._saved_model)
        if self.optimizer is not None and self._saved_optimizer is not None:
            self.optimizer.load_state_dict(self._saved_optimizer)
        super().restore()

    def sync(self) -> None:
        if self.model is not None:
            functions.broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            functions.broadcast_optimizer_state(self.optimizer, root_rank=0)
        super().sync()

    def snapshot(self) -> Any:
        buffer = io.BytesIO()
        torch.save({"model": self._saved_model, "optimizer": self._saved_optimizer}, buffer)
        return {"torch": buffer.getvalue(), "objects": super().snapshot()}

    def load_snapshot(self, snapshot: Any) -> None:
        saved = torch.load(io.BytesIO(snapshot["torch"]), weights_only=False)
        self._saved_model, self._saved_optimizer = saved["model"], saved["optimizer"]
        super().load_snapshot(snapshot["objects"])
        self.restore()
