"""The launch fast path: read a plain command line without importing click.

Importing click costs ~30 ms on this class of machine (it pulls in ``inspect``, ``typing``,
``enum``, ``uuid``, ``datetime``...), as much as a third of an MPI job's whole start-up, and
``poprun`` pays it before mpiexec can start. Most launches are plain: long options from
``options.OPTIONS`` with valid values, then the program. Those are read here, into exactly the
dictionary click would produce (a property test checks the two agree). Anything else (help,
version, short options, config files, compatibility options, an invalid value, an unknown
option) returns None, and click handles it, with its help and its error messages.
"""

from __future__ import annotations

from poprun_py.options import BY_FLAG, COUNT, FLAG, OPTIONS, TEXTS, convert


def parse(argv: list[str]) -> dict[str, object] | None:
    """Click's parameters for ``argv`` (options, ``program``, ``args``), or None to ask click."""
    values: dict[str, object] = {option.dest: option.default for option in OPTIONS}
    position = 0
    while position < len(argv):
        token = argv[position]
        if token == "--":
            position += 1
            break
        if not token.startswith("--"):
            if token.startswith("-") and token != "-":
                return None  # short options (-H, -v, -h) and their clusters: click's job
            break  # the program: options after it are its own
        name, has_value, inline = token.partition("=")
        option = BY_FLAG.get(name)
        if option is None or not option.fast:
            return None
        position += 1
        if option.kind in (FLAG, COUNT):
            if has_value:
                return None
            values[option.dest] = True if option.kind == FLAG else values[option.dest] + 1  # type: ignore[operator]
            continue
        if has_value:
            text = inline
        elif position < len(argv):
            text = argv[position]
            position += 1
        else:
            return None  # a value is missing
        try:
            value = convert(option, text)
        except ValueError:
            return None
        values[option.dest] = (*values[option.dest], value) if option.kind == TEXTS else value  # type: ignore[misc]
    rest = argv[position:]
    values["program"] = rest[0] if rest else None
    values["args"] = tuple(rest[1:])
    return values
