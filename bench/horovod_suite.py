"""``make horovod-suite HOROVOD_SRC=DIR``: Horovod's own PyTorch tests and examples against popdist_py.horovod.

    python -m bench.horovod_suite --horovod-src DIR [--instances 2,3] [--keep DIR]

DIR is a Horovod checkout or a git directory (a clone's .git, a bare repository, a mirror). Its
test/parallel/test_torch.py (bench/horovod_tests.py) and two PyTorch examples
(bench/horovod_examples.py) are taken into a folder outside this repository (bench/horovod_source.py:
the project runs them, never copies them in) and run under ``poprun --horovod`` at each number of
instances. The results go to bench/horovod_suite.json, and ``python -m bench.run --doc FILE`` puts
their tables (bench/horovod_report.py) in FILE's ``horovod-suite`` section. By hand only: it needs
Horovod's sources, which CI does not have.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from bench import horovod_examples, horovod_tests
from bench.horovod_example import torchvision_ops_load
from bench.horovod_jobs import REPO
from bench.horovod_report import markdown
from bench.horovod_source import SUITE, SourceError, extract
from bench.machine import machine_info

RESULTS = REPO / "bench" / "horovod_suite.json"
log = logging.getLogger("horovod-suite")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def measure(source: Path, instance_counts: list[int], work: Path, timeout_s: float) -> dict[str, Any]:
    """Everything bench/horovod_suite.json records, from a run in ``work``."""
    folder = work / "horovod"
    folder.mkdir()
    commit = extract(source, folder)
    results: dict[str, Any] = {
        "machine": machine_info(), "horovod": {"source": str(source), "commit": commit},
        "torch": _version("torch"),
        "torchvision": {"version": _version("torchvision"), "compiled_ops": torchvision_ops_load()},
        "suite": {"file": SUITE, "pytest_options": list(horovod_tests.PYTEST_OPTIONS), "runs": {}},
    }
    for n in instance_counts:
        log.info("%s at %d instances", SUITE, n)
        run = horovod_tests.run(n, folder, work, timeout_s)
        results["suite"]["runs"][str(n)] = run
        log.info("%s", ", ".join(f"{count} {outcome}" for outcome, count in run["counts"].items()))
    log.info("the examples at %s instances", ", ".join(map(str, instance_counts)))
    results["examples"] = horovod_examples.run(instance_counts, folder, work, timeout_s)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--horovod-src", type=Path, required=True, help="a Horovod checkout or git directory")
    parser.add_argument("--instances", default="2,3", help="comma-separated numbers of instances (default 2,3)")
    parser.add_argument("--timeout", type=float, default=1800, help="each job's bound in seconds (default 1800)")
    parser.add_argument("--output", type=Path, default=RESULTS, help=f"the results' file (default {RESULTS})")
    parser.add_argument("--keep", type=Path, help="run in this new folder (outside the repository) and keep "
                                                  "its logs and junit files; default: a temporary folder")
    args = parser.parse_args()
    try:
        counts = [int(n) for n in args.instances.split(",") if n.strip()]
    except ValueError:
        parser.error(f"--instances {args.instances}: comma-separated numbers")
    if not counts or min(counts) < 1:
        parser.error(f"--instances {args.instances}: at least one number, each at least 1")
    if args.keep and args.keep.resolve().is_relative_to(REPO):
        parser.error(f"--keep {args.keep}: Horovod's files are not to be copied into this repository")
    logging.basicConfig(level=logging.INFO, format="horovod-suite: %(message)s")
    try:
        if args.keep:
            args.keep.mkdir(parents=True)
            results = measure(args.horovod_src.resolve(), counts, args.keep.resolve(), args.timeout)
        else:
            with tempfile.TemporaryDirectory(prefix="horovod-suite-") as work:
                results = measure(args.horovod_src.resolve(), counts, Path(work), args.timeout)
    except SourceError as e:
        parser.error(str(e))
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(markdown(results))
    print(f"horovod-suite: wrote {args.output}")


if __name__ == "__main__":
    main()
