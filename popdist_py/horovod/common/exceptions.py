"""Horovod's exceptions, under the names Horovod programs catch."""

from __future__ import annotations


class HorovodInternalError(RuntimeError):
    """A collective failed: ranks disagreed on it, a rank left, or Horovod was shut down.

    Raised on every rank that takes part, by ``synchronize`` (or the blocking call).
    """


class HostsUpdatedInterrupt(RuntimeError):
    """The set of hosts changed: an elastic job syncs its state and goes on."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__()
        self.skip_sync = skip_sync


def get_version_mismatch_message(name: str, version: str, installed_version: str) -> str:
    """Horovod's message for a framework that changed after the extension was built."""
    return (f"Framework {name} installed with version {installed_version} but found version {version}. "
            "This can result in unexpected behavior including runtime errors.")


class HorovodVersionMismatchError(ImportError):
    """Horovod's error for a framework whose version changed after the build; never raised here."""

    def __init__(self, name: str, version: str, installed_version: str) -> None:
        super().__init__(get_version_mismatch_message(name, version, installed_version))
        self.name = name
        self.version = version
        self.installed_version = installed_version
