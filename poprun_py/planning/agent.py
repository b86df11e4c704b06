"""What reaches the other hosts: ssh, or a launcher agent (``--launcher-agent``, or the variable
a scheduler or the Kubernetes MPI Operator set for MPI), such as a ``kubectl exec`` wrapper,
``blaunch`` or a ``qrsh -inherit`` wrapper.

poprun itself never reaches another host: mpiexec starts everything there (Hydra's proxies, Open
MPI's daemons), and poprun talks to the hosts' supervisors over its control connection, which is how it stops
and sweeps them. So the agent is handed to mpiexec in the form each already supports (Hydra's
``-launcher rsh -launcher-exec AGENT``, PRRTE's ``plm_ssh_agent``), and both call it the same way
ssh is called: ``AGENT HOST COMMAND...``, the command words to be run by a shell on HOST.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from popcontract import environment, settings
from poprun_py.shared.errors import PlanError, printable
from poprun_py.shared.paths import which

#: What an agent must do, said when one is refused.
CONTRACT = ("a launcher agent is one program that mpiexec runs as 'AGENT HOST COMMAND...' to run COMMAND "
            "on HOST (a kubectl exec wrapper, blaunch, or a wrapper of 'qrsh -inherit' or 'pbsdsh -h')")
#: Hydra's launchers that take the agent's contract (``-launcher-exec``); its others (slurm, lsf,
#: sge, pbs, ...) reach the hosts their own way and are left to Hydra.
_SSH_LIKE = ("", "ssh", "rsh")


class Agent(NamedTuple):
    """The agent's absolute path and what gave it (``--launcher-agent`` or a variable)."""

    path: str
    given_by: str

    @property
    def name(self) -> str:
        """How poprun's messages name it: its file name (``printable``)."""
        return printable(os.path.basename(self.path))


def find_agent(option: str | None) -> Agent | None:
    """``--launcher-agent``'s program, else the first agent a variable names (Open MPI's
    ``PRTE_MCA_plm_ssh_agent``, its older ``OMPI_MCA_plm_rsh_agent``, which the MPI Operator sets and
    Open MPI 5 no longer reads, Hydra's ``HYDRA_LAUNCHER_EXEC`` for its ssh or rsh launcher); None:
    ssh, also where the first set of them names ssh itself (``_names_ssh``). A PlanError in one line
    when it is not an executable file."""
    if option is not None:
        return None if _names_ssh(option) else Agent(_executable(option, "--launcher-agent"), "--launcher-agent")
    for variable in (environment.LAUNCHER_AGENT_PRTE, environment.LAUNCHER_AGENT_OMPI,
                     environment.LAUNCHER_AGENT_HYDRA):
        value = settings.given(variable)
        if not value:
            continue
        if variable == environment.LAUNCHER_AGENT_HYDRA and settings.text(environment.HYDRA_LAUNCHER) not in _SSH_LIKE:
            continue  # the program of another of Hydra's launchers (srun, blaunch): Hydra's own business
        return None if _names_ssh(value) else Agent(_executable(value, variable), variable)
    return None


def _names_ssh(value: str) -> bool:
    """Whether ``value`` is ssh itself, alone, with options, or first of Open MPI's alternatives
    (``ssh``, ``/usr/bin/ssh``, ``ssh -x``, ``ssh : rsh``, as profiles set them): that is how poprun
    reaches the hosts anyway, with the options it needs (BatchMode, its timeouts) rather than
    those."""
    words = value.split()
    return bool(words) and os.path.basename(words[0]) == "ssh"


def _executable(value: str, given_by: str) -> str:
    """``value`` (a path, or a name looked up on PATH) as an absolute path when it is an executable
    file; else a PlanError naming ``given_by`` and the value."""
    resolved = which(value) if os.sep not in value else value
    why = ("is not on PATH" if resolved is None else "does not exist" if not os.path.exists(resolved)
           else "is not a file" if not os.path.isfile(resolved)
           else "is not executable" if not os.access(resolved, os.X_OK) else None)
    if why is None and resolved is not None:
        return os.path.abspath(resolved)
    hint = ": put its options in a wrapper script" if any(c.isspace() for c in value) else ""
    shown = f"--launcher-agent {value!r}" if given_by == "--launcher-agent" else f"{given_by}={value!r}"
    raise PlanError(f"{shown} {why}{hint}; {CONTRACT}")


def hydra_uses_ssh(global_args: tuple[str, ...]) -> bool:
    """Whether Hydra reaches hosts with ssh itself (no agent): not when the user chose another of
    its launchers (``HYDRA_LAUNCHER``, ``-launcher``/``-bootstrap`` in --mpi-global-args). Only
    then does poprun give it ssh's options."""
    chosen = any(arg in ("-launcher", "-bootstrap", "-launcher-exec", "-bootstrap-exec") for arg in global_args)
    return not chosen and settings.text(environment.HYDRA_LAUNCHER) in ("", "ssh")
