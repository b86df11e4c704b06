"""Imported by every Python child process of a test in `make mutants` (the instance stub, which
runs without site, imports it from its entry script in mutmut's copy).

mutmut learns which tests reach which functions by counting calls in the pytest process only; a
function that runs in a child (poprun, an instance, a script under mpiexec) would count as reached
by no test and its mutants would never run. Here a child appends the name of each function it
reaches, once, to the file ``$MUTMUT_CHILD_HITS``; ``tests/conftest.py`` credits them to the test
that was running. Outside the statistics phase this does nothing.
"""

import os

if os.environ.get("MUTANT_UNDER_TEST") == "stats" and os.environ.get("MUTMUT_CHILD_HITS"):
    import mutmut.mutation.trampoline as _trampoline

    _path = os.environ["MUTMUT_CHILD_HITS"]
    _seen: set[str] = set()

    def _record(name: str, caller: str | None = None) -> None:
        if name not in _seen:
            _seen.add(name)
            try:  # a child run as another user (a test of who may connect) cannot write the file
                fd = os.open(_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            except OSError:
                return
            try:
                os.write(fd, f"{name}\n".encode())
            finally:
                os.close(fd)

    _trampoline.record_trampoline_hit = _record  # type: ignore[attr-defined]  # replaced, not exported
