"""``--import-config`` / ``--export-config``: the options as a JSON object, keyed by long option name
(``{"num-instances": 2}``).

An imported file becomes click's ``default_map``: click takes every option the command line does
not give from it and converts it with the option's own type, so the command line wins and a bad
value fails as it would on the command line (``blame`` then names the file instead of the flag).
``null`` means the option's default, as ``--export-config`` writes options that were not set.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from poprun_py.planning.user_files import read_text

#: Options about config handling or about this one run, never stored in a config file.
META_OPTIONS = {"import_config", "export_config", "overwrite_config", "dry_run"}
#: A config file holds a dozen options: anything larger is a mistake (and is not read past this).
MAX_CONFIG_BYTES = 1 << 20
#: ``ctx.meta`` key of the imported file's path.
IMPORTED = "poprun.import_config"


def storable(command: click.Command) -> dict[str, click.Option]:
    """The options a config file may hold, by JSON key (the long name without its dashes prefix)."""
    return {param.name.replace("_", "-"): param for param in command.params
            if isinstance(param, click.Option) and param.name and param.name not in META_OPTIONS
            and not param.is_eager}


def read(path: str, params: dict[str, click.Option]) -> dict[str, Any]:
    """The file at ``path`` as a ``default_map`` (parameter names to values); BadParameter if it
    is not a JSON object of known options, each with a list exactly when the option is repeatable."""
    try:
        text = read_text(path, MAX_CONFIG_BYTES, "1 MiB; a config file holds a few options")
    except ValueError as exc:
        raise click.BadParameter(f"{path!r} {exc}") from None
    if not text.strip():
        raise click.BadParameter(f"{path!r} is empty; it must hold a JSON object of option names to values")
    try:
        data = json.loads(text, object_pairs_hook=_without_repeats)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"{path!r} is not valid JSON: {exc}") from None
    except _Repeated as exc:
        raise click.BadParameter(f"{path!r} gives {exc.key!r} more than once; give each option once") from None
    except RecursionError:
        raise click.BadParameter(f"{path!r} nests lists or objects too deeply; options need an object "
                                 "whose values are single values or lists of them") from None
    if not isinstance(data, dict):
        raise click.BadParameter(f"{path!r} must hold a JSON object of option names to values")
    unknown = sorted(set(data) - set(params))
    if unknown:
        raise click.BadParameter(f"{path!r} has unknown option(s) {', '.join(map(repr, unknown))}; "
                                 f"known options are: {', '.join(sorted(params))}")
    defaults = {}
    for key, value in data.items():
        if value is None:
            continue  # the option's own default
        param = params[key]
        if (isinstance(value, list) != param.multiple or isinstance(value, dict)
                or (isinstance(value, list) and any(isinstance(item, (list, dict)) for item in value))):
            shape = ("a list of single values (the option is repeatable)" if param.multiple
                     else "a single value, not a list or object")
            got = json.dumps(value)
            got = got if len(got) <= 60 else got[:60] + "..."
            raise click.BadParameter(f"{path!r}: {key!r} must be {shape}, got {got}")
        assert param.name is not None
        defaults[param.name] = value
    return defaults


class _Repeated(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _without_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict; a key given twice raises (json would keep the last silently)."""
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise _Repeated(key)
        data[key] = value
    return data




def load(ctx: click.Context, path: str) -> None:
    """Make the file at ``path`` the defaults of ``ctx``'s options."""
    ctx.default_map = {**(ctx.default_map or {}), **read(path, storable(ctx.command))}
    ctx.meta[IMPORTED] = path


def blame(exc: click.BadParameter) -> str | None:
    """One line for a bad value that came from the imported file (None if it did not)."""
    ctx, param = exc.ctx, exc.param
    if ctx is None or param is None or param.name is None or IMPORTED not in ctx.meta:
        return None
    if ctx.get_parameter_source(param.name) is not ParameterSource.DEFAULT_MAP:
        return None
    return f"config file {ctx.meta[IMPORTED]!r}: {param.name.replace('_', '-')!r}: {exc.message}"


def export(ctx: click.Context, path: str, overwrite: bool) -> None:
    """Write every storable option's effective value to ``path``."""
    if os.path.exists(path) and not overwrite:
        raise click.UsageError(f"--export-config {path!r} already exists; add --overwrite-config to replace it")
    data = {}
    for key, param in storable(ctx.command).items():
        value = ctx.params.get(param.name)
        data[key] = list(value) if isinstance(value, tuple) else value
    try:
        Path(path).write_text(json.dumps(data, indent=2) + "\n")
    except OSError as exc:
        raise click.UsageError(f"--export-config {path!r} cannot be written: {exc.strerror or exc}") from None
