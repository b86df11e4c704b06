"""Per-instance line assembly and tagging: ``[i] `` before every line, whole lines only."""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing on the launch path
if TYPE_CHECKING:
    from typing import BinaryIO

TAIL_LINES = 20


class InstanceOutput:
    """Assembles one instance's two streams into lines and keeps the tail of its stderr."""

    def __init__(self, index: int, show: bool, sinks: dict[int, BinaryIO]) -> None:
        self.tag = f"[{index}] ".encode()
        self.show = show
        self.sinks = sinks
        self.partial = {1: bytearray(), 2: bytearray()}
        self.stderr_tail: list[bytes] = []  # the last TAIL_LINES lines

    def feed(self, stream: int, data: bytes) -> None:
        buffer = self.partial[stream]
        buffer += data
        end = buffer.rfind(b"\n")
        if end < 0:
            return
        lines = bytes(buffer[: end + 1]).splitlines(keepends=True)
        del buffer[: end + 1]
        self._emit(stream, lines)

    def flush(self) -> None:
        """End of the instance: a last line without a newline still gets one."""
        for stream, buffer in self.partial.items():
            if buffer:
                self._emit(stream, [bytes(buffer) + b"\n"])
                buffer.clear()

    def _emit(self, stream: int, lines: list[bytes]) -> None:
        if stream == 2:
            self.stderr_tail.extend(line.rstrip(b"\n") for line in lines)
            del self.stderr_tail[:-TAIL_LINES]
        if self.show:
            sink = self.sinks[stream]
            try:
                sink.write(b"".join(self.tag + line for line in lines))
                sink.flush()
            except (BrokenPipeError, ValueError):
                self.show = False  # our reader went away (e.g. `| head`); keep supervising
