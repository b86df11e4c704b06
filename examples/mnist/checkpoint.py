"""Checkpoints: the Trainer's weights, optimizer state and update count, plus the epochs done.

``Trainer.save`` stores every tensor whole (shards joined, off-chip slots read back), so a
checkpoint resumes under any replication, instance split, accumulation or location setting; the
epoch counter is all the other training state there is, because each epoch's shuffle is derived
from ``seed + epoch``. The optimizer's name is recorded and must match on resume: Adam and LAMB
keep state of the same names and shapes, so the engine alone would take one for the other. Both
calls are collective (every instance calls them; instance 0 writes and reads the file); the write
goes to a temporary file renamed over the old one, so an interrupted save never leaves a
half-written checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from popdist_py.engine import CheckpointError, Trainer

FORMAT = "poprun-py mnist_rts checkpoint v3"


def save(trainer: Trainer, path: Path | str, epochs_done: int, meta: dict[str, Any]) -> None:
    """The trainer's state and ``epochs_done`` to ``path`` (collective)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    trainer.save(path, {"format": FORMAT, "epochs_done": epochs_done, **meta})


def load(trainer: Trainer, path: Path | str, optimizer: str) -> tuple[int, dict[str, Any]]:
    """Restore the trainer's state from ``path``; (epochs done, metadata). ValueError naming the
    file when it is not a checkpoint of this example or does not fit this model and ``optimizer``
    (collective)."""
    try:
        info = trainer.load(path)
    except CheckpointError as exc:
        raise ValueError(f"{exc} (was it saved with another --hidden-size, --optimizer or dataset?)") from None
    if info.get("format") != FORMAT or not isinstance(info.get("epochs_done"), int):
        raise ValueError(f"{path}: not a mnist_rts checkpoint (format {info.get('format')!r}; expected {FORMAT!r})")
    if info.get("optimizer") != optimizer:
        raise ValueError(f"{path} was saved with --optimizer {info.get('optimizer')}, not {optimizer}: its "
                         "optimizer state does not carry over; resume with the same --optimizer")
    return info["epochs_done"], info
