"""What each stub of a host is told besides the program: the changes to the environment the
program inherits, made once per host.
"""

from __future__ import annotations

import os
import sys

from popcontract import environment, settings
from poprun_py.shared.errors import PlanError
from poprun_py.wire import local

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing under python -S
if TYPE_CHECKING:
    from collections.abc import Mapping


#: What the program never sees of what its stub inherits from mpiexec.
HIDDEN = (environment.SECRET, environment.ONE_STREAM, environment.STUB_SOCKET, environment.PYTHON)


class HostPrograms:
    """What each of one host's stubs is told of its instance besides the program: ``per_host``, the
    host's instances; ``error_dir``, the job's folder of error files (None: none); ``one_stream``,
    stdout and stderr as one pipe; ``subnet``, --host-subnet (None: not given)."""

    def __init__(self, per_host: int, error_dir: str | None, one_stream: bool, subnet: str | None = None) -> None:
        self.per_host = per_host
        self.error_dir = error_dir
        self.one_stream = one_stream
        self.subnet = subnet
        #: The changes every instance of the host gets (``environment``), once made.
        self._shared: dict[bytes, bytes | None] | None = None

    @classmethod
    def from_environment(cls, env: Mapping[str, str]) -> HostPrograms:
        """A remote host's, from what its supervisor inherited from the stub that started it:
        the variables poprun gives every instance there (``env``)."""
        try:
            per_host = settings.integer(environment.LOCAL_WORLD_SIZE, 1, env=env)
        except settings.PopdistEnvError as exc:
            _warn(f"{exc}; {environment.OMP_NUM_THREADS} is left as it is")
            per_host = 1
        error_file = settings.text(environment.TORCHELASTIC_ERROR_FILE, env=env)
        return cls(per_host, os.path.dirname(error_file) if error_file else None,
                   settings.text(environment.ONE_STREAM, env=env) == "1",
                   settings.text(environment.HOST_SUBNET, env=env) or None)

    def flags(self, index: int) -> int:
        """mpiexec passes its stdin to instance 0 only; Hydra gives the others a pipe that never
        ends, where a read would wait for ever: theirs is /dev/null."""
        return (local.PROGRAM_ONE_STREAM if self.one_stream else 0) | (local.PROGRAM_NO_STDIN if index > 0 else 0)

    def error_file(self, index: int) -> str | None:
        if self.error_dir is None:
            return None
        from poprun_py.shared.root_cause import error_file

        return error_file(self.error_dir, index)

    def environment(self, index: int, launch_env: Mapping[str, str]) -> tuple[dict[bytes, bytes | None], str | None]:
        """The changes to what the stub of instance ``index`` inherits (``launch_env``: what mpiexec
        was given), and its error file: poprun's own variables out; its launcher's library out of
        LD_PRELOAD (the program's binds are its own business); torchrun's OMP_NUM_THREADS per
        instance, unless the user set it; MPI kept on the interface in --host-subnet, unless the
        user named one; the error file of an earlier start removed (the job's folder, where it goes,
        is there: poprun's, or made by the host's first stub), or the variable unset (and no error
        file) when that cannot be."""
        if self._shared is None:  # the same for every instance of the host: made once
            self._shared = self._shared_changes(launch_env)
        changes = self._shared
        path = self.error_file(index)
        if path is not None:
            from poprun_py.shared.root_cause import clear_old

            problem = clear_old(path)
            if problem is not None:
                _warn(f"no {environment.TORCHELASTIC_ERROR_FILE} for instance {index}: {problem}")
                changes = {**changes, os.fsencode(environment.TORCHELASTIC_ERROR_FILE): None}
                path = None
        return changes, path

    def _shared_changes(self, launch_env: Mapping[str, str]) -> dict[bytes, bytes | None]:
        changes: dict[str, str | None] = dict.fromkeys(HIDDEN)
        preload = launch_env.get(environment.LD_PRELOAD)
        if preload:
            from poprun_py.shared.loopback import without_library

            changes[environment.LD_PRELOAD] = without_library(preload) or None
        if settings.given(environment.OMP_NUM_THREADS, launch_env) is None and self.per_host > 1:
            from poprun_py.shared.cores import threads_per_instance

            changes[environment.OMP_NUM_THREADS] = str(threads_per_instance(self.per_host))
        if self.subnet:
            for name, value in self._interface(launch_env).items():
                changes[name] = value
        return {os.fsencode(name): None if value is None else os.fsencode(value) for name, value in changes.items()}

    def _interface(self, launch_env: Mapping[str, str]) -> dict[str, str]:
        """--host-subnet: UCX's and libfabric's device, this host's interface in the subnet
        (names differ between hosts), where the user named none; said once when there is none."""
        assert self.subnet is not None
        from poprun_py.shared.network import address_in_subnet

        try:
            _, interface = address_in_subnet(self.subnet)
        except PlanError as exc:
            _warn(str(exc))
            self.subnet = None  # (said once)
            return {}
        return {name: interface for name in (environment.UCX_NET_DEVICES, environment.FI_TCP_IFACE)
                if name not in launch_env}


def _warn(text: str) -> None:
    sys.stderr.write(f"poprun: warning: on host {os.uname().nodename}: {text}\n")
    sys.stderr.flush()
