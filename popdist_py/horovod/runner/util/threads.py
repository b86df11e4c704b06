"""Horovod's thread helper: run a function in a started thread."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def in_thread(target: Callable[..., Any], args: tuple[Any, ...] = (), name: str | None = None,
              daemon: bool = True, silent: bool = False) -> threading.Thread:
    """Start ``target(*args)`` in a new thread and return it; ``silent`` swallows its exception."""
    if not isinstance(args, tuple):
        raise ValueError(f"args must be a tuple, not {type(args).__name__}: for one argument write (arg,)")

    def run() -> None:
        try:
            target(*args)
        except BaseException:
            if not silent:
                raise

    thread = threading.Thread(target=run if silent else target, args=() if silent else args, name=name,
                              daemon=daemon)
    thread.start()
    return thread
