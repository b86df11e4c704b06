"""``make test``'s parts, run at once: ``python -m tests.parts [PART ...]``.

The suite's parts share nothing but the machine's cores: each runs in a sandbox of its own
(``tests/sandbox``: a PID namespace, its own /tmp and /dev/shm and, but for the part that builds
the multi-host cluster, its own network namespace with loopback alone, so its own ports), checks
that its jobs left nothing in its /tmp and /dev/shm, and writes its output to a log of its own. Most
of the suite waits (for processes, signals, protocol limits), so parts that wait overlap on two
cores; each is bounded, and a failed part is reported by name with the tests that failed in it.

    python -m tests.parts                 # every part; status 1 if any failed
    python -m tests.parts mpi sanitize    # those parts only
    python -m tests.parts --list          # the parts and their commands
    python -m tests.parts --doc FILE      # FILE's generated section from the last run's results

Each pytest command writes a JUnit XML file next to the part's log; ``--doc`` reads them (and the
run's record, ``RESULTS``) to regenerate docs/testing.md's table of the parts and the slowest
tests, so the figures a doc quotes come from the run it names.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from tests import blas_kernels
from tests.helpers import ROOT

#: Where each part's log, JUnit files and leftover snapshot go (not /tmp: each part has its own).
OUT = ROOT / ".venv" / "test-parts"
RESULTS = OUT / "results.json"
SANDBOX = str(ROOT / "tests" / "sandbox")
#: The bound of every part: well inside CI's limit, far beyond a part's usual time.
PART_TIMEOUT = 25 * 60
PY = sys.executable
PYTEST = (PY, "-m", "pytest", "-q", "--color=no", "-p", "no:cacheprovider")
MPIEXEC = str(Path(PY).parent / "mpiexec")


#: The tests that build the multi-host cluster (network namespaces with sshd as hosts, a bridge:
#: tests/cluster.py), whose part keeps the machine's network namespace, where the bridge is made.
CLUSTER_TESTS = ("tests/integration/test_multihost.py", "tests/integration/test_elastic.py",
                 "tests/integration/test_launcher_agent.py")

#: The checks of `make bench`'s sections at their smallest sizes: many short jobs that import torch.
BENCH_TESTS = "tests/integration/test_bench.py"
#: Horovod's API under poprun: unmodified Horovod programs (torch jobs of 2-3 instances each) and
#: the suite runner's own checks; a part of their own, so that `apps` is not the longest by far.
HOROVOD_TESTS = ("tests/integration/test_horovod_under_poprun.py", "tests/integration/test_horovod_suite.py")
#: The installs: `make dist`'s wheel and sdist into fresh venvs, and the package without its parts.
INSTALL_TESTS = ("tests/integration/test_dist.py", "tests/integration/test_package.py",
                 "tests/integration/test_compiled_parts.py", "tests/integration/test_make_install.py")


#: Parts run at a time: most of the suite waits (for processes, signals, limits), so five keep two
#: cores busy, and no more, so that a test's own bounds are not spent waiting for a core.
AT_ONCE = 5


class Part(NamedTuple):
    """One part: its commands, run in order (the first failure ends it), and whether it keeps the
    machine's network instead of a network namespace of its own: the cluster's part (its hosts'
    bridge) and the installs' (on a fresh machine, ``make dist`` fetches its pinned tools and the
    wheelhouse its fresh venvs install from comes from the package index)."""

    name: str
    commands: tuple[tuple[str, ...], ...]
    own_network: bool = True


def _pytest(part: str, step: str, *args: str) -> tuple[str, ...]:
    return (*PYTEST, f"--junitxml={OUT / f'{part}.{step}.xml'}", *args)


def parts() -> list[Part]:
    """The parts of ``make test``: lint first (it ends in seconds and names the line), then the
    longest first. Together they run every test once, the engine's under both executors, with all
    hypothesis examples; tests/mpi under mpiexec at 2, 3 and 4 ranks; the determinism tests again
    under every other OpenBLAS kernel this CPU runs; the compiled parts under AddressSanitizer and
    UndefinedBehaviorSanitizer (``make sanitize``); ruff and mypy (``make lint``)."""
    kernels = blas_kernels.kernels()
    elsewhere = [f"--ignore={test}" for test in (*CLUSTER_TESTS, BENCH_TESTS, *INSTALL_TESTS, *HOROVOD_TESTS)]
    return [
        Part("lint", (("make", "--no-print-directory", "lint"),)),
        Part("hosts", (_pytest("hosts", "pytest", *CLUSTER_TESTS),), own_network=False),
        Part("bench", (_pytest("bench", "pytest", BENCH_TESTS),)),
        Part("launcher", (_pytest("launcher", "pytest", "tests/launcher"),)),
        Part("apps", (_pytest("apps", "pytest", "tests/integration", *elsewhere),)),
        Part("installs", (_pytest("installs", "pytest", *INSTALL_TESTS),), own_network=False),
        Part("horovod", (_pytest("horovod", "pytest", *HOROVOD_TESTS),)),
        # Bits promised equal must not depend on the BLAS kernel this CPU picked.
        Part("blas", tuple(("env", f"OPENBLAS_CORETYPE={k}", *_pytest("blas", k, "-m", "determinism", "tests"))
                           for k in kernels)),
        Part("library", (_pytest("library", "pytest", "tests/library", "tests/engine"),)),
        # No JUnit file here: every rank would write the same one.
        Part("mpi", tuple((MPIEXEC, "-n", str(n), *PYTEST, "--with-mpi", "tests/mpi") for n in (2, 3, 4))),
        Part("sanitize", (("make", "--no-print-directory", "sanitize"),)),
    ]


def _script(part: Part) -> str:
    """The shell script a part runs in its sandbox: a snapshot of its /tmp and /dev/shm, its
    commands in order, then the check that its jobs left nothing there."""
    snapshot = str(OUT / f"{part.name}.before")
    steps = [(PY, "-m", "tests.leftover_files", "snapshot", snapshot), *part.commands,
             (PY, "-m", "tests.leftover_files", "check", snapshot)]
    return " && ".join(shlex.join(step) for step in steps)


class Running(NamedTuple):
    part: Part
    proc: subprocess.Popen[bytes]
    started: float
    log: Path


def sandboxes() -> bool:
    """Whether this machine gives a part a sandbox (namespaces: as root, or unprivileged users')."""
    return subprocess.run([SANDBOX, "--net", "true"], stdin=subprocess.DEVNULL, capture_output=True).returncode == 0


def _start(part: Part, sandboxed: bool) -> Running:
    log = OUT / f"{part.name}.log"
    command = ["sh", "-c", _script(part)]
    if sandboxed:
        command = [SANDBOX, *(["--net"] if part.own_network else []), *command]
    with open(log, "wb") as out:
        # A session of its own: a part that runs past its bound is killed whole (in a sandbox, its
        # first process is its PID namespace's init: the kernel ends the rest with it).
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                cwd=ROOT, start_new_session=True)
    return Running(part, proc, time.monotonic(), log)


def _say(item: Running, status: int, took: float) -> None:
    """A part's end: passed, or failed with the tests that failed in it (its log's last lines where
    pytest named none: a command that is no test failed)."""
    if status == 0:
        print(f"tests.parts: part {item.part.name} passed in {_minutes(took)}", flush=True)
        return
    print(f"tests.parts: part {item.part.name} FAILED (status {status}) in {_minutes(took)}; "
          f"log: {item.log.relative_to(ROOT)}", flush=True)
    for line in failed_tests(item.log) or item.log.read_text(errors="replace").splitlines()[-40:]:
        print(f"    {item.part.name}: {line}", flush=True)


def failed_tests(log: Path) -> list[str]:
    """The tests pytest's short summary lists as failed or in error, in the order it lists them."""
    lines = log.read_text(errors="replace").splitlines()
    return [line for line in lines if line.startswith(("FAILED ", "ERROR "))]


def _minutes(seconds: float) -> str:
    """``seconds`` as "8 min 05 s", rounded to the second first (never "8 min 60 s")."""
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest:02d} s"


def run(chosen: Sequence[Part], at_once: int = AT_ONCE) -> int:
    """Run ``chosen``, ``at_once`` at a time in sandboxes (one at a time where there are none), in
    their order; each said as it ends. Status 1 if any failed."""
    OUT.mkdir(parents=True, exist_ok=True)
    for stale in OUT.glob("*.xml"):
        stale.unlink()
    began = time.monotonic()
    sandboxed = sandboxes()
    names = ", ".join(part.name for part in chosen)
    if not sandboxed:  # they would share /tmp, /dev/shm and ports, and blame each other's files
        at_once = 1
        print("tests.parts: no namespaces here (tests/sandbox): the parts run one after another", flush=True)
    print(f"tests.parts: {len(chosen)} parts, {at_once} at a time ({names}); logs in {OUT.relative_to(ROOT)}/",
          flush=True)
    queue = list(chosen)
    results: dict[str, dict[str, object]] = {}
    waiting: list[Running] = []
    while queue or waiting:
        while queue and len(waiting) < at_once:
            waiting.append(_start(queue.pop(0), sandboxed))
        for item in list(waiting):
            took = time.monotonic() - item.started
            if took > PART_TIMEOUT:
                os.killpg(item.proc.pid, signal.SIGKILL)
                with open(item.log, "a") as log:
                    log.write(f"\ntests.parts: part {item.part.name} ran past {PART_TIMEOUT} s and was killed\n")
            # wait4: the CPU time of the part's whole tree of processes, once it has ended
            pid, wait_status, usage = os.wait4(item.proc.pid, 0 if took > PART_TIMEOUT else os.WNOHANG)
            if not pid:
                continue
            item.proc.returncode = status = os.waitstatus_to_exitcode(wait_status)
            waiting.remove(item)
            results[item.part.name] = {"status": status, "seconds": round(took, 1),
                                       "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 1)}
            _say(item, status, took)
        time.sleep(0.5)
    total = time.monotonic() - began
    failed = [name for name, result in results.items() if result["status"] != 0]
    RESULTS.write_text(json.dumps({
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": _commit(), "cores": os.cpu_count(), "seconds": round(total, 1), "parts": results}, indent=1))
    verdict = f"{len(failed)} FAILED: {', '.join(failed)}" if failed else "all passed"
    print(f"tests.parts: {verdict}, {_minutes(total)} in all", flush=True)
    return 1 if failed else 0


def _commit() -> str:
    described = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, cwd=ROOT)
    return described.stdout.strip() or "unknown"


# -- docs/testing.md ------------------------------------------------------------------------------
BEGIN, END = "<!-- tests.parts: begin -->", "<!-- tests.parts: end -->"
SLOWEST = 25


def _cases() -> list[tuple[float, str, str]]:
    """Every test case of the last run's JUnit files: its seconds, its part, its id."""
    cases = []
    for path in sorted(OUT.glob("*.xml")):
        part = path.name.split(".", 1)[0]
        for case in ET.parse(path).getroot().iter("testcase"):
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            cases.append((float(case.get("time", "0")), part, name))
    return cases


def section() -> str:
    """docs/testing.md's generated section: the last run's parts and its slowest tests."""
    record = json.loads(RESULTS.read_text())
    heading = (f"Generated by `python -m tests.parts --doc docs/testing.md` from the run of {record['date']} "
               f"at {record['commit']} ({record['cores']} cores): {_minutes(record['seconds'])} from the first "
               "part's start to the last one's end.")
    lines = [BEGIN, "", heading, "", "| part | status | time | CPU time |", "|---|---|---|---|"]
    for name, result in record["parts"].items():
        lines.append(f"| {name} | {'passed' if result['status'] == 0 else 'FAILED'} | {_minutes(result['seconds'])} "
                     f"| {_minutes(result['cpu_seconds'])} |")
    cases = sorted(_cases(), reverse=True)
    lines += ["", f"The {SLOWEST} slowest tests (`--durations`: setup, call and teardown):", "",
              "| seconds | part | test |", "|---:|---|---|"]
    lines += [f"| {seconds:.1f} | {part} | `{name}` |" for seconds, part, name in cases[:SLOWEST]]
    lines += ["", END]
    return "\n".join(lines)


def write_doc(path: Path) -> None:
    text = path.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    path.write_text(head + section() + tail)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.parts", description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", nargs="*", help="the parts to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the parts and their commands")
    parser.add_argument("--at-once", type=int, default=AT_ONCE, metavar="N",
                        help=f"how many parts run at a time (default {AT_ONCE})")
    parser.add_argument("--doc", type=Path, help="regenerate this file's section from the last run")
    args = parser.parse_args(argv)
    every = {part.name: part for part in parts()}
    if args.doc:
        write_doc(args.doc)
        return 0
    unknown = [name for name in args.parts if name not in every]
    if unknown:
        parser.error(f"no part named {', '.join(unknown)} (parts: {', '.join(every)})")
    chosen = [every[name] for name in args.parts] if args.parts else list(every.values())
    if args.list:
        for part in chosen:
            print(f"{part.name}:\n" + "".join(f"    {' '.join(command)}\n" for command in part.commands))
        return 0
    if args.at_once < 1:
        parser.error(f"--at-once {args.at_once}: at least 1")
    return run(chosen, args.at_once)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
