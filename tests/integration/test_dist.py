"""``make dist`` as a user without a C compiler gets it (issue 41; docs/packaging.md): the wheel is
manylinux_2_17 by auditwheel's own check and holds no path of the machine that built it; the wheel
and the sdist each install into a fresh venv where no compiler is reachable (PATH without one, CC
and CXX a program that fails); from there the MNIST demo and a 2-instance job give the weights of
the compiled install this suite runs in, the wheel's kernels and loopback library do their work,
and where the sdist had to leave out the compiled part a promise needs, the job refuses in one line.

``make dist`` runs once per session, both installs at once (tests/integration/conftest.py), their
dependencies from a wheelhouse at this venv's versions (tests/integration/distribution.py).
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers import BIN, OMP_SET, PYTHON, ROOT
from tests.integration.distribution import (
    DIST_TOOLS,
    EXTENSIONS,
    PROGRAMS,
    RUN_TIMEOUT,
    RUNS_UNDER,
    Dist,
    Installed,
    check,
    outside_env,
    program_path,
    reported_parts,
)
from tests.integration.mnist_output import finals
from tests.integration.test_mnist_train import DEMO
from tests.launcher.test_network_exposure import PROGRAM, _beyond_loopback, _descendants, _open_to, _socket_inodes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the first test waits for make dist and the installs
#: The policy make dist promises (the Makefile's DIST_PLAT on this machine).
PLATFORM = f"manylinux_2_17_{platform.machine()}"
BATCH_INVARIANT, LOOPBACK = (next(name for name, _ in EXTENSIONS if name.endswith(part))
                             for part in ("._batch_invariant", "._loopback"))
SMOKE_JOB = ROOT / "tests" / "scripts" / "smoke_job.py"
DEMO_SCRIPT = ROOT / "examples" / "mnist_rts.py"
#: A 2-instance job that needs no batch-invariant kernel (numpy's products), with its weights
#: sharded (the reduction tree's additions): its weights and each instance's shuffled sampler
#: order (the swap pass), the same in every install on this machine (tests/scripts/smoke_job.py).
JOB = ("--num-instances", "2", "--num-replicas", "4", "--ipus-per-replica", "2")
JOB_ARGS = ("--products", "numpy", "--rts")
JOB_LINE = re.compile(r"\[(\d)\] smoke-job instance=\d of=2 replicas=4 devices=2 weights-sha256 ([0-9a-f]{64}) "
                      r"order-sha256 ([0-9a-f]{64}) trained=True popdist_py=(\S+)")


def outcome(cmd: list[str | Path], cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    """``cmd``'s exit status and its output (stdout, then stderr), within RUN_TIMEOUT."""
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env={**env, **OMP_SET}, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT)
    return done.returncode, done.stdout + done.stderr


def demo(python: Path, env: dict[str, str], cwd: Path) -> tuple[int, str]:
    """``make demo``'s run with the poprun and the python of ``python``'s venv."""
    return outcome([python.parent / "poprun", "--num-instances", "2", "--num-replicas", "4", python, DEMO_SCRIPT,
                    *DEMO], cwd, env)


def compiled_install_env() -> dict[str, str]:
    """The environment of this suite's own install (built in place by the system's compiler)."""
    return outside_env(BIN.parent)


# ------------------------------------------------------------------------------------------ the wheel
def test_the_wheel_is_manylinux_2_17_by_auditwheel(dist: Dist) -> None:
    tags = dist.wheel.name.removesuffix(".whl").split("-")[-1].split(".")
    assert PLATFORM in tags, dist.wheel.name
    shown = check([DIST_TOOLS / "auditwheel", "show", dist.wheel], dist.folder, RUN_TIMEOUT).stdout
    assert f'consistent with the following platform tag: "{PLATFORM}"' in " ".join(shown.split()), shown


def test_the_compiled_parts_hold_no_path_of_the_machine_that_built_them(dist: Dist) -> None:
    """No rpath into this machine's Python, no debug information naming the build's folders."""
    programs = {program_path(name) for name, _ in PROGRAMS}
    with zipfile.ZipFile(dist.wheel) as whl:
        parts = {name: whl.read(name) for name in whl.namelist() if name.endswith(".so") or name in programs}
    assert len(parts) == len(EXTENSIONS) + len(PROGRAMS), sorted(parts)
    for name, data in parts.items():
        held = [path for path in (sys.base_prefix, sys.prefix, str(dist.folder), str(ROOT)) if path.encode() in data]
        assert not held, f"{name} holds {held}"


def test_make_dist_refuses_a_wheel_that_lacks_a_compiled_part(dist: Dist, dist_top: Path) -> None:
    """Each part is optional to pip: a toolchain that fails on one leaves a wheel without it, and
    setuptools goes on; make dist's check fails the target, naming the part."""
    swaps = next(name for name, _ in EXTENSIONS if name.endswith("._swaps"))
    lacking = dist_top / "lacking" / dist.wheel.name
    lacking.parent.mkdir(exist_ok=True)
    with zipfile.ZipFile(dist.wheel) as whole, zipfile.ZipFile(lacking, "w") as part:
        for item in whole.infolist():
            if not item.filename.startswith(swaps.replace(".", "/") + "."):
                part.writestr(item, whole.read(item))
    checker = [sys.executable, "-m", "tests.integration.distribution"]
    assert "$(DIST_VENV)/bin/python -m tests.integration.distribution " in (ROOT / "Makefile").read_text()
    refused = subprocess.run([*checker, str(lacking)], cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1 and swaps in refused.stderr, refused.stderr
    passed = subprocess.run([*checker, str(dist.wheel)], cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert passed.returncode == 0 and not passed.stderr, passed.stderr


# ------------------------------------------------------------------------------- the installs' parts
def test_the_wheel_installed_without_a_compiler_has_every_compiled_part(wheel_install: Installed,
                                                                         dist_top: Path) -> None:
    out = check([wheel_install.venv / "bin" / "poprun", "--version"], dist_top / "away", RUN_TIMEOUT,
                env=wheel_install.env).stdout
    assert reported_parts(out) == {name: "present" for name, _ in (*EXTENSIONS, *PROGRAMS)}, out
    assert out.endswith(f"{RUNS_UNDER}the compiled stub (one supervisor per host) (POPRUN_STUB=compiled)\n"), out


def test_the_wheels_kernels_run_the_instruction_sets_of_the_compiled_install(wheel_install: Installed,
                                                                             dist_top: Path) -> None:
    """zig's runtime has no CPU model for ``__builtin_cpu_supports``: the kernels ask CPUID
    themselves, or the wheel's would take the scalar path on every CPU (60 times slower)."""
    ask = ["-c", "from popdist_py.engine.batch_invariant import ISAS; print(ISAS)"]
    wheel = check([wheel_install.venv / "bin" / "python", *ask], dist_top / "away", RUN_TIMEOUT, env=wheel_install.env)
    here = check([PYTHON, *ask], dist_top / "away", RUN_TIMEOUT, env=compiled_install_env())
    assert wheel.stdout == here.stdout, (wheel.stdout, here.stdout)


def test_the_sdist_installed_without_a_compiler_has_none_and_says_so(sdist_install: Installed,
                                                                      dist_top: Path) -> None:
    """No compiler on its PATH; the build asked the failing CC for every part (nothing else
    compiled one), and went on."""
    triplet = f"{platform.machine()}-linux-gnu"
    for name in ("cc", "gcc", "c++", "g++", "clang", "cpp", f"{triplet}-gcc", f"{triplet}-gcc-12", "zig"):
        assert shutil.which(name, path=sdist_install.env["PATH"]) is None, name
    assert (dist_top / "cc.log").exists(), "the sdist's build never asked the failing CC"
    asked = (dist_top / "cc.log").read_text()
    for name, sources in (*EXTENSIONS, *PROGRAMS):
        assert sources[0] in asked, f"{name}'s build never asked CC: {asked}"
    out = check([sdist_install.venv / "bin" / "poprun", "--version"], dist_top / "away", RUN_TIMEOUT,
                env=sdist_install.env).stdout
    assert reported_parts(out) == {name: "missing" for name, _ in (*EXTENSIONS, *PROGRAMS)}, out
    assert out.endswith(f"{RUNS_UNDER}the stub's Python fallback (one supervisor per host) "
                        "(POPRUN_STUB=python)\n"), out


# -------------------------------------------------------------------------------------------- the jobs
def test_the_demo_from_the_wheel_trains_the_compiled_install_weights(wheel_install: Installed,
                                                                      dist_top: Path) -> None:
    away = dist_top / "away"
    status, out = demo(wheel_install.venv / "bin" / "python", wheel_install.env, away)
    assert status == 0, out
    reference_status, reference = demo(Path(PYTHON), compiled_install_env(), away)
    assert reference_status == 0, reference
    assert sorted(finals(out)) == [0, 1] and set(finals(out).values()) == set(finals(reference).values()), (
        out, reference)


def test_the_demo_from_the_sdist_without_a_compiler_refuses_in_one_line(sdist_install: Installed,
                                                                         dist_top: Path) -> None:
    """Its products need the batch-invariant kernels, which no fallback can stand in for."""
    status, out = demo(sdist_install.venv / "bin" / "python", sdist_install.env, dist_top / "away")
    assert status == 2, out
    refusals = [line for line in out.splitlines() if "mnist_rts.py: error: " in line]
    assert refusals and all(BATCH_INVARIANT in line and "missing" in line for line in refusals), out
    assert "Traceback" not in out and "final:" not in out, out


@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_a_job_gives_the_compiled_install_weights_and_orders(kind: str, request: pytest.FixtureRequest,
                                                             dist_top: Path) -> None:
    """The reduction tree, the sampler's swap pass and the stub's subreaper: compiled in the wheel,
    their fallbacks in the sdist's install; the same bits as the compiled install either way."""
    installed: Installed = request.getfixturevalue(f"{kind}_install")
    python, away = installed.venv / "bin" / "python", dist_top / "away"
    status, out = outcome([python.parent / "poprun", *JOB, python, "-P", SMOKE_JOB, *JOB_ARGS], away, installed.env)
    assert status == 0, out
    reference_status, reference = outcome([BIN / "poprun", *JOB, PYTHON, "-P", SMOKE_JOB, *JOB_ARGS], away,
                                          compiled_install_env())
    assert reference_status == 0, reference
    found = {m.group(1): m.groups()[1:] for m in map(JOB_LINE.fullmatch, out.splitlines()) if m}
    expected = {m.group(1): m.groups()[1:3] for m in map(JOB_LINE.fullmatch, reference.splitlines()) if m}
    assert sorted(found) == sorted(expected) == ["0", "1"], (out, reference)
    assert {tag: (weights, order) for tag, (weights, order, _) in found.items()} == expected
    assert all(Path(where).resolve().is_relative_to(installed.venv.resolve()) for *_, where in found.values())


def test_a_hydra_job_from_the_sdist_without_a_compiler_refuses_in_one_line(sdist_install: Installed,
                                                                            dist_top: Path) -> None:
    """Without the loopback library, Hydra's mpiexec would listen on every interface: nothing starts."""
    python = sdist_install.venv / "bin" / "python"
    status, out = outcome([python.parent / "poprun", "--mpi", python.parent / "mpiexec.hydra",
                                "--num-instances", "2", python, "-c", "print('started')"], dist_top / "away",
                          sdist_install.env)
    assert status == 2, out
    assert len(out.splitlines()) == 1 and LOOPBACK in out and "started" not in out, out


def test_a_hydra_job_from_the_wheel_listens_on_loopback_only(wheel_install: Installed, dist_top: Path) -> None:
    """The wheel's loopback library (built by zig against glibc 2.17), preloaded into Hydra's
    mpiexec, keeps every process of a one-host job on loopback (tests/launcher/test_network_exposure.py
    holds the compiled install to the same)."""
    python, go = wheel_install.venv / "bin" / "python", dist_top / "away" / "go-hydra"
    proc = subprocess.Popen([str(c) for c in (python.parent / "poprun", "--mpi", python.parent / "mpiexec.hydra",
                                              "--num-instances", "2", python, "-c", PROGRAM, go)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=dist_top / "away",
                            env={**wheel_install.env, **OMP_SET})
    try:
        assert proc.stdout is not None
        ready = [proc.stdout.readline(), proc.stdout.readline()]
        assert sorted(ready) == ["[0] ready\n", "[1] ready\n"], proc.communicate(timeout=RUN_TIMEOUT)
        opened = {}
        for pid in _descendants(proc.pid):
            try:
                opened[f"{pid} {Path(f'/proc/{pid}/comm').read_text().strip()}"] = _open_to(_socket_inodes(pid))
            except OSError:
                continue  # gone
        go.touch()
        _, err = proc.communicate(timeout=RUN_TIMEOUT)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, err
    assert {"mpiexec.hydra", "hydra_pmi_proxy"} <= {who.split(" ", 1)[1] for who in opened}, opened
    assert any(opened.values()), opened  # Hydra's own ports were seen
    assert _beyond_loopback([entry for entries in opened.values() for entry in entries]) == [], opened
