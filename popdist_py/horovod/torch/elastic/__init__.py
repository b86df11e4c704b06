"""Horovod's elastic training for torch: ``hvd.elastic.run``, ``TorchState``, ``ElasticSampler``.

See :mod:`popdist_py.horovod.common.elastic`: a lost host ends the start and ``poprun
--max-restarts`` starts the job again, which resumes from the newest commit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from popdist_py.horovod.common import basics
from popdist_py.horovod.common.elastic import ObjectState, State, run_fn
from popdist_py.horovod.torch.elastic.sampler import ElasticSampler
from popdist_py.horovod.torch.elastic.state import TorchState
from popdist_py.horovod.torch.functions import allgather_object


def _reset() -> None:
    basics.shutdown()
    basics.init()


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate ``func(state, ...)``: it resumes from the last commit after a failure or a restart."""
    return run_fn(func, _reset, allgather_object)


__all__ = ["ElasticSampler", "ObjectState", "State", "TorchState", "run"]
