"""Turn results.json into the markdown tables docs/benchmarks.md shows and a plot."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

MiB = 1 << 20


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // 1024} KiB"


def ms(seconds: float) -> str:
    """``seconds`` as the tables show milliseconds: three decimals below 10 ms, one above."""
    return f"{seconds * 1e3:.3f}" if seconds < 0.01 else f"{seconds * 1e3:.1f}"


def markdown(results: dict[str, Any]) -> str:
    lines: list[str] = []
    machines = {name: s["machine"] for name, s in results.items() if isinstance(s, dict) and "machine" in s}
    if machines:
        machine = max(machines.values(), key=lambda m: m["date"])
        lines.append(f"Measured on {machine['cores']} cores ({machine['cpu']}), {machine['mpi_library']}, "
                     f"Python {machine['python']}; medians of interleaved runs.")
        dates = ", ".join(f"{name} {m['date']}{' (quick)' if results[name].get('quick') else ''}"
                          for name, m in machines.items())
        lines += [f"Sections measured: {dates}.", ""]
    if "allreduce" in results:
        section = results["allreduce"]
        lines += [("| all-reduce per replica | engine 2x2 (ms) | mpi4py 4 ranks (ms) | mpi4py 2 ranks (ms) | "
                   "engine busbw (GB/s) | engine / 4 ranks | engine / 2 ranks |"), "|---|---|---|---|---|---|---|"]
        for row in section["allreduce"]:
            lines.append(f"| {_size(row['bytes_per_replica'])} | {ms(row['engine_2x2']['seconds'])} | "
                         f"{ms(row['mpi4py_flat_4']['seconds'])} | {ms(row['mpi4py_raw_2']['seconds'])} | "
                         f"{row['engine_2x2']['busbw_GBps']:.2f} | {row['ratio_engine_to_flat_4']:.2f} | "
                         f"{row['ratio_engine_to_raw_2']:.2f} |")
        lines.append("")
        if "latency_1k" in section:
            lines += _latency(section["latency_1k"])
        for op in ("allgather", "reduce_scatter"):
            name = op.replace("_", "-")
            lines += [f"| {name} per replica | engine 2x2 (ms) | mpi4py 4 ranks (ms) | engine / 4 ranks |",
                      "|---|---|---|---|"]
            lines += [f"| {_size(r['bytes_per_replica'])} | {ms(r['engine_2x2']['seconds'])} | "
                      f"{ms(r['mpi4py_flat_4']['seconds'])} | {r['ratio_engine_to_flat_4']:.2f} |"
                      for r in section[op]]
            lines.append("")
    if "launch" in results:
        lines += _launch(results["launch"])
    if "scale" in results:
        lines += _scale(results["scale"])
    if "scaling" in results:
        s = results["scaling"]
        lines += [f"| scaling: {s['model']} | samples/s | speedup |", "|---|---|---|"]
        lines += _relative_rows(s["samples_per_s"], ".0f")
        if "small_batch" in s:
            small = s["small_batch"]
            lines += _relative_rows(small["samples_per_s"], ".0f", f", global batch {small['global_batch']}")
        lines.append("")
    if "rts_memory" in results:
        m = results["rts_memory"]
        lines += [f"| state memory per process ({m['description']}) | MiB | vs replicated |", "|---|---|---|"]
        lines += _relative_rows(m["mib"], ".1f")
        lines.append("")
    if "training" in results:
        lines += _training(results["training"])
    if "pipeline" in results:
        lines += _pipeline(results["pipeline"])
    if "matmul" in results:
        lines += _matmul(results["matmul"])
    if "peers" in results:
        lines += _peers(results["peers"])
    if "multihost" in results:
        lines += _multihost(results["multihost"])
    if "cores" in results:
        lines += _cores(results["cores"])
    if "horovod" in results:
        lines += _horovod(results["horovod"])
    lines += _targets(results)
    return "\n".join(lines) + "\n"


#: The launch floor's rows: what each runs, and its key in a launch row's seconds.
FLOOR_ROWS = (("floor", "interpreter, gforker, a `python -S` hop per instance"),
              ("floor_click", "the same, after click's import"), ("poprun", "poprun"))


def _launch_floor(launch: dict[str, Any]) -> list[str]:
    """The floor of a launcher shaped like poprun beside poprun (``bench/launch_floor.py``), and how
    poprun's time over bare mpiexec divides between that floor, click's import and its own work."""
    rows = [name for name in ("mpi_init", "pass") if "floor" in launch[name]["seconds"]]
    if not rows:
        return []
    labels = {"mpi_init": "`from mpi4py import MPI`", "pass": "`pass`"}
    lines = ["| launch, 2 instances (ms, and / bare mpiexec) | " + " | ".join(labels[n] for n in rows) + " |",
             "|---|" + "---|" * len(rows)]
    for key, label in FLOOR_ROWS:
        cells = []
        for name in rows:
            seconds = launch[name]["seconds"]
            cells.append(f"{ms(seconds[key]['median'])} ({seconds[key]['median'] / seconds['mpiexec']['median']:.2f})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    median = {key: value["median"] for key, value in launch[rows[0]]["seconds"].items()}
    text = (f"For {labels[rows[0]]}, poprun adds {ms(median['poprun'] - median['mpiexec'])} ms to bare mpiexec: "
            f"{ms(median['floor'] - median['mpiexec'])} ms are the floor's interpreters, "
            f"{ms(median['floor_click'] - median['floor'])} ms click's import, and "
            f"{ms(median['poprun'] - median['floor_click'])} ms poprun's own work (its modules, the plan, the control "
            "channel and each stub's exchange with it, the output, the supervision and the end).")
    return [*lines, "", text, ""]


def _launch(launch: dict[str, Any]) -> list[str]:
    lines = ["| launch, 2 instances | bare mpiexec (ms) | poprun (ms) | ratio |", "|---|---|---|---|"]
    for name, label in (("mpi_init", "`from mpi4py import MPI`"), ("pass", "`pass`")):
        entry = launch[name]
        lines.append(f"| {label} | {ms(entry['seconds']['mpiexec']['median'])} | "
                     f"{ms(entry['seconds']['poprun']['median'])} | {entry['ratio']:.2f} |")
    if "skewed_exit" in launch:
        skew = launch["skewed_exit"]
        lines.append(f"| CPU used when instances end {skew['skew_seconds']:g} s apart | "
                     f"{ms(skew['cpu_seconds']['mpiexec'])} | {ms(skew['cpu_seconds']['poprun'])} | "
                     f"{skew['ratio']:.2f} |")
    return [*lines, "", *_launch_floor(launch), *_instance_side(launch)]


def _instance_side(launch: dict[str, Any]) -> list[str]:
    """The launch section's cost of what runs each instance (a shim before issue 50, then a stub)."""
    own = launch.get("per_instance") or launch.get("shim")
    if own is None:
        return []
    what = {"compiled": "compiled stub", "python": "Python stub", "shim": "shim"}[own.get("runs_under", "shim")]
    return [(f"What runs each instance (the {what}), up to its program's end (read from /proc by the program, "
             f"{own['cpu_seconds']['runs']} of them): {ms(own['cpu_seconds']['median'])} ms of CPU, "
             f"{own['peak_rss_mib']['median']:.1f} MiB peak resident."), ""]


def _scale(scale: dict[str, Any]) -> list[str]:
    """The scale section: jobs by size, poprun beside bare mpiexec; the memory; what poprun adds."""
    lines: list[str] = []
    for key, label in (("true", "`/bin/true`"), ("mpi_import", "`from mpi4py import MPI`")):
        lines += [(f"| {label}, instances | bare mpiexec (ms) | poprun (ms) | ratio | bare mpiexec CPU (ms) | "
                   "poprun CPU (ms) | CPU ratio |"), "|---|---|---|---|---|---|---|"]
        for count, row in scale[key].items():
            seconds, cpu = row["seconds"], row["cpu_seconds"]
            lines.append(f"| {count} | {ms(seconds['mpiexec']['median'])} | {ms(seconds['poprun']['median'])} | "
                         f"{row['ratio']:.2f} | {ms(cpu['mpiexec']['median'])} | {ms(cpu['poprun']['median'])} | "
                         f"{row['cpu_ratio']:.2f} |")
        lines.append("")
    lines += [("| instances waiting | bare mpiexec USS (MiB) | poprun USS (MiB) | bare mpiexec PSS (MiB) | "
               "poprun PSS (MiB) |"), "|---|---|---|---|---|"]
    for count, row in scale["memory"].items():
        lines.append(f"| {count} | {row['mpiexec']['uss_mib']:.1f} | {row['poprun']['uss_mib']:.1f} | "
                     f"{row['mpiexec']['pss_mib']:.1f} | {row['poprun']['pss_mib']:.1f} |")
    added = scale["added_memory"]
    hosts = scale.get("hosts", {})
    if "ratio" in hosts:
        wall, here = hosts["seconds"], hosts["cpu_seconds_here"]
        lines += ["", (f"| {len(hosts['hosts'])} test hosts x {hosts['per_host']} instances of `/bin/true` | bare "
                       "mpiexec (ms) | poprun (ms) | ratio | bare mpiexec CPU here (ms) | poprun CPU here (ms) |"),
                  "|---|---|---|---|---|---|",
                  (f"| {', '.join(hosts['hosts'])} | {ms(wall['mpiexec']['median'])} | {ms(wall['poprun']['median'])} "
                   f"| {hosts['ratio']:.2f} | {ms(here['mpiexec']['median'])} | {ms(here['poprun']['median'])} |")]
    elif "skipped" in hosts:
        lines += ["", f"Across hosts: not measured ({hosts['skipped']})."]
    lines += ["", (f"poprun started under a soft limit of {scale['soft_file_limit']} open files, bare mpiexec with "
                   "its raised to the hard limit (Hydra fails from about 300 instances under 1,024); times and CPU "
                   "(the whole process tree's, user + system) are medians of interleaved runs, memory the sum over "
                   "the tree while "
                   f"every instance waits. Beyond bare mpiexec, poprun adds per instance "
                   f"{scale['cpu_seconds_per_instance'] * 1e3:.1f} ms of CPU, {added['per_instance_uss_mib']:.2f} MiB "
                   f"unique ({added['per_instance_pss_mib']:.2f} MiB proportional) memory; per host (its "
                   f"one-instance job) {added['per_host_uss_mib']:.1f} MiB unique, {added['per_host_pss_mib']:.1f} "
                   "MiB proportional."),
              ""]
    return lines


def _targets(results: dict[str, Any]) -> list[str]:
    """Every section's targets in one table, each with the core count of the host it was measured on."""
    targets = [(s.get("machine", {}).get("cores", "?"), t) for s in results.values() if isinstance(s, dict)
               for t in (s.get("targets") or ([s["target"]] if "target" in s else []))]
    if not targets:
        return []
    lines = ["| target | host cores | limit | measured | holds |", "|---|---|---|---|---|"]
    for cores, t in targets:
        holds = "yes" if t["holds"] else "**no**"
        lines.append(f"| {t['what']} | {cores} | {t['limit']} | {t['value']:.2f} | {holds} |")
    return lines


def _training(t: dict[str, Any]) -> list[str]:
    one, two = t["splits"]["1x4"], t["splits"]["2x2"]
    lines = [(f"| training: {t['model']} | 1x4 state (MiB) | vs replicated | 1x4 step (ms) | vs replicated | "
              "1x4 peak RSS (MiB) | 2x2 state per process (MiB) | vs replicated | 2x2 step (ms) | vs replicated |"),
             "|---|---|---|---|---|---|---|---|---|---|"]

    def state(split: dict[str, Any], s: str) -> str:
        files = split["state"]["file_mib"][s]
        return f"{split['state']['mib'][s]:.1f}" + (f" (+{files:.0f} in files)" if files else "")

    for s in one["state"]["mib"]:
        lines.append(f"| {s.replace('_', ' ')} | {state(one, s)} | {one['state']['ratio'][s]:.2f} | "
                     f"{ms(one['steps']['seconds'][s])} | {one['steps']['ratio'][s]:.2f} | "
                     f"{one['peak_rss_mib'][s]:.0f} | {state(two, s)} | {two['state']['ratio'][s]:.2f} | "
                     f"{ms(two['steps']['seconds'][s])} | {two['steps']['ratio'][s]:.2f} |")
    baseline = max(one["baseline_rss_mib"].values())
    lines += ["", (f"Peak RSS: one process per setting, 4 replicas; {baseline:.0f} MiB of it were resident before "
                   "the trainer (interpreter, the 4 replicas' gradients, the initial weights). Off-chip pages "
                   f"still mapped after a step: {one['file_resident_mib']['off_chip']:.1f} MiB. Step ratios: "
                   f"median over {one['steps']['rounds']} rounds of the setting's step / the replicated step "
                   "of the same round."), ""]
    lines += ["| fused reduction per replica, 200 x 16 KiB | 1x4 (ms) | 2x2 (ms) |", "|---|---|---|"]
    for key, label in (("one_all_reduce", "one all-reduce of the same 3200 KiB"), ("fused", "fused (one bucket)"),
                       ("pack_only", "packing alone (200 copies into the bucket)"),
                       ("per_tensor", "200 all-reduces, one per tensor")):
        lines.append(f"| {label} | {ms(one['fused_seconds'][key])} | {ms(two['fused_seconds'][key])} |")
    lines += [f"| fused / one all-reduce | {one['fused_ratio']:.2f} | {two['fused_ratio']:.2f} |", ""]
    return lines


def _pipeline(p: dict[str, Any]) -> list[str]:
    labels = {"sequential": "same stages on 1 device (Pipeline.sequential)", "1f1b": "1F1B on 2 devices",
              "gpipe": "GPipe on 2 devices"}
    lines = [(f"| pipeline: {p['model']} | samples/s | vs 1 device | step (ms) | bubble | ideal bubble | "
              "stash per stage (micro-batches) | stash per stage (MiB) | peak RSS (MiB) |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for m, label in labels.items():
        pipelined = m in p["bubble"]
        bubbles = f"{p['bubble'][m]:.3f} | {p['ideal_bubble']:.3f}" if pipelined else "- | -"
        lines.append(f"| {label} | {p['samples_per_s'][m]:.0f} | {p['speedup'][m] if pipelined else 1.0:.2f} | "
                     f"{ms(p['seconds'][m])} | {bubbles} | "
                     f"{', '.join(map(str, p['stashed'][m]))} | {', '.join(f'{b:.2f}' for b in p['stash_mib'][m])} | "
                     f"{p['peak_rss_mib'][m]:.0f} |")
    busy = ", ".join(f"{m}: {p['busy_ms'][m][0]:.0f} and {p['busy_ms'][m][1]:.0f} ms" for m in p["busy_ms"])
    lines += ["", (f"GPipe step / 1F1B step: {p['gpipe_over_1f1b']:.2f}. Ratios: medians over {p['rounds']} rounds "
                   "of the ratio within a round. Two-core capacity (the model's matmul on both device threads at "
                   f"once, per thread, against one): {p['two_core_capacity']:.2f}x; devices pinned to cores: "
                   f"{'yes' if p['pinned'] else 'no'}. Compute per stage in a step ({busy}). Weights after the "
                   f"same steps bitwise equal in all three: {'yes' if p['bitwise_equal'] else '**no**'}. Peak RSS: "
                   f"a process per mode; {min(p['rss_before_mib'].values()):.0f} MiB resident before the step."),
              ""]
    sync = p.get("sync")
    if sync:
        lines += [(f"| pipeline with a host feed ({sync['feed_ms']:.1f} ms a micro-batch), 1F1B | step (ms) | "
                   "vs full |"), "|---|---|---|"]
        lines += [f"| {m} | {ms(t)} | {sync['over_full'].get(m, 1.0):.2f} |" for m, t in sync["seconds"].items()]
        lines.append("")
    return lines


def _matmul(section: dict[str, Any]) -> list[str]:
    lines = [("| batch-invariant products, float32, 1 thread (rows x in x out) | `x @ w` (ms) | `matmul` | ratio | "
              "`dz @ w.T` (ms) | `matmul` | ratio | `x.T @ dz` (ms) | `outer_sum` | ratio |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in section["rows"]:
        cells = [f"{ms(row['seconds'][p]['blas'])} | {ms(row['seconds'][p]['invariant'])} | {row['ratio'][p]:.2f}"
                 for p in ("forward", "input_grad", "weight_grad")]
        lines.append(f"| {'x'.join(map(str, row['shape']))} | {' | '.join(cells)} |")
    equal = all(row["rows_alone_equal_the_call"] for row in section["rows"])
    lines += ["", (f"Ratios: medians over {section['rounds']} rounds of the ratio within a round (BLAS: numpy's "
                   "OpenBLAS, one thread). Rows computed alone equal the rows of the whole call: "
                   f"{'yes' if equal else '**no**'}."), ""]
    return lines


def _multihost(m: dict[str, Any]) -> list[str]:
    if "skipped" in m:
        return [f"Multi-host: not measured ({m['skipped']}).", ""]
    launch, reduce = m["launch"], m["allreduce"]
    return [(f"| 2 hosts ({', '.join(m['hosts'])}; network namespaces, UCX_TLS={m['transport']}) | "
             "bare mpiexec / raw MPI (ms) | poprun / engine (ms) | ratio |"), "|---|---|---|---|",
            (f"| launch 2 instances, `from mpi4py import MPI` | "
             f"{ms(launch['seconds']['mpiexec']['median'])} | "
             f"{ms(launch['seconds']['poprun']['median'])} | {launch['ratio']:.2f} |"),
            (f"| all-reduce {_size(reduce['bytes_per_replica'])} per replica (engine 2x2, raw 2 ranks) | "
             f"{ms(reduce['mpi4py_raw_2']['seconds'])} | {ms(reduce['engine_2x2']['seconds'])} | "
             f"{reduce['ratio_engine_to_raw_2']:.2f} |"), ""]


def _latency(lat: dict[str, Any]) -> list[str]:
    us = {split: {kind: f"{t * 1e6:.1f}" for kind, t in kinds.items()} for split, kinds in lat["seconds"].items()}
    lines = [(f"| all-reduce {_size(lat['bytes_per_replica'])} per replica (us) | raw mpi4py, 2 ranks | engine, "
              "threads executor | engine, cooperative executor | `auto` picks here |"), "|---|---|---|---|---|"]
    for split, t in us.items():
        lines.append(f"| {split} | {t.get('raw', '-')} | {t['threads']} | {t['cooperative']} | {lat['auto'][split]} |")
    if "handoff_seconds" in lat:
        lines += ["", (f"One hand-off between two Python threads waking each other through locks, on this host: "
                       f"{lat['handoff_seconds'] * 1e6:.1f} us.")]
    return [*lines, ""]


def _cores(c: dict[str, Any]) -> list[str]:
    reduced, split, trained, R = c["reduction"], c["splits"], c["training"], c["replicas"]
    threads = reduced["threads"]
    lines = [(f"| in one process, {_size(reduced['bytes_per_replica'])} per replica ({c['cores']} cores) | "
              f"1 thread (ms) | {threads} threads (ms) | speedup |"), "|---|---|---|---|"]
    for L, by_op in reduced["local_replicas"].items():
        for op, t in by_op.items():
            lines.append(f"| {op.replace('_', '-')}, {L} local replicas | {ms(t['one_thread'])} | "
                         f"{ms(t['threads'])} | {t['speedup']:.2f} |")
    memory = reduced["memory_limit"]
    lines += [(f"| the host's limit: `np.add` of two arrays into a fresh third | {ms(memory['one_thread'])} | "
               f"{ms(memory['threads'])} | {memory['speedup']:.2f} |"), ""]
    if "cutting" in c:  # where cutting starts to pay (POPDIST_ENGINE_SLICE_BYTES)
        by_local = c["cutting"]["local_replicas"]
        sizes = list(next(iter(by_local.values())))
        lines += [(f"| all-reduce cut over {c['cutting']['threads']} threads at every size: one thread / cut | "
                   + " | ".join(f"{_size(int(size))} per replica" for size in sizes) + " |"),
                  "|---|" + "---|" * len(sizes)]
        lines += [f"| {L} local replicas | " + " | ".join(f"{t[size]['speedup']:.2f}" for size in sizes) + " |"
                  for L, t in by_local.items()]
        lines.append("")
    if "steps" in c:
        by_executor = c["steps"]["seconds"]
        sizes = list(by_executor["threads"])
        lines += [("| engine time per Trainer step, negligible model (us) | "
                   + " | ".join(f"L = {L}" for L in sizes) + " | per replica at the largest L |"),
                  "|---|" + "---|" * (len(sizes) + 1)]
        for executor, t in by_executor.items():
            lines.append(f"| {executor} | " + " | ".join(f"{t[L] * 1e6:.0f}" for L in sizes)
                         + f" | {t[sizes[-1]] * 1e6 / int(sizes[-1]):.0f} |")
        lines.append("")
    lines += [f"| all-reduce {_size(split['bytes_per_replica'])} per replica, {R} replicas | ms | vs fastest |",
              "|---|---|---|"]
    fastest = min(s for name, s in split["seconds"].items() if not name.startswith("mpi4py"))
    lines += [f"| {name.replace('_', ' ') if name.startswith('mpi4py') else 'engine ' + name} | {ms(s)} | "
              f"{s / fastest:.2f} |" for name, s in split["seconds"].items()]
    lines += ["", f"| training: {trained['model']} | samples/s |", "|---|---|"]
    lines += [f"| {name.replace('_', ' ')} | {v:.0f} |" for name, v in trained["samples_per_s"].items()]
    lines.append("")
    return lines


def _peers(p: dict[str, Any]) -> list[str]:
    """The peers section's tables, each of the pieces it has (the tests measure them one at a time)."""
    lines = []
    if "sampler" in p:
        lines += [("| shuffled DistributedSampler, 2 replicas, replica 0's epoch as a list | popdist_py (ms) | "
                   "torch 2.13.0 (ms) | ratio | lists identical |"), "|---|---|---|---|---|"]
        for row in p["sampler"]:
            lines.append(f"| n = {row['n']:,} | {ms(row['seconds']['popdist_py'])} | {ms(row['seconds']['torch'])} "
                         f"| {row['ratio']:.2f} | {'yes' if row['identical'] else '**no**'} |")
        lines.append("")
    for op, rows in p.get("collectives", {}).items():
        engines = [name for name in ("engine_2x2", "engine_4x1") if name in rows[0]]
        lines += [(f"| {op.replace('_', '-')} per replica, 4 replicas | gloo 4 ranks (ms) | "
                   + "".join(f"{name.replace('_', ' ')} (ms) | " for name in engines) + "mpi4py 4 ranks (ms) | "
                   + "".join(f"{name.replace('_', ' ')} / gloo | " for name in engines) + "mpi4py / gloo |"),
                  "|---|---|" + "---|" * (2 * len(engines) + 2)]
        for row in rows:
            cells = [ms(row["gloo_4"]), *(ms(row[name]) for name in engines), ms(row["mpi4py_4"]),
                     *(f"{row[f'{name}_over_gloo']:.2f}" for name in engines), f"{row['mpi4py_4_over_gloo']:.2f}"]
            lines.append(f"| {_size(row['bytes_per_replica'])} | " + " | ".join(cells) + " |")
        lines.append("")
    if "training" in p:
        t = p["training"]
        lines += [f"| training: {t['model']} | engine Trainer (samples/s) | torch DDP (samples/s) | engine / DDP |",
                  "|---|---|---|---|"]
        for n in ("1", "2"):
            lines.append(f"| {n} process(es) | {t['samples_per_s']['engine'][n]:.0f} | "
                         f"{t['samples_per_s']['ddp'][n]:.0f} | {t['engine_over_ddp'][n]:.2f} |")
        lines += [f"| scaling 1 -> 2 | {t['scaling']['engine']:.2f} | {t['scaling']['ddp']:.2f} | |", ""]
    if "launch" in p:
        seconds = p["launch"]["seconds"]
        lines += ["| launch 2 instances of `python -c pass` | bare mpiexec | poprun | torchrun 2.13.0 |",
                  "|---|---|---|---|",
                  "| ms, median | " + " | ".join(ms(seconds[who]["median"])
                                                 for who in ("mpiexec", "poprun", "torchrun")) + " |", ""]
    return lines


def _horovod(h: dict[str, Any]) -> list[str]:
    """The horovod section's tables, each of the pieces it has (the tests measure them one at a time)."""
    lines = []
    if "training" in h:
        t = h["training"]
        lines += [(f"| training, 2 processes: {t['model']} | hvd.DistributedOptimizer (ms) | torch DDP, gloo (ms) | "
                   "ratio |"), "|---|---|---|---|",
                  (f"| step, medians over {t['rounds']} rounds after {t['warmup']} warm-up steps | "
                   f"{ms(t['seconds']['horovod'])} | {ms(t['seconds']['ddp'])} | {t['ratio']:.2f} |"),
                  "", (f"The ratio is the median over rounds of the ratio within a round. After the same "
                       f"{t['steps']} steps the two models' parameters differ by at most {t['max_abs_difference']:.3g} "
                       f"(checked within rtol {t['rtol']:g}, atol {t['atol']:g}); training moved them by up to "
                       f"{t['max_abs_change']:.3g}."), ""]
    if "allreduce" in h:
        lines += [("| all-reduce, float32, Sum, 2 ranks | hvd.allreduce (ms) | mpi4py Allreduce (ms) | ratio | "
                   "hvd.allreduce_ in place (ms) | in place / mpi4py |"), "|---|---|---|---|---|---|"]
        lines += [f"| {_size(row['bytes'])} | {ms(row['horovod'])} | {ms(row['mpi4py'])} | {row['ratio']:.2f} | "
                  f"{ms(row['horovod_in_place'])} | {row['in_place_ratio']:.2f} |" for row in h["allreduce"]]
        lines.append("")
    return lines


def _relative_rows(values: dict[str, float], fmt: str, suffix: str = "") -> list[str]:
    """A table row per entry: its value, and its ratio to the first entry (the baseline)."""
    base = next(iter(values.values()))
    return [f"| {name.replace('_', ' ')}{suffix} | {value:{fmt}} | {value / base:.2f} |"
            for name, value in values.items()]


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in ("allreduce", "launch", "scale", "scaling", "rts_memory", "peers") if k in results]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, key in zip(axes[0], panels, strict=True):
        section = results[key]
        if key == "allreduce":
            rows = section["allreduce"]
            sizes = [r["bytes_per_replica"] for r in rows]
            for name, label in (("engine_2x2", "engine 2x2"), ("mpi4py_flat_4", "mpi4py 4 ranks"),
                                ("mpi4py_raw_2", "mpi4py 2 ranks")):
                ax.loglog(sizes, [r[name]["seconds"] * 1e3 for r in rows], marker="o", label=label)
            ax.set_xlabel("bytes per replica")
            ax.set_ylabel("ms per all-reduce")
            ax.legend()
        elif key == "launch":
            names = ["mpi_init", "pass"]
            shown = [(who, label) for who, label in (("mpiexec", "bare mpiexec"), ("floor_click", "floor with click"),
                                                     ("poprun", "poprun")) if who in section[names[0]]["seconds"]]
            width = 0.8 / len(shown)
            for i, (who, label) in enumerate(shown):
                ax.bar([j + width * i for j in range(2)], [section[n]["seconds"][who]["median"] * 1e3 for n in names],
                       width, label=label)
            ax.set_xticks([0.4 - width / 2, 1.4 - width / 2], ["MPI init", "pass"])
            ax.set_ylabel("ms to run 2 instances")
            ax.legend()
        elif key == "peers":
            rows = section["collectives"]["allreduce"]
            sizes = [r["bytes_per_replica"] for r in rows]
            for name, label in (("gloo_4", "torch gloo, 4 ranks"), ("engine_2x2", "engine 2x2"),
                                ("engine_4x1", "engine 4x1"), ("mpi4py_4", "mpi4py, 4 ranks")):
                ax.loglog(sizes, [r[name] * 1e3 for r in rows], marker="o", label=label)
            ax.set_xlabel("bytes per replica (4 replicas)")
            ax.set_ylabel("ms per all-reduce")
            ax.legend()
        elif key == "scale":
            for rows, program in ((section["true"], "/bin/true"), (section["mpi_import"], "MPI import")):
                counts = [int(c) for c in rows]
                for who, label in (("mpiexec", "bare mpiexec"), ("poprun", "poprun")):
                    ax.loglog(counts, [rows[c]["seconds"][who]["median"] for c in rows], marker="o",
                              label=f"{label}, {program}")
            ax.set_xlabel("instances on one host")
            ax.set_ylabel("seconds per job")
            ax.legend()
        elif key == "scaling":
            values = section["samples_per_s"]
            ax.bar(range(len(values)), list(values.values()))
            ax.set_xticks(range(len(values)), [k.replace("_", "\n") for k in values])
            ax.set_ylabel("samples/s")
        else:
            values = section["mib"]
            ax.bar(range(len(values)), list(values.values()))
            ax.set_xticks(range(len(values)), [k.replace("_", "\n") for k in values])
            ax.set_ylabel("MiB per process")
        ax.set_title({"peers": "all-reduce against torch 2.13.0"}.get(key, key))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


#: A generated section of a doc: between these lines, the section's tables from results.json.
DOC_BEGIN, DOC_END = "<!-- bench: {} begin -->", "<!-- bench: {} end -->"


def write_doc(path: Path, results: dict[str, Any], other: Mapping[str, tuple[str, str]] | None = None) -> list[str]:
    """Regenerate every section of ``path`` marked DOC_BEGIN/DOC_END whose results are there,
    headed by the run that measured it, and each of ``other``'s (a section's name: its heading and
    markdown, from a file of its own such as bench/horovod_suite.json); the sections regenerated."""
    text = path.read_text()
    done = []
    for name, section in results.items():
        if DOC_BEGIN.format(name) not in text or not isinstance(section, dict):
            continue
        machine = section.get("machine", {})
        commit = f" at {machine['commit']}" if machine.get("commit") else ""
        heading = (f"Generated by `python -m bench.run --doc {path}` from the `{name}` section measured "
                   f"{machine.get('date', '?')}{commit}{' (quick)' if section.get('quick') else ''} on "
                   f"{machine.get('cores', '?')} cores ({machine.get('cpu', '?')}).")
        text = _fill(text, name, heading, markdown({name: section}))
        done.append(name)
    for name, (heading, body) in (other or {}).items():
        if DOC_BEGIN.format(name) in text:
            text = _fill(text, name, heading, body)
            done.append(name)
    path.write_text(text)
    return done


def _fill(text: str, name: str, heading: str, body: str) -> str:
    """``text`` with its section ``name`` (between DOC_BEGIN and DOC_END) holding ``heading`` and ``body``."""
    begin, end = DOC_BEGIN.format(name), DOC_END.format(name)
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    return "\n".join([head + begin, "", heading, "", *body.strip().split("\n"), "", end]) + tail
