"""Checkpoints: the full host weights and the number of epochs done, in one ``.npz``.

The weights are stored whole (not per replica or shard), so a checkpoint resumes under any
replication, instance split or RTS setting; the epoch counter is all the training state there is,
because each epoch's shuffle is derived from ``seed + epoch``. Writes go to a temporary file that
is renamed over the old one, so an interrupted save never leaves a half-written checkpoint.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from .model import PARAMS, Params

FORMAT = "poprun-py mnist_rts checkpoint v1"


def save(path: Path | str, params: Params, epochs_done: int, meta: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    info = {"format": FORMAT, "epochs_done": epochs_done, **meta}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, info=np.array(json.dumps(info)), **dict(zip(PARAMS, params)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(path: Path | str, expected: Params) -> tuple[Params, int, dict[str, Any]]:
    """(weights, epochs done, metadata); ValueError naming the file if it does not fit ``expected``'s shapes."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as data:
            info = json.loads(str(data["info"]))
            arrays = {name: data[name] for name in PARAMS}
    except (OSError, KeyError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable mnist_rts checkpoint ({exc})") from None
    if info.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown checkpoint format {info.get('format')!r}; expected {FORMAT!r}")
    for name, want in zip(PARAMS, expected):
        if arrays[name].shape != want.shape:
            raise ValueError(f"{path}: {name} has shape {arrays[name].shape} but this model needs {want.shape} "
                             "(was it saved with another --hidden-size or dataset?)")
    params = Params(*(np.ascontiguousarray(arrays[name], np.float32) for name in PARAMS))
    return params, int(info["epochs_done"]), info
