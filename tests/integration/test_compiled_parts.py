"""Every compiled part is optional (popcontract/compiled.py): the package runs without each one,
with the same results where a fallback exists and one line of refusal where none can keep the
promise, and says which parts it has.

The installs without a part are copies of the three packages without its built file
(``helpers.install_without``), imported first through PYTHONPATH by poprun, its stubs under real
mpiexec and their programs, as an install built without a C compiler has them; each result is
compared with the same run on this checkout's build, which has all five.
"""

from __future__ import annotations

import ast
import os
import shlex
import shutil
import subprocess
import tomllib
import zipfile
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import numpy as np
import pytest

import popdist_py
from popcontract import compiled
from popdist_py.engine import batch_invariant
from tests.helpers import OMP_SET, POPRUN, PYTHON, ROOT, install_without, job_marker, poprun, run, wait_no_processes
from tests.integration import distribution
from tests.integration.mnist_output import finals

SCRIPTS = ROOT / "tests" / "scripts"
#: ``make demo``'s job: 2 instances x 2 replicas of examples/mnist_rts.py, one epoch (a few seconds).
DEMO = (PYTHON, str(ROOT / "examples" / "mnist_rts.py"), "--optimizer", "adam", "--shard", "weights",
        "--offchip", "optimizer", "--epochs", "1")
#: The parts whose absence a fallback covers, to the same bits.
WITH_FALLBACK = (compiled.SUBREAPER, compiled.TREE, compiled.SWAPS)
MODULES = [part.module for part in compiled.PARTS]


def _pyproject_extensions() -> list[dict[str, object]]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        extensions: list[dict[str, object]] = tomllib.load(f)["tool"]["setuptools"]["ext-modules"]
    return extensions


def test_the_parts_are_pyprojects_extensions_each_optional() -> None:
    # One list: what pyproject builds is what the registry knows, and each may fail to build
    # (a machine without a C compiler installs the package without it).
    extensions = _pyproject_extensions()
    assert [extension["name"] for extension in extensions] == [p.module for p in compiled.PARTS if not p.program]
    assert [extension["name"] for extension in extensions if extension.get("optional") is not True] == []
    # The programs (setup.py builds them, each optional: a failed build is a warning).
    assert [name for name, _ in distribution.PROGRAMS] == [p.module for p in compiled.PARTS if p.program]


def test_this_checkouts_build_has_every_part() -> None:
    # A normal build (make install) builds all five, and each loads: optional must not mean
    # silently skipped where a compiler works. The kernels' k block is the one Python states.
    assert {module: compiled.why_missing(module) for module in MODULES} == dict.fromkeys(MODULES, "")
    assert all(compiled.require(p.module, "a test") is compiled.load(p.module) for p in compiled.PARTS if p.imported)
    kernels = compiled.load(compiled.BATCH_INVARIANT)
    assert kernels is not None and kernels.KC == batch_invariant.KC


def _imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, by full name (``from a.b import c``: ``a.b.c``, and ``a.b``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_only_the_registry_imports_a_compiled_part() -> None:
    # Everyone asks popcontract.compiled (load, require, library): no import of a part elsewhere,
    # so no module can fail at import where a part is missing, nor copy its own try/except.
    wrong = [f"{path.relative_to(ROOT)} imports {module}"
             for folder in ("poprun_py", "popdist_py", "popcontract", "examples", "bench")
             for path in sorted((ROOT / folder).rglob("*.py"))
             for module in sorted(_imports_of(path) & set(MODULES))]
    assert wrong == []


def test_an_unknown_part_is_refused_naming_the_parts() -> None:
    with pytest.raises(ValueError, match=r"^'popdist_py\._nothing' is no compiled part of poprun-py; valid: "
                                         r"popdist_py\.engine\._batch_invariant, "):
        compiled.present("popdist_py._nothing")
    with pytest.raises(ValueError, match=rf"^{compiled.LOOPBACK} is a library to preload, not a module: ask "
                                         r"library\(\) for its path$"):
        compiled.load(compiled.LOOPBACK)


@pytest.mark.slow  # starts python twice, once with a copy of popdist_py
def test_a_parts_file_is_looked_for_in_its_package_wherever_that_was_imported_from(tmp_path: Path) -> None:
    # Not imported: the package's folder beside popcontract's.
    code = "from popcontract import compiled\nprint(compiled.library(compiled.LOOPBACK))"
    found = run([PYTHON, "-c", code], cwd=ROOT)
    assert found.stdout == f"{next((ROOT / 'poprun_py' / 'shared').glob('_loopback.*.so'))}\n", found
    # Imported from elsewhere (a copy of popdist_py without its _swaps): the folder it was imported from.
    shutil.copytree(ROOT / "popdist_py", tmp_path / "popdist_py",
                    ignore=shutil.ignore_patterns("_swaps.*.so", "__pycache__"))
    code = "import popdist_py\nfrom popcontract import compiled\nprint(compiled.missing_line(compiled.SWAPS, 'x'))"
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    missing = run([PYTHON, "-c", code], env=env, cwd=tmp_path)
    assert missing.stdout.startswith(f"x needs {compiled.SWAPS}, a compiled part of poprun-py missing from "
                                     f"{tmp_path / 'popdist_py'} (not built: no C compiler at install); "), missing


#: A program whose output takes every part with a fallback: a shuffled shard and a reduction tree.
SHUFFLED = ("import hashlib, numpy as np\n"
            "from popdist_py.data import shard_indices\n"
            "from popdist_py.engine._collectives.reduce import Program\n"
            "parts = [np.linspace(k, 1 / (k + 1), 5000, dtype=np.float32) for k in range(5)]\n"
            "program = Program((0, 5), [(k, k + 1) for k in range(5)])\n"
            "out = program.run_blocked(parts, np.add, np.empty(5000, np.float32))\n"
            "print(shard_indices(50, 2, shuffle=True, seed=5).tolist(), hashlib.sha256(out.tobytes()).hexdigest())")


@pytest.mark.slow  # builds a wheel and runs a job from its install
@pytest.mark.timeout(240)
def test_a_build_where_the_c_compiler_fails_completes_and_its_install_runs_a_job(tmp_path: Path) -> None:
    # CC=false: every part fails to build, each is skipped (optional), and the wheel holds none;
    # installed, it says so and a 2-instance job runs, with the results of this checkout's build.
    source, wheels, site = tmp_path / "source", tmp_path / "wheels", tmp_path / "site"
    for package in ("poprun_py", "popdist_py", "popcontract"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    pip = [PYTHON, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    built = run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(wheels), str(source)],
                env={"CC": "false"}, cwd=tmp_path, timeout=180)
    assert built.returncode == 0, built.stdout + built.stderr
    [wheel] = wheels.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert [name for name in archive.namelist() if name.endswith(".so")] == []
        programs = [distribution.program_path(name) for name, _ in distribution.PROGRAMS]
        assert [name for name in programs if name in archive.namelist()] == []
        assert "popcontract/compiled.py" in archive.namelist()
    installed = run([*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)], cwd=tmp_path,
                    timeout=180)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    env = {"PYTHONPATH": str(site), **OMP_SET}
    report = run([PYTHON, "-m", "popdist_py"], env=env, cwd=site)
    assert report.stdout.splitlines()[1:] == [f"{part.module}: missing (not built) - {part.without}"
                                              for part in compiled.PARTS], report
    job = poprun("--num-instances", "2", PYTHON, "-c", SHUFFLED, env=env, cwd=site)
    assert job.returncode == 0 and "Traceback" not in job.stderr, job.stderr
    here = poprun("--num-instances", "2", PYTHON, "-c", SHUFFLED, env=OMP_SET)
    assert here.returncode == 0, here.stderr
    assert sorted(job.stdout.splitlines()) == sorted(here.stdout.splitlines()) and len(here.stdout.splitlines()) == 2


@pytest.mark.slow  # starts poprun and python from a copy of the packages
@pytest.mark.parametrize("missing", MODULES)
def test_version_says_which_part_is_missing_and_what_that_means(missing: str, tmp_path: Path) -> None:
    where = tmp_path / "install"
    env = install_without(where, missing)
    expected = [f"{part.module}: missing (not built) - {part.without}" if part.module == missing
                else f"{part.module}: present - {part.role}" for part in compiled.PARTS]
    result = poprun("--version", env=env, cwd=where)
    assert result.returncode == 0 and result.stderr == "", result
    runs = "the stub's Python fallback (one supervisor per host) (POPRUN_STUB=python)" \
        if missing == compiled.STUB else "the compiled stub (one supervisor per host) (POPRUN_STUB=compiled)"
    assert result.stdout.splitlines() == [f"poprun {popdist_py.__version__}", *expected,
                                          f"each instance on this host runs under: {runs}"]
    library = run([PYTHON, "-m", "popdist_py"], env=env, cwd=where)
    assert library.returncode == 0 and library.stderr == "", library
    assert library.stdout.splitlines() == [f"poprun-py {popdist_py.__version__}", *expected]


@pytest.mark.slow  # starts python
def test_python_m_popdist_py_takes_version_help_or_nothing() -> None:
    """An argument it does not take is refused (a usage line, one line naming it, exit 2), never
    answered with the version as if it had been asked; --version says what no argument says."""
    plain = run([PYTHON, "-m", "popdist_py"])
    assert plain.returncode == 0 and plain.stdout.startswith(f"poprun-py {popdist_py.__version__}\n"), plain
    assert run([PYTHON, "-m", "popdist_py", "--version"]).stdout == plain.stdout
    helped = run([PYTHON, "-m", "popdist_py", "-h"])
    assert helped.returncode == 0 and helped.stdout.startswith("usage: python -m popdist_py [-h] [--version]\n")
    for given in ("--bogus", "-V", "version", "--vers", "--version\x1b[2J"):
        refused = run([PYTHON, "-m", "popdist_py", "--version", given])
        assert (refused.returncode, refused.stdout, refused.stderr) == (2, "", (
            "usage: python -m popdist_py [-h] [--version]\n"
            f"python -m popdist_py: error: {given!r} is not an argument; it takes --version, -h/--help or none\n"))


@pytest.mark.slow  # starts python from a copy of the packages
def test_a_build_that_does_not_load_is_missing_with_the_loaders_reason(tmp_path: Path) -> None:
    # A file that is there but no library (a broken install): missing, saying why, never a traceback.
    where = tmp_path / "install"
    env = install_without(where, compiled.SWAPS)
    broken = f"_swaps{EXTENSION_SUFFIXES[0]}"
    (where / "popdist_py" / broken).write_text("not a library")
    result = run([PYTHON, "-m", "popdist_py"], env=env, cwd=where)
    assert result.returncode == 0 and result.stderr == "", result
    line = next(line for line in result.stdout.splitlines() if line.startswith(compiled.SWAPS))
    reason = f"{where / 'popdist_py' / broken}: file too short"  # glibc's dlopen, in the loader's words
    assert line == f"{compiled.SWAPS}: missing ({reason}) - {compiled.part(compiled.SWAPS).without}", line
    # A feature that required it says the loader's reason too, not that no compiler was there.
    code = ("from popcontract import compiled\n"
            "try:\n    compiled.require(compiled.SWAPS, 'the swaps')\n"
            "except compiled.MissingPart as exc:\n    print(exc)\n")
    refused = run([PYTHON, "-c", code], env=env, cwd=where)
    folder = where / "popdist_py"
    assert refused.returncode == 0 and refused.stdout.startswith(
        f"the swaps needs {compiled.SWAPS}, a compiled part of poprun-py missing from {folder} ("), refused
    assert f"({reason}); reinstall poprun-py" in refused.stdout, refused.stdout


@pytest.mark.slow  # starts python twice, once from a copy of the packages
def test_without_swaps_and_tree_the_samplers_and_reductions_give_the_same_bits(tmp_path: Path) -> None:
    script = [PYTHON, str(SCRIPTS / "fallback_results.py")]
    built = run(script)
    where = tmp_path / "install"
    fallback = run(script, env=install_without(where, compiled.SWAPS, compiled.TREE), cwd=where)
    assert built.returncode == fallback.returncode == 0, (built.stderr, fallback.stderr)
    head, lines = 2, built.stdout.splitlines()
    assert lines[:head] == [f"{compiled.SWAPS} True", f"{compiled.TREE} True"]
    assert fallback.stdout.splitlines()[:head] == [f"{compiled.SWAPS} False", f"{compiled.TREE} False"]
    assert len(lines) == head + 5 + 4 + 32
    assert fallback.stdout.splitlines()[head:] == lines[head:]


@pytest.mark.slow  # two 2-instance jobs under poprun
def test_a_training_job_without_the_parts_that_have_a_fallback_gives_the_compiled_weights(tmp_path: Path) -> None:
    # make demo's job (shuffled shards, gradients reduced in the tree, stubs as subreapers) with
    # its three parts missing ends with the weights hash of this checkout's build.
    built = poprun("--num-instances", "2", "--num-replicas", "4", *DEMO, timeout=120)
    where = tmp_path / "install"
    fallback = poprun("--num-instances", "2", "--num-replicas", "4", *DEMO, timeout=120,
                      env=install_without(where, *WITH_FALLBACK), cwd=where)
    assert built.returncode == fallback.returncode == 0, (built.stderr, fallback.stderr)
    assert "Traceback" not in fallback.stderr, fallback.stderr
    assert sorted(finals(built.stdout)) == [0, 1] and len(set(finals(built.stdout).values())) == 1, built.stdout
    assert finals(fallback.stdout) == finals(built.stdout), (fallback.stdout, built.stdout)


#: A program that leaves an orphan (fork, fork, the middle one exits) and says whose child the
#: orphan became: its stub's (the program's parent), when the stub is its descendants' subreaper.
ORPHAN = """
import os
stub = os.getppid()
go, asked = os.pipe()
answer, told = os.pipe()
middle = os.fork()
if middle == 0:
    if os.fork() == 0:
        os.read(go, 1)  # until the middle process has ended and been collected
        os.write(told, str(os.getppid()).encode())
        os._exit(0)
    os._exit(0)
os.waitpid(middle, 0)
os.write(asked, b"x")
parent = int(os.read(answer, 32))
print("adopted by its stub" if parent == stub else f"adopted by {parent}, not its stub {stub}", flush=True)
"""


@pytest.mark.slow  # starts poprun
@pytest.mark.parametrize("instances", [1, 2])
@pytest.mark.parametrize("build", ["compiled", "without"])
def test_jobs_run_without_the_subreaper_and_the_stub_still_adopts_orphans(build: str, instances: int,
                                                                         tmp_path: Path) -> None:
    # The same prctl call through libc: a plain job runs, no traceback, and an orphan of the
    # program goes to its stub, as with the compiled part.
    where = tmp_path / "install" if build == "without" else ROOT
    env = install_without(where, compiled.SUBREAPER) if build == "without" else {}
    plain = poprun("--num-instances", str(instances), "true", env=env, cwd=where)
    assert (plain.returncode, plain.stdout) == (0, ""), plain
    assert "Traceback" not in plain.stderr, plain.stderr
    result = poprun("--num-instances", str(instances), PYTHON, "-c", ORPHAN, env={**env, "OMP_NUM_THREADS": "1"},
                    cwd=where)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [f"[{i}] adopted by its stub" for i in range(instances)]


@pytest.mark.slow  # starts poprun
def test_without_the_subreaper_a_daemon_that_cleared_its_environment_still_ends_with_the_job(tmp_path: Path) -> None:
    # Only a subreaper finds such a daemon (nothing in its environment says whose it is): with the
    # fallback's prctl the stubs adopt and end it, as tests/launcher/test_poprun_failures.py's does.
    marker = job_marker()
    where = tmp_path / "install"
    result = poprun("--num-instances", "2", PYTHON, str(SCRIPTS / "leave_daemon.py"), marker, "ok", "bare",
                    env=install_without(where, compiled.SUBREAPER), cwd=where)
    assert result.returncode == 0, result.stderr
    assert wait_no_processes(marker) == []


def _refusal(missing: str, feature: str, where: Path) -> str:
    """The one line a use of ``feature`` gives in a copy at ``where`` without part ``missing``."""
    folder = where.joinpath(*missing.split(".")[:-1])
    return (f"{feature} needs {missing}, a compiled part of poprun-py missing from {folder} (not built: no C "
            "compiler at install); reinstall poprun-py from its wheel, or from source where a C compiler works "
            "(python -m popdist_py lists the parts)")


@pytest.mark.slow  # starts python from a copy of the packages
def test_without_batch_invariant_its_products_refuse_in_one_line_at_first_use(tmp_path: Path) -> None:
    # numpy cannot promise matmul's bits on every CPU: no fallback, the one line instead. Importing
    # the module (and the engine) still works: only a call refuses.
    code = ("import numpy as np, popdist_py\n"
            "from popdist_py.engine import Runtime, batch_invariant\n"
            "x = np.ones((2, 3), np.float32)\n"
            "for call in (lambda: batch_invariant.matmul(x, x.T), lambda: batch_invariant.outer_sum(x, x),\n"
            "             batch_invariant.check_kernels):\n"
            "    try:\n"
            "        call()\n"
            "    except popdist_py.MissingPart as exc:\n"
            "        print(exc)\n")
    where = tmp_path / "install"
    result = run([PYTHON, "-c", code], env=install_without(where, compiled.BATCH_INVARIANT), cwd=where)
    assert result.returncode == 0, result.stderr
    name = "popdist_py.engine.batch_invariant"
    assert result.stdout.splitlines() == [
        _refusal(compiled.BATCH_INVARIANT, f"{name}.matmul", where),
        _refusal(compiled.BATCH_INVARIANT, f"{name}.outer_sum", where),
        _refusal(compiled.BATCH_INVARIANT, f"the batch-invariant products ({name})", where)]
    built = run([PYTHON, "-c", code + "print(batch_invariant.matmul(x, x.T).tolist())"])
    assert built.returncode == 0 and built.stdout == f"{np.full((2, 2), 3.0).tolist()}\n", built


@pytest.mark.slow  # a 2-instance job under poprun
def test_without_batch_invariant_the_demo_refuses_in_one_line_per_instance(tmp_path: Path) -> None:
    where = tmp_path / "install"
    result = poprun("--num-instances", "2", "--num-replicas", "4", *DEMO, timeout=120,
                    env={**install_without(where, compiled.BATCH_INVARIANT), **OMP_SET}, cwd=where)
    assert result.returncode == 2 and result.stdout == "", result
    line = "mnist_rts.py: error: " + _refusal(compiled.BATCH_INVARIANT,
                                              "the batch-invariant products (popdist_py.engine.batch_invariant)",
                                              where)
    # The first to refuse ends the job (the other may be stopped before it says it too); poprun's
    # report of that instance quotes its stderr: the one line.
    own = [text for text in result.stderr.splitlines() if text.startswith("[")]  # the instances' own lines
    assert own and set(own) <= {f"[0] {line}", f"[1] {line}"}, result.stderr
    assert f"    {line}" in result.stderr.splitlines(), result.stderr
    assert "Traceback" not in result.stderr, result.stderr


@pytest.mark.slow  # starts poprun from a copy of the packages
def test_without_loopback_a_launcher_that_would_listen_everywhere_refuses_naming_the_part(tmp_path: Path) -> None:
    # Hydra's mpiexec named: it binds every interface. One line, exit 2, nothing started;
    # tests/launcher/test_network_exposure.py holds the same for Open MPI and gforker's run.
    where = tmp_path / "install"
    ran = tmp_path / "ran"
    hydra = Path(PYTHON).parent / "mpiexec"
    result = run([*POPRUN, "--mpi", str(hydra), "--num-instances", "2", "/bin/sh", "-c",
                  f"touch {shlex.quote(str(ran))}"], env=install_without(where, compiled.LOOPBACK), cwd=where)
    feature = f"{hydra} would listen on every interface: keeping it on loopback in a one-host job"
    assert (result.returncode, result.stdout) == (2, ""), result
    assert result.stderr == f"poprun: error: {_refusal(compiled.LOOPBACK, feature, where)}\n"
    assert not ran.exists()


@pytest.mark.slow  # starts python
def test_the_libc_subreaper_is_reached_only_where_the_part_is_missing() -> None:
    # ctypes costs every instance's start about 2 ms: the stub imports it on the fallback's path only.
    code = "import sys\nfrom poprun_py.shared import sweep\nprint(sweep.adopt_orphans(), 'ctypes' in sys.modules)"
    done = subprocess.run([PYTHON, "-S", "-c", code],
                          capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert (done.returncode, done.stdout) == (0, "True False\n"), done
