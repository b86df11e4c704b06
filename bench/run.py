"""``make bench``: measure side by side, write bench/results.json, results.md and results.png.

    python -m bench.run [--quick] [--sections NAME,...]
    python -m bench.run --doc FILE     # FILE's generated sections from bench/results.json
                                       # (and bench/horovod_suite.json's, make horovod-suite)

Sections: allreduce, launch, scale, scaling, rts_memory, training, pipeline, multihost, matmul, peers, cores,
horovod.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
from pathlib import Path

from bench.horovod_report import DOC_SECTION, doc_section
from bench.machine import machine_info
from bench.report import markdown, plot, write_doc

HERE = Path(__file__).resolve().parent
log = logging.getLogger("bench")
SECTIONS = {"allreduce": "bench.collectives", "launch": "bench.launch", "scale": "bench.scale",
            "scaling": "bench.scaling",
            "rts_memory": "bench.rts_memory", "training": "bench.training", "pipeline": "bench.pipeline",
            "multihost": "bench.multihost", "matmul": "bench.matmul", "peers": "bench.peers", "cores": "bench.cores",
            "horovod": "bench.horovod"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (under a minute)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help="comma-separated subset; the other sections keep their last results")
    parser.add_argument("--doc", type=Path, help="regenerate FILE's marked sections from bench/results.json, "
                                                 "measuring nothing")
    args = parser.parse_args()
    if args.doc:
        results_file, suite_file = HERE / "results.json", HERE / "horovod_suite.json"
        if not results_file.exists() and not suite_file.exists():
            parser.error(f"{results_file} does not exist: run make bench first")
        # the Horovod suite's results, run by hand (make horovod-suite), are a file of their own
        other = {DOC_SECTION: doc_section(json.loads(suite_file.read_text()), args.doc)} if suite_file.exists() else {}
        measured = json.loads(results_file.read_text()) if results_file.exists() else {}
        done = write_doc(args.doc, measured, other)
        print(f"bench: regenerated {', '.join(done) or 'no section'} in {args.doc}")
        return
    logging.basicConfig(level=logging.INFO, format="bench: %(message)s")
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; valid: {', '.join(SECTIONS)}")
    machine = machine_info()
    # sections not measured this time keep their last results (a partial run updates the report)
    previous = HERE / "results.json"
    results: dict[str, object] = json.loads(previous.read_text()) if previous.exists() else {}
    for name in wanted:
        log.info("measuring %s%s", name, " (quick)" if args.quick else "")
        section = importlib.import_module(SECTIONS[name]).run(args.quick)
        section["machine"] = machine
        section["quick"] = args.quick
        results[name] = section
    (HERE / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    table = markdown(results)
    (HERE / "results.md").write_text(table)
    plot(results, HERE / "results.png")
    print(table)


if __name__ == "__main__":
    main()
