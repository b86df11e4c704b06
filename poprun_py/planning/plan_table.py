"""``--print-topology yes``: PopRun's boxed table of hosts -> instances -> global replicas."""

from __future__ import annotations

from poprun_py.planning.plan import JobPlan, elide, span

#: Past this many replica columns the box would not fit a screen: a summary is printed instead.
MAX_COLUMNS = 32


def render_plan_table(plan: JobPlan) -> str:
    """PopRun's ``poprun topology`` box, or for a large job a line per host (the ends of the list)."""
    if plan.num_replicas > MAX_COLUMNS:
        return _summary(plan)
    return _box(plan)


def _summary(plan: JobPlan) -> str:
    k, per_host = plan.instances_per_host, plan.instances_per_host * plan.num_local_replicas
    rows = [(f"  {host}: instances {span(range(h * k, (h + 1) * k))}, "
             f"replicas {span(range(h * per_host, (h + 1) * per_host))}") for h, host in enumerate(plan.host_names)]
    title = (f"poprun topology: {len(plan.host_names)} host(s) x {k} instance(s) x "
             f"{plan.num_local_replicas} replica(s) = {plan.num_replicas} replicas")
    return "\n".join([title, *elide(rows)])


def _box(plan: JobPlan) -> str:
    """Each cell spans the replica columns it owns, the columns wide enough for every cell's text
    (a host's name spans its replicas' columns) and the title."""
    per_host = plan.instances_per_host * plan.num_local_replicas
    hosts = [(name, per_host) for name in plan.host_names]
    instances = [(str(i.index), plan.num_local_replicas) for i in plan.instances]
    replicas = [(str(r), 1) for r in range(plan.num_replicas)]
    title_text = "poprun topology"
    cells = hosts + instances + replicas
    width = max(4, *(-(-(len(text) + 2 - (columns - 1)) // columns) for text, columns in cells))
    width = max(width, -(-(len(title_text) + 2 - 12 - (plan.num_replicas - 1)) // plan.num_replicas))

    def row(label: str, cells: list[tuple[str, int]]) -> str:
        parts = []
        for text, columns in cells:
            cell_width = columns * width + (columns - 1)
            parts.append(text.center(cell_width)[:cell_width])
        return f"| {label:<9} |" + "|".join(parts) + "|"

    body = [row("hosts", hosts), row("instances", instances), row("replicas", replicas)]
    rule = "+" + "-" * (len(body[0]) - 2) + "+"
    title = "| " + title_text.center(len(body[0]) - 4) + " |"
    return "\n".join([rule, title, rule, *body, rule])
