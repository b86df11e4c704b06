"""Find ``mpiexec``, tell MPICH (Hydra) from Open MPI, and build the one command that starts a job.

Every instance is its own MPMD app context (``A : B : ...``) because each gets different
``POPDIST_*`` values, as PopRun does with Open MPI's ``mpirun``.
"""

from __future__ import annotations

import os
import sys

from poprun_py.errors import PlanError
from poprun_py.paths import which

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing on the launch path
if TYPE_CHECKING:
    from typing import Literal

    from poprun_py.plan import JobPlan

    Flavour = Literal["mpich", "openmpi"]

#: Open MPI does not forward the environment by default; PopRun forwards these by name.
OPENMPI_FORWARDED = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "VIRTUAL_ENV")


class MpiLauncher:
    """An mpiexec and the MPI it belongs to."""

    __slots__ = ("path", "flavour", "version")

    def __init__(self, path: str, flavour: Flavour, version: str) -> None:
        self.path = path
        self.flavour = flavour
        self.version = version

    def __repr__(self) -> str:
        return f"MpiLauncher({self.path!r}, {self.flavour!r}, {self.version!r})"


def find_mpiexec(explicit: str | None = None) -> str:
    """``--mpi PATH`` if given, else the mpiexec next to the running Python, else the one on PATH."""
    if explicit:
        resolved = which(explicit) if os.sep not in explicit else explicit
        if not resolved or not os.path.isfile(resolved) or not os.access(resolved, os.X_OK):
            raise PlanError(f"--mpi {explicit!r} is not an executable file; give the path of mpiexec or mpirun")
        return os.path.abspath(resolved)
    beside_python = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.isfile(beside_python) and os.access(beside_python, os.X_OK):
        return beside_python
    on_path = which("mpiexec") or which("mpirun")
    if not on_path:
        raise PlanError(
            "no mpiexec found next to Python or on PATH; install the 'mpich' wheel "
            "(pip install mpich) or pass --mpi /path/to/mpiexec"
        )
    return on_path


#: Files that sit beside each flavour's mpiexec: telling them apart costs a stat, not a process.
_SIBLINGS: dict[Flavour, tuple[str, ...]] = {"mpich": ("hydra_pmi_proxy",), "openmpi": ("prterun", "orterun")}


def detect_launcher(path: str, need_version: bool = False) -> MpiLauncher:
    """Which MPI ``path`` belongs to: from the files beside it when that is unambiguous (every
    launch pays for this, so no process is started), else from ``path --version``."""
    if not need_version:
        real = os.path.realpath(path)
        folder = os.path.dirname(real)
        found = [flavour for flavour, names in _SIBLINGS.items()
                 if any(os.path.exists(os.path.join(folder, name)) for name in names)]
        if len(found) == 1:
            return MpiLauncher(path, found[0], "unknown")
    return _ask_version(path)


def _ask_version(path: str) -> MpiLauncher:
    import subprocess

    try:
        out = subprocess.run([path, "--version"], capture_output=True, timeout=20, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PlanError(f"could not run {path!r} --version to detect the MPI flavour: {exc}") from None
    text = (out.stdout + out.stderr).decode(errors="replace").replace("\0", "")
    if "HYDRA" in text or "MPICH" in text.upper():
        version = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if "Version:" in ln), "unknown")
        return MpiLauncher(path, "mpich", version)
    if "Open MPI" in text or "OpenRTE" in text or "prterun" in text.lower():
        first = text.strip().splitlines()[0] if text.strip() else ""
        version = first.rsplit(" ", 1)[-1] if first else "unknown"
        return MpiLauncher(path, "openmpi", version)
    first_line = text.strip().splitlines()[0] if text.strip() else "(no output)"
    raise PlanError(
        f"{path!r} is neither MPICH (Hydra) nor Open MPI (its --version says {first_line!r}); "
        "pass --mpi with an MPICH or Open MPI mpiexec"
    )


class CommandSpec:
    """Everything that shapes the mpiexec command apart from the plan."""

    def __init__(self, job_env: dict[str, str], instance_envs: list[dict[str, str]],
                 instance_argv: list[list[str]], global_args: list[str] | None = None,
                 local_args: list[str] | None = None, instance_local_args: dict[int, list[str]] | None = None,
                 numa_aware: bool = False, explicit_hosts: bool = False) -> None:
        self.job_env = job_env
        self.instance_envs = instance_envs
        self.instance_argv = instance_argv
        self.global_args = global_args or []
        self.local_args = local_args or []
        self.instance_local_args = instance_local_args or {}
        self.numa_aware = numa_aware
        self.explicit_hosts = explicit_hosts


def build_command(launcher: MpiLauncher, plan: JobPlan, spec: CommandSpec) -> list[str]:
    if launcher.flavour == "mpich":
        return _mpich_command(launcher, plan, spec)
    return _openmpi_command(launcher, plan, spec)


def _mpich_command(launcher: MpiLauncher, plan: JobPlan, spec: CommandSpec) -> list[str]:
    cmd = [launcher.path, *spec.global_args]
    if spec.numa_aware:
        cmd += ["-bind-to", "numa"]
    for name, value in spec.job_env.items():
        cmd += ["-genv", name, value]
    for inst in plan.instances:
        if inst.index:
            cmd.append(":")
        cmd += ["-n", "1"]
        if spec.explicit_hosts:
            cmd += ["-host", inst.host]
        for name, value in spec.instance_envs[inst.index].items():
            cmd += ["-env", name, value]
        cmd += [*spec.local_args, *spec.instance_local_args.get(inst.index, []), *spec.instance_argv[inst.index]]
    return cmd


def _openmpi_command(launcher: MpiLauncher, plan: JobPlan, spec: CommandSpec) -> list[str]:
    cmd = [launcher.path, *spec.global_args]
    cmd += ["--bind-to", "numa", "--map-by", "numa"] if spec.numa_aware else ["--bind-to", "none"]
    # Instances are placed by poprun's plan, not by Open MPI's slot count (2 cores would refuse 4).
    cmd.append("--oversubscribe")
    if hasattr(os, "geteuid") and os.geteuid() == 0 and "--allow-run-as-root" not in spec.global_args:
        cmd.append("--allow-run-as-root")
    forwarded = [name for name in OPENMPI_FORWARDED if name in os.environ]
    for inst in plan.instances:
        if inst.index:
            cmd.append(":")
        cmd += ["-np", "1"]
        if spec.explicit_hosts:
            cmd += ["--host", inst.host]
        for name, value in {**spec.job_env, **spec.instance_envs[inst.index]}.items():
            cmd += ["-x", f"{name}={value}"]
        for name in forwarded:
            cmd += ["-x", name]
        cmd += [*spec.local_args, *spec.instance_local_args.get(inst.index, []), *spec.instance_argv[inst.index]]
    return cmd


def split_args(text: str | None, option: str) -> list[str]:
    """shlex-split an option's value; unbalanced quotes are a usage error naming the option."""
    if not text:
        return []
    import shlex

    try:
        return shlex.split(text)
    except ValueError as exc:
        raise PlanError(f"{option} {text!r} cannot be split into arguments: {exc}") from None


def parse_instance_local_args(values: tuple[str, ...] | list[str], num_instances: int) -> dict[int, list[str]]:
    """``I:ARGS`` entries (repeatable; repeats for one instance are joined in order)."""
    result: dict[int, list[str]] = {}
    for value in values:
        index_text, sep, args = value.partition(":")
        if not sep or not index_text.strip().isdigit():
            raise PlanError(
                f"--instance-mpi-local-args {value!r} is not of the form I:ARGS with I an instance index, "
                f"e.g. '1:-env FOO bar'"
            )
        index = int(index_text)
        if index >= num_instances:
            raise PlanError(
                f"--instance-mpi-local-args {value!r} names instance {index}, but instances are "
                f"0..{num_instances - 1}"
            )
        result.setdefault(index, []).extend(split_args(args, "--instance-mpi-local-args"))
    return result
