"""The hosts a scheduler gives the job, read when no -H/--host-file is given: Slurm's node list,
PBS/Torque's and LSF's node files (one line per slot), LSF's ``LSB_MCPU_HOSTS``, Grid Engine's
``PE_HOSTFILE`` and the Kubernetes MPI Operator's host file (``host slots=N``).

Each source gives hosts in its order and, where it knows them, their slots, which bound how many
instances a host gets. When several are set, the first of :data:`PRECEDENCE` wins (a scheduler's
own variables before the MPI Operator's, which mpiexec itself also reads and a user's profile may
carry); when they disagree, one warning line names each and which won.
"""

from __future__ import annotations

from typing import NamedTuple

from popcontract import environment, settings
from poprun_py.planning.hosts import (
    abridged,
    checked,
    expand_hosts,
    lines_of,
    read_bounded,
    read_host_file,
    slot_count,
)
from poprun_py.shared.errors import PlanError


class Found(NamedTuple):
    """The hosts a source gives, in its order, and the slots of those it gives slots for."""

    hosts: list[str]
    slots: dict[str, int]


class Source(NamedTuple):
    """One way a scheduler names the job's hosts: its name, the variable, whether the variable names
    a file (else it holds the list itself), and the variable that gives the hosts' slots apart, if any."""

    scheduler: str
    variable: str
    is_file: bool
    slots_variable: str | None = None

    def read(self, value: str) -> Found:
        """The hosts ``value`` (the variable's) gives; a PlanError naming the variable, the file and
        the line when it is malformed."""
        return _READERS[self.variable](value, f"{self.variable} file {value!r}" if self.is_file else self.variable)


def _per_slot_lines(path: str, shown: str) -> Found:
    """PBS's and LSF's node files: one host name per line, one line per slot, a host's lines
    together or not; the hosts in the order they first appear."""
    slots: dict[str, int] = {}
    for number, line in lines_of(read_bounded(path, shown, "one host name per line, one line per slot")):
        if len(line.split()) != 1:
            raise PlanError(f"{shown} line {number}: {abridged(line)!r} is not one host name; each line is one host "
                            "name, a host's name once per slot")
        slots[line] = slots.get(line, 0) + 1
    return _found(slots, shown)


def _mcpu_hosts(value: str, shown: str) -> Found:
    """LSF's ``LSB_MCPU_HOSTS``: ``host1 n1 host2 n2 ...``."""
    words = value.split()
    form = "'host1 n1 host2 n2 ...', each n the host's slots, a whole number from 1"
    if len(words) % 2:
        raise PlanError(f"{shown} {abridged(value)!r} has {len(words)} words; it is {form}")
    slots: dict[str, int] = {}
    for pair in range(0, len(words), 2):
        host, count = words[pair], words[pair + 1]
        slots[host] = slots.get(host, 0) + slot_count(count, shown, 0, value, form)
    return _found(slots, shown)


def _pe_hostfile(path: str, shown: str) -> Found:
    """Grid Engine's ``PE_HOSTFILE``: ``host slots queue processor-range`` per line."""
    form = "'host slots queue processor-range', slots a whole number from 1"
    slots: dict[str, int] = {}
    for number, line in lines_of(read_bounded(path, shown, "'host slots queue processor-range' lines")):
        words = line.split()
        if len(words) < 2:
            raise PlanError(f"{shown} line {number}: {abridged(line)!r} has no slots; each line is {form}")
        slots[words[0]] = slots.get(words[0], 0) + slot_count(words[1], shown, number, line, form)
    return _found(slots, shown)


def _host_file(path: str, shown: str) -> Found:
    """The MPI Operator's host file: poprun's own host file format (``host slots=N`` or ``host:N``)."""
    hosts, slots = read_host_file(path, shown)
    return Found(hosts, slots)


def _node_list(value: str, shown: str) -> Found:
    """Slurm's node list (``node[01-04,07]``) and, when set, ``SLURM_TASKS_PER_NODE``: the tasks
    Slurm gives each of those hosts, in their order, which are their slots (as mpirun takes them)."""
    hosts = expand_hosts(value, f"{shown} {abridged(value)!r}")
    tasks = settings.given(environment.SLURM_TASKS_PER_NODE)
    if not tasks:
        return Found(hosts, {})
    return Found(hosts, dict(zip(hosts, _tasks_per_node(tasks, len(hosts)), strict=True)))


#: What ``SLURM_TASKS_PER_NODE`` may be.
TASKS_FORM = ("'N' or 'N(xM)' items joined by commas in the order of SLURM_JOB_NODELIST's hosts, N a host's tasks "
              "(a whole number from 1), M how many hosts in a row have N (e.g. '2(x3),1')")


def _tasks_per_node(value: str, hosts: int) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` (``2(x3),1``) as one count per host, for ``hosts`` hosts; a PlanError
    naming the variable and its value when it is malformed or counts other hosts than the list."""
    shown = environment.SLURM_TASKS_PER_NODE
    counts: list[int] = []
    for item in value.split(","):
        number, bracket, rest = item.strip().partition("(x")
        repeat = rest[:-1] if rest.endswith(")") else ""
        digits = repeat.lstrip("0")  # M, from 1
        if bracket and not (repeat.isascii() and repeat.isdigit() and digits):
            raise PlanError(f"{shown} {abridged(value)!r}: {abridged(item, 20)!r} is not 'N' or 'N(xM)'; it is "
                            f"{TASKS_FORM}")
        # A count past the hosts left is cut before a list is built from it (it is refused below).
        times = (hosts + 1 if len(digits) > len(str(hosts)) else int(digits)) if bracket else 1
        counts += [slot_count(number, shown, 0, value, TASKS_FORM)] * min(times, hosts + 1 - len(counts))
        if len(counts) > hosts:
            break
    if len(counts) != hosts:
        more = "more" if len(counts) > hosts else "fewer"
        raise PlanError(f"{shown} {abridged(value)!r} gives the tasks of {more} hosts than the {hosts} of "
                        f"{environment.SLURM_NODELIST}; it is {TASKS_FORM}")
    return counts


def _found(slots: dict[str, int], shown: str) -> Found:
    if not slots:
        raise PlanError(f"{shown} lists no hosts")
    return Found(checked(list(slots), shown), slots)


#: Where the hosts come from, the first set one winning.
PRECEDENCE = (
    Source("Slurm", environment.SLURM_NODELIST, is_file=False, slots_variable=environment.SLURM_TASKS_PER_NODE),
    Source("PBS", environment.PBS_NODEFILE, is_file=True),
    Source("LSF", environment.LSB_DJOB_HOSTFILE, is_file=True),
    Source("LSF", environment.LSB_MCPU_HOSTS, is_file=False),
    Source("Grid Engine", environment.PE_HOSTFILE, is_file=True),
    Source("the MPI Operator", environment.OMPI_DEFAULT_HOSTFILE, is_file=True),
    Source("the MPI Operator", environment.HYDRA_HOST_FILE, is_file=True),
)
_READERS = {environment.SLURM_NODELIST: _node_list, environment.PBS_NODEFILE: _per_slot_lines,
            environment.LSB_DJOB_HOSTFILE: _per_slot_lines, environment.LSB_MCPU_HOSTS: _mcpu_hosts,
            environment.PE_HOSTFILE: _pe_hostfile, environment.OMPI_DEFAULT_HOSTFILE: _host_file,
            environment.HYDRA_HOST_FILE: _host_file}


class Chosen(NamedTuple):
    """What the scheduler's variables give: the hosts, the source that won, a line saying so, and
    a warning line when another source disagrees ("" when none does)."""

    found: Found
    source: Source
    said: str
    warning: str
    #: How errors name the source: its variable, value and scheduler.
    names: str


def _describe(source: Source, value: str) -> str:
    """``VARIABLE=value``: a file's path whole, a list's start; and the variable of its slots with its
    value, when that is set."""
    described = f"{source.variable}={value if source.is_file else abridged(value, 200)}"
    if source.slots_variable and (slots := settings.given(source.slots_variable)):
        described += f" and {source.slots_variable}={abridged(slots, 200)}"
    return described


def from_environment() -> Chosen | None:
    """The hosts of the first set source of :data:`PRECEDENCE`; None when none is set. A PlanError
    when the winning one is malformed; the others are read to compare, and one that gives other
    hosts or cannot be read is named in the warning."""
    given = [(source, value) for source in PRECEDENCE if (value := settings.given(source.variable))]
    if not given:
        return None
    (source, value), others = given[0], given[1:]
    found = source.read(value)
    differ = []
    for other, other_value in others:
        if other.variable == environment.LSB_MCPU_HOSTS and source.variable == environment.LSB_DJOB_HOSTFILE:
            continue  # LSF's two forms of the same list
        try:
            theirs = other.read(other_value)
        except PlanError as exc:
            differ.append(f"{other.scheduler}'s {exc}")
            continue
        if theirs.hosts != found.hosts:
            differ.append(f"{other.scheduler}'s {_describe(other, other_value)} gives "
                          f"{abridged(','.join(theirs.hosts))}")
    slots = f" (slots: {abridged(', '.join(f'{h}:{n}' for h, n in found.slots.items()))})" if found.slots else ""
    said = (f"no -H/--host-file: using the {len(found.hosts)} host(s) {source.scheduler} gives in "
            f"{_describe(source, value)}{slots}")
    warning = ""
    if differ:
        order = ", ".join(dict.fromkeys(f"{s.scheduler}" for s in PRECEDENCE))
        warning = (f"{source.scheduler}'s {_describe(source, value)} gives {abridged(','.join(found.hosts))}, but "
                   f"{'; '.join(differ)}: using {source.scheduler}'s (the first of {order})")
    return Chosen(found, source, said, warning, f"{_describe(source, value)} ({source.scheduler})")
