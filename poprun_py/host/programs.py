"""What each stub of a host is told besides the program: the environment's changes the shim used
to make in its own process before it started the program, made once per host instead.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from popcontract import environment, settings
from poprun_py.wire import local

if TYPE_CHECKING:
    from collections.abc import Mapping

    from poprun_py.planning.plan import JobPlan

#: What the program never sees of what its stub inherits from mpiexec.
HIDDEN = (environment.SECRET, environment.ONE_STREAM, environment.STUB_SOCKET)


class HostPrograms:
    """What each of this host's stubs is told of its instance besides the program."""

    def __init__(self, plan: JobPlan, one_stream: bool) -> None:
        self.plan = plan
        self.one_stream = one_stream

    def flags(self, index: int) -> int:
        """mpiexec passes its stdin to instance 0 only; Hydra gives the others a pipe that never
        ends, where a read would wait for ever: theirs is /dev/null."""
        return (local.PROGRAM_ONE_STREAM if self.one_stream else 0) | (local.PROGRAM_NO_STDIN if index > 0 else 0)

    def error_file(self, index: int) -> str | None:
        if self.plan.error_dir is None:
            return None
        from poprun_py.shared.root_cause import error_file

        return error_file(self.plan.error_dir, index)

    def environment(self, index: int, launch_env: Mapping[str, str]) -> tuple[dict[bytes, bytes | None], str | None]:
        """The changes to what the stub of instance ``index`` inherits (``launch_env``: what mpiexec
        was given), and its error file: poprun's own variables out; its launcher's library out of
        LD_PRELOAD (the program's binds are its own business); torchrun's OMP_NUM_THREADS per
        instance, unless the user set it; the error file's directory made, or the variable unset
        (and no error file) when it cannot be."""
        changes: dict[str, str | None] = dict.fromkeys(HIDDEN)
        preload = launch_env.get(environment.LD_PRELOAD)
        if preload:
            from poprun_py.shared.loopback import without_library

            changes[environment.LD_PRELOAD] = without_library(preload) or None
        per_host = self.plan.instances_per_host
        if settings.given(environment.OMP_NUM_THREADS, launch_env) is None and per_host > 1:
            from poprun_py.shared.cores import threads_per_instance

            changes[environment.OMP_NUM_THREADS] = str(threads_per_instance(per_host))
        path = self.error_file(index)
        if path is not None:
            from poprun_py.shared.root_cause import prepare

            problem = prepare(path, job_made=True)
            if problem is not None:
                sys.stderr.write(f"poprun: warning: no {environment.TORCHELASTIC_ERROR_FILE} for instance {index}: "
                                 f"{problem}\n")
                changes[environment.TORCHELASTIC_ERROR_FILE] = None
                path = None
        return {os.fsencode(name): None if value is None else os.fsencode(value)
                for name, value in changes.items()}, path
