"""The benchmark workers and report, run for real at the smallest sizes (`make bench` is the measurement)."""

from __future__ import annotations

import json
import math
import resource
import subprocess
from typing import Any

import pytest

from bench import launch, pipeline, report, scale, scaling, training
from bench.machine import machine_info
from bench.timing import time_commands
from popcontract import environment
from tests.helpers import PYTHON, STUB_MODES, poprun, run

# Every test starts the workers (under poprun or alone), several of them in processes that each import
# torch: on two cores busy with make test's other parts one took more than the suite's 120 s.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _json_line(stdout: str) -> dict[str, Any]:
    line = [ln for ln in stdout.splitlines() if "{" in ln][-1]
    parsed: dict[str, Any] = json.loads(line[line.index("{"):])
    return parsed


def test_engine_and_raw_all_reduce_are_timed_in_one_job() -> None:
    out = poprun("--num-instances", "2", "--num-replicas", "4",
                 PYTHON, "-m", "bench.collectives_worker", "engine+raw", "allreduce", "1024", "65536")
    assert out.returncode == 0, out.stderr
    got = _json_line(out.stdout)
    assert set(got) == {"1024", "65536"}
    for times in got.values():
        assert set(times) == {"engine", "raw"}
        # Only that both were timed: how fast they are is `make bench`'s collectives section.
        assert all(isinstance(t, float) and math.isfinite(t) and t > 0 for t in times.values())


def test_unknown_worker_mode_is_named() -> None:
    out = run([PYTHON, "-m", "bench.collectives_worker", "fast", "allreduce", "1024"])
    assert out.returncode != 0
    assert "mode 'fast' is not one or more of engine, threads, cooperative, raw, gloo joined by '+'" in out.stderr


def test_scaling_section_reports_both_batches_and_its_target() -> None:
    section: dict[str, Any] = scaling.run(quick=True)  # the report's JSON, read key by key
    assert set(section["samples_per_s"]) == {"1_instance", "2_instances", "1_instance_2_replicas"}
    assert all(v > 0 for v in section["samples_per_s"].values())
    small = section["small_batch"]
    assert small["global_batch"] == scaling.SMALL_BATCH < scaling.GLOBAL_BATCH
    assert small["speedup_2_instances"] == small["samples_per_s"]["2_instances"] / small["samples_per_s"]["1_instance"]
    target = section["target"]
    assert target["value"] == section["speedup_2_instances"] and target["holds"] == (target["value"] >= 1.7)
    table = report.markdown({"scaling": section})
    assert f"| 2 instances, global batch {scaling.SMALL_BATCH} |" in table
    assert f"(global batch {scaling.GLOBAL_BATCH}) | ? | 1.7 |" in table  # "?": no machine, no host cores


def test_training_section_reports_every_setting_split_and_target() -> None:
    section: dict[str, Any] = training.run(quick=True, size=(2, 64), rounds=1)  # tiny weights: the shape of the section
    for split in ("1x4", "2x2"):
        got = section["splits"][split]
        assert list(got["steps"]["seconds"]) == list(training.SETTINGS)
        assert all(t > 0 for t in got["steps"]["seconds"].values())
        assert got["state"]["ratio"]["replicated"] == 1.0
        assert got["state"]["ratio"]["weights_sharded"] < got["state"]["ratio"]["optimizer_sharded"] < 1.0
        assert got["state"]["file_mib"]["off_chip"] > 0 == got["state"]["file_mib"]["replicated"]
        assert got["fused_ratio"] == got["fused_seconds"]["fused"] / got["fused_seconds"]["one_all_reduce"]
    assert len(section["targets"]) == 2 * (len(training.MEMORY_LIMITS) + len(training.TIME_LIMITS)) + 2
    assert all(t["holds"] == (t["value"] <= t["limit"]) for t in section["targets"])
    table = report.markdown({"training": section})
    assert "| weights sharded | " in table and "| fused / one all-reduce | " in table
    assert "| fused reduction 200 x 16 KiB / one all-reduce of the bytes, 2 instances x 2 replicas | ? | 1.3 |" in table


@pytest.mark.timeout(90)
def test_pipeline_section_reports_every_mode_the_bubble_the_stash_and_its_target() -> None:
    section: dict[str, Any] = pipeline.run(quick=True, size=(64, 8, 4), rounds=2)  # tiny layers: the section's shape
    assert set(section["samples_per_s"]) == set(pipeline.MODES)
    assert all(v > 0 for v in section["samples_per_s"].values())
    assert section["bitwise_equal"] is True  # the worker asserts it
    assert section["ideal_bubble"] == pytest.approx(1 / 5)  # (K - 1) / (M + K - 1), K=2, M=4
    assert all(0.0 <= b < 1.0 for b in section["bubble"].values())
    assert section["stashed"] == {"sequential": [1, 1], "1f1b": [2, 1], "gpipe": [4, 4]}
    assert section["stash_mib"]["gpipe"][0] == 2 * section["stash_mib"]["1f1b"][0] > 0
    assert all(v > 0 for v in section["peak_rss_mib"].values()) and section["two_core_capacity"] > 0
    target, sync = section["targets"]
    assert target["value"] == section["speedup"]["1f1b"] and target["holds"] == (target["value"] >= 1.6)
    assert set(section["sync"]["over_full"]) == {"single_pipeline", "replica_and_ladder"}
    assert sync["value"] == max(section["sync"]["over_full"].values()) and section["sync"]["feed_ms"] > 0
    table = report.markdown({"pipeline": section})
    assert "| pipeline with a host feed" in table and "| single_pipeline | " in table
    assert "| 1F1B on 2 devices | " in table and "| GPipe on 2 devices | " in table
    assert "GPipe step / 1F1B step" in table
    assert "| pipeline: 1F1B on 2 devices / the same stages on 1 device, samples/s | ? | 1.6 |" in table


def test_matmul_section_times_each_product_and_checks_the_invariance() -> None:
    from bench import matmul_worker

    row: dict[str, Any] = matmul_worker.measure(16, 64, 32, rounds=2)
    assert row["rows_alone_equal_the_call"] is True
    assert set(row["ratio"]) == {"forward", "input_grad", "weight_grad"}
    assert all(v > 0 for v in row["ratio"].values())
    target = {"what": "matmul", "limit": 1.3, "value": 1.0, "holds": True}
    text = report.markdown({"matmul": {"rows": [row], "rounds": 2, "target": target}})
    assert "| 16x64x32 |" in text and "Rows computed alone equal the rows of the whole call: yes" in text


@pytest.mark.parametrize("stub", STUB_MODES)
def test_the_launch_section_measures_what_runs_each_instance_and_renders(stub: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(environment.STUB, stub)
    own = launch.per_instance_cost(rounds=1)  # refuses a probe whose parent is not what runs it
    cpu, rss = own["cpu_seconds"], own["peak_rss_mib"]
    assert own["runs_under"] == stub and cpu["runs"] == rss["runs"] == 2  # type: ignore[index]
    # Less than a second and a GiB; a Python interpreter's own more than 4 MiB (a shell holds about 2).
    assert 0 < cpu["median"] < 1 and (4 if stub != "compiled" else 0) < rss["median"] < 1024  # type: ignore[index]
    section = {"mpi_init": {"seconds": {"mpiexec": {"median": 0.1}, "poprun": {"median": 0.15}}, "ratio": 1.5},
               "pass": {"seconds": {"mpiexec": {"median": 0.01}, "poprun": {"median": 0.05}}, "ratio": 5.0},
               "per_instance": own}
    table = report.markdown({"launch": section})
    assert "| `pass` | " in table and "peak resident" in table, table


def test_the_scale_section_times_both_launchers_by_size_reads_their_memory_and_renders(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TRUE_COUNTS_QUICK", "MPI_COUNTS_QUICK"):  # the shape of the rows, not 1,024 instances
        monkeypatch.setattr(scale, name, (1, 2))
    monkeypatch.setattr(scale, "MEMORY_COUNTS_QUICK", (1, 3))
    # The test hosts are the hosts part's (tests/parts.py): make bench measures that row.
    monkeypatch.setattr(scale, "across_hosts", lambda quick: {"skipped": "the test hosts are another part's"})
    section = scale.run(quick=True)
    for key in ("true", "mpi_import"):
        rows = section[key]
        assert list(rows) == ["1", "2"]  # type: ignore[call-overload]
        for row in rows.values():  # type: ignore[attr-defined]
            assert set(row["seconds"]) == set(row["cpu_seconds"]) == {"mpiexec", "poprun"}
            assert all(s["median"] > 0 for s in (*row["seconds"].values(), *row["cpu_seconds"].values()))
            assert row["ratio"] == row["seconds"]["poprun"]["median"] / row["seconds"]["mpiexec"]["median"]
    memory = section["memory"]
    # each job's tree holds its instances' `cat`s at least (a few hundred KiB each), and less than a GiB
    assert all(0.1 < memory[c][who][k] < 1024 for c in ("1", "3") for who in ("mpiexec", "poprun")  # type: ignore[index]
               for k in ("uss_mib", "pss_mib"))
    assert section["added_memory"]["per_host_uss_mib"] == (  # type: ignore[index]
        memory["1"]["poprun"]["uss_mib"] - memory["1"]["mpiexec"]["uss_mib"])  # type: ignore[index]
    assert {t["what"] for t in section["targets"]} >= {  # type: ignore[attr-defined]
        "CPU poprun adds per instance (ms)", "unique memory poprun adds per instance (MiB)",
        "poprun / mpiexec, 2 MPI instances importing mpi4py"}
    table = report.markdown({"scale": section})
    assert "| `/bin/true`, instances |" in table and "| 3 | " in table and "poprun adds per instance" in table, table
    assert "Across hosts: not measured (the test hosts are another part's)." in table
    row = {"median": 0.5}
    section["hosts"] = {"hosts": ["node0", "node1", "node2"], "per_host": 64, "ratio": 1.2,
                        "seconds": {"mpiexec": row, "poprun": row}, "cpu_seconds_here": {"mpiexec": row, "poprun": row}}
    assert "| node0, node1, node2 | 500.0 | 500.0 | 1.20 |" in report.markdown({"scale": section})
    # every job starts under the usual soft limit of open files, whatever this process's is
    limit = subprocess.run(["sh", "-c", "ulimit -Sn"], preexec_fn=scale.limited, capture_output=True, text=True,
                           check=True, timeout=30)
    assert int(limit.stdout) == min(scale.SOFT_FILE_LIMIT, resource.getrlimit(resource.RLIMIT_NOFILE)[1])


@pytest.mark.parametrize("click", [False, True], ids=["floor", "floor_click"])
def test_the_launch_floor_starts_each_program_from_gforker_through_a_python_hop(click: bool) -> None:
    """The floor runs what its docstring says: N programs, each the child of mpiexec.gforker (the
    ``python -S`` hop exec'd itself away), with MPICH's rank variables."""
    probe = ("import os; parent = open(f'/proc/{os.getppid()}/comm').read().strip(); "
             "os.write(1, f\"{os.environ['PMI_RANK']} {os.environ['PMI_SIZE']} {parent}\\n\".encode())")
    out = run([PYTHON, launch.FLOOR, *(["--click"] if click else []), "3", PYTHON, "-c", probe])
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == [f"{rank} 3 mpiexec.gforker" for rank in range(3)], out.stdout


def test_the_launch_floor_renders_beside_bare_mpiexec_and_poprun() -> None:
    """The floor's rows and how poprun's time over bare mpiexec divides, from one measured round."""
    program = [PYTHON, "-c", "pass"]
    times = time_commands({
        "mpiexec": [str(launch.BIN / "mpiexec"), "-n", "2", *program],
        "poprun": [str(launch.BIN / "poprun"), "--num-instances", "2", *program],
        "floor": [PYTHON, launch.FLOOR, "2", *program],
        "floor_click": [PYTHON, launch.FLOOR, "--click", "2", *program]}, rounds=1)
    row = {"seconds": times, "ratio": times["poprun"]["median"] / times["mpiexec"]["median"]}
    table = report.markdown({"launch": {"mpi_init": row, "pass": row}})
    assert "| the same, after click's import | " in table and "ms click's import, and" in table, table
    floor = times["floor"]["median"] / times["mpiexec"]["median"]
    shown = f"{report.ms(times['floor']['median'])} ({floor:.2f})"
    assert f"| interpreter, gforker, a `python -S` hop per instance | {shown} |" in table, table


# The peers section's pieces, torch 2.13.0 and this project side by side at the smallest sizes (the
# figures are `make bench`'s), each a test of its own: each starts 4-process torch jobs, and each is
# bounded on its own.
def test_the_peers_sampler_piece_compares_both_samplers_and_renders() -> None:
    pytest.importorskip("torch")
    from bench import peers

    section: dict[str, Any] = {"sampler": peers.sampler([1000, 1001], rounds=1)}  # lists asserted identical inside
    assert [row["n"] for row in section["sampler"]] == [1000, 1001]
    assert "| n = 1,001 |" in report.markdown({"peers": section})


def test_the_peers_launch_piece_times_all_three_launchers_and_renders() -> None:
    pytest.importorskip("torch")
    from bench import peers

    section: dict[str, Any] = {"launch": peers.launch(rounds=1)}
    assert set(section["launch"]["seconds"]) == {"mpiexec", "poprun", "torchrun"}
    assert "torchrun 2.13.0 |" in report.markdown({"peers": section})


def test_the_peers_collectives_piece_measures_both_sides_and_renders() -> None:
    pytest.importorskip("torch")
    from bench import peers

    section: dict[str, Any] = {"collectives": peers.collectives([1 << 20], rounds=1, ops=("allreduce", "broadcast"))}
    [reduced] = section["collectives"]["allreduce"]
    assert {"gloo_4", "engine_4x1", "engine_2x2", "mpi4py_4"} <= set(reduced) and reduced["gloo_4"] > 0
    [broadcast] = section["collectives"]["broadcast"]
    assert "engine_4x1" not in broadcast and broadcast["mpi4py_4_over_gloo"] > 0
    assert "| 1 MiB |" in report.markdown({"peers": section})


def test_the_peers_training_piece_measures_both_sides_and_renders() -> None:
    pytest.importorskip("torch")
    from bench import peers

    section: dict[str, Any] = {"training": peers.training(rounds=1, steps=1, global_batch=64)}
    assert all(v > 0 for by_n in section["training"]["samples_per_s"].values() for v in by_n.values())
    assert "| 2 process(es) |" in report.markdown({"peers": section})


def test_the_cores_section_measures_threads_splits_and_training_and_renders() -> None:
    """Local replicas against processes with a replica per core, at the smallest sizes."""
    pytest.importorskip("torch")
    from bench import cores

    section: dict[str, Any] = cores.run(quick=True, reduction_bytes=4 << 20, split_bytes=1 << 20, global_batch=64,
                                        cut_sizes=(1 << 20, 2 << 20))
    R = section["replicas"]
    assert cores.replicas() == R and section["reduction"]["threads"] == section["cores"]
    rows = section["reduction"]["local_replicas"]
    assert set(rows) == {str(L) for L in {2, 4, R}}
    for by_op in rows.values():
        assert set(by_op) == {"allreduce", "reduce_scatter", "allgather"}
        assert all(t["speedup"] == t["one_thread"] / t["threads"] > 0 for t in by_op.values())
    assert section["reduction"]["memory_limit"]["speedup"] > 0
    cut = section["cutting"]["local_replicas"]
    assert set(cut) == {str(L) for L in {2, R}}
    for by_size in cut.values():
        assert set(by_size) == {str(1 << 20), str(2 << 20)}
        assert all(t["speedup"] == t["one_thread"] / t["threads"] > 0 for t in by_size.values())
    steps = section["steps"]["seconds"]
    assert set(steps) == {"threads", "cooperative"}
    assert all(set(t) == {str(L) for L in {1, 2, 4, R}} and min(t.values()) > 0 for t in steps.values())
    splits = section["splits"]["seconds"]
    assert set(splits) == {f"mpi4py_{R}_ranks"} | {f"{i}x{R // i}" for i in range(1, R + 1) if R % i == 0}
    assert set(section["training"]["samples_per_s"]) == {
        f"engine_{R}_processes", f"engine_1x{R}", f"torch_ddp_{R}_processes", f"engine_1x{R}_poprun_blas_threads"}
    whats = [t["what"] for t in section["targets"]]
    threads = f"one thread / {section['cores']} threads (at least)"
    assert whats[:3] == [f"in-process all-reduce 4 MiB, 2 replicas: {threads}",
                         f"in-process all-reduce 4 MiB, 4 replicas: {threads}",
                         f"training samples/s: 1 x {R} replicas / {R} processes (at least)"]
    assert len(whats) == (6 if R >= cores.MANY_CORES else 3)
    for t in section["targets"]:
        assert t["holds"] == (t["value"] >= t["limit"] if "at least" in t["what"] else t["value"] <= t["limit"])
    section["machine"] = machine_info()  # the host cores the target table shows
    table = report.markdown({"cores": section})
    assert f"| engine 1x{R} |" in table and "| allreduce, 4 local replicas |" in table
    assert "| engine time per Trainer step, negligible model (us) | L = 1 | L = 2 |" in table
    assert (f"| all-reduce cut over {section['cores']} threads at every size: one thread / cut | 1 MiB per replica | "
            "2 MiB per replica |") in table and "| 2 local replicas | " in table
    assert f"| training samples/s: 1 x {R} replicas / {R} processes (at least) | {section['cores']} | 1.0 |" in table


def test_the_small_all_reduce_is_timed_under_each_executor_beside_a_thread_hand_off() -> None:
    from bench import collectives

    lat: dict[str, Any] = collectives.latency(1024)
    assert set(lat["seconds"]) == {"2x2", "1x2"} and set(lat["seconds"]["2x2"]) == {"threads", "cooperative", "raw"}
    assert set(lat["auto"].values()) <= {"threads", "cooperative"} and lat["handoff_seconds"] > 0
    table = "\n".join(report._latency(lat))
    assert "| 2x2 |" in table and "| 1x2 | - |" in table and "One hand-off between two Python threads" in table


def test_the_horovod_section_compares_with_ddp_and_mpi4py_and_renders() -> None:
    """Horovod's API beside DDP and mpi4py in the same 2 processes, at the smallest sizes."""
    pytest.importorskip("torch")
    from bench import horovod

    section: dict[str, Any] = horovod.run(quick=True, sizes=[1024, 1 << 20], steps=(1, 2))
    trained = section["training"]  # the worker fails when the two models' parameters end apart
    assert set(trained["seconds"]) == {"horovod", "ddp"} and min(trained["seconds"].values()) > 0
    assert trained["rounds"] == 2 and trained["steps"] == 3 and trained["max_abs_change"] > 0
    assert [row["bytes"] for row in section["allreduce"]] == [1024, 1 << 20]
    for row in section["allreduce"]:
        assert row["ratio"] == row["horovod"] / row["mpi4py"] > 0
        assert row["in_place_ratio"] == row["horovod_in_place"] / row["mpi4py"] > 0
    assert [t["what"] for t in section["targets"]] == [
        "horovod: DistributedOptimizer step / torch DDP (gloo) step, 2 processes",
        "horovod: hvd.allreduce 1 MiB / mpi4py Allreduce, 2 ranks"]
    assert all(t["holds"] == (t["value"] <= t["limit"]) for t in section["targets"])
    table = report.markdown({"horovod": section})
    assert "| hvd.DistributedOptimizer (ms) | torch DDP, gloo (ms) | ratio |" in table
    assert "| hvd.allreduce_ in place (ms) | in place / mpi4py |" in table
    assert "| 1 KiB | " in table and "| 1 MiB | " in table
    assert "| horovod: hvd.allreduce 1 MiB / mpi4py Allreduce, 2 ranks | ? | 1.1 |" in table
