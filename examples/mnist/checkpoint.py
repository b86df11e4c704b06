"""Checkpoints: the engine's ``rt.save``/``rt.load`` plus the number of epochs done.

The engine stores every weight as its full host tensor (shards joined, remote slots read back),
so a checkpoint resumes under any replication, instance split or RTS setting; the epoch counter
is all the other training state there is, because each epoch's shuffle is derived from
``seed + epoch``. Both calls are collective (every instance calls them; instance 0 writes and
reads the file); the write goes to a temporary file renamed over the old one, so an interrupted
save never leaves a half-written checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from popdist_py.engine import CheckpointError, Runtime

FORMAT = "poprun-py mnist_rts checkpoint v2"


def save(rt: Runtime, path: Path | str, epochs_done: int, meta: dict[str, Any]) -> None:
    """Every weight of ``rt`` and ``epochs_done`` to ``path`` (collective)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    rt.save(path, {"format": FORMAT, "epochs_done": epochs_done, **meta})


def load(rt: Runtime, path: Path | str) -> tuple[int, dict[str, Any]]:
    """Restore ``rt``'s weights from ``path``; (epochs done, metadata). ValueError naming the file
    when it is not a checkpoint of this example or does not fit this model (collective)."""
    try:
        info = rt.load(path)
    except CheckpointError as exc:
        raise ValueError(f"{exc} (was it saved with another --hidden-size or dataset?)") from None
    if info.get("format") != FORMAT or not isinstance(info.get("epochs_done"), int):
        raise ValueError(f"{path}: not a mnist_rts checkpoint (format {info.get('format')!r}; expected {FORMAT!r})")
    return info["epochs_done"], info
