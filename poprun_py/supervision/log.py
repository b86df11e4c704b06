"""poprun's diagnostics, through :mod:`logging`, which is imported only once something is logged.

``import logging`` costs more than the rest of ``poprun``'s start-up (it brings in ``re``,
``traceback`` and ``threading``), and every launch would pay it before mpiexec starts; at the
default verbosity only warnings and errors are printed, and a clean launch has none. Messages
below the chosen level are dropped here without touching :mod:`logging`.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing on the launch path
if TYPE_CHECKING:
    import logging

NAME = "poprun"
WARNING, INFO, DEBUG = 30, 20, 10

_level = WARNING
_logger: logging.Logger | None = None


def configure(verbosity: int) -> None:
    """0: warnings and errors; 1: progress (-v); 2 or more: debug (-vv)."""
    global _level
    _level = WARNING if verbosity <= 0 else INFO if verbosity == 1 else DEBUG
    if _logger is not None:
        _logger.setLevel(_level)


def logger() -> logging.Logger:
    """poprun's logger (``NAME``) with its handler, made on the first call (the first message's):
    what a caller redirects to have poprun's diagnostics elsewhere."""
    global _logger
    if _logger is None:
        import logging
        import sys

        class Stderr(logging.StreamHandler):  # type: ignore[type-arg]
            """Writes to ``sys.stderr`` as it is at each message, not as it was when the first one
            was logged (a caller that runs poprun in-process may have replaced it meanwhile)."""

            @property
            def stream(self) -> object:
                return sys.stderr

            @stream.setter
            def stream(self, _value: object) -> None:
                pass

        handler = Stderr()
        handler.setFormatter(logging.Formatter(
            "%(asctime)s.%(msecs)03d %(process)d POPRUN [%(levelname).1s] %(message)s", "%H:%M:%S"))
        logger = logging.getLogger(NAME)
        logger.handlers[:] = [handler]
        logger.setLevel(_level)
        logger.propagate = False
        _logger = logger
    return _logger


def debug(message: str, *args: object) -> None:
    if _level <= DEBUG:
        logger().debug(message, *args)


def info(message: str, *args: object) -> None:
    if _level <= INFO:
        logger().info(message, *args)


def warning(message: str, *args: object) -> None:
    logger().warning(message, *args)


def error(message: str, *args: object) -> None:
    logger().error(message, *args)
