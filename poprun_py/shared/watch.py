"""Which of a set of descriptors can be read, each with a label: ``select.poll`` and a dict.

poprun's event loop and the hosts' supervisors' share it. It stands in for ``selectors``, whose import
(``collections``, ``math``, ``abc``) costs ~2 ms on the launch path.
"""

from __future__ import annotations

import select

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing on the launch path
if TYPE_CHECKING:
    from typing import Any, Protocol

    class HasFileno(Protocol):
        def fileno(self) -> int: ...


def _fd(source: int | HasFileno) -> int:
    return source if isinstance(source, int) else source.fileno()


class Watch:
    """Readable-or-closed descriptors (pipes, sockets, pidfds), each with a label."""

    def __init__(self) -> None:
        self._poll = select.poll()
        self._labels: dict[int, Any] = {}

    def add(self, source: int | HasFileno, label: Any) -> None:
        fd = _fd(source)
        self._poll.register(fd, select.POLLIN)
        self._labels[fd] = label

    def remove(self, source: int | HasFileno) -> None:
        fd = _fd(source)
        if fd in self._labels:
            del self._labels[fd]
            self._poll.unregister(fd)

    def relabel(self, source: int | HasFileno, label: Any) -> None:
        self._labels[_fd(source)] = label

    def labels(self) -> list[Any]:
        return list(self._labels.values())

    def ready(self, timeout: float) -> list[tuple[int, Any]]:
        """``(fd, label)`` for each descriptor that can be read (or hit EOF/error) within ``timeout`` s."""
        return [(fd, self._labels[fd]) for fd, _ in self._poll.poll(timeout * 1000) if fd in self._labels]
