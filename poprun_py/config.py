"""``--export-config`` / ``--import-config``: the effective options as a JSON object.

Keys are the long option names (``"num-instances": 2``); command-line values win over the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

#: Options that describe the config handling itself, never stored in a config file.
META_OPTIONS = {"import_config", "export_config", "overwrite_config", "dry_run"}


def config_params(command: click.Command) -> dict[str, click.Option]:
    """The storable options by their JSON key (the long name without dashes prefix)."""
    params = {}
    for param in command.params:
        if isinstance(param, click.Option) and param.name not in META_OPTIONS and not param.hidden \
                and not param.is_eager and param.name is not None:
            params[param.name.replace("_", "-")] = param
    return params


def _check_type(key: str, param: click.Option, value: Any, path: str) -> None:
    def fail(expected: str) -> None:
        raise click.UsageError(f"config file {path!r}: {key!r} must be {expected}, got {json.dumps(value)}")

    if param.multiple:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            fail("a list of strings")
    elif param.count:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            fail("a non-negative integer")
    elif param.is_flag:
        if not isinstance(value, bool):
            fail("true or false")
    elif isinstance(param.type, click.types.IntParamType):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            fail("an integer")
    elif getattr(param.type, "name", "") == "yes|no":
        if not isinstance(value, (bool, str)):
            fail('"yes" or "no"')
    elif value is not None and not isinstance(value, str):
        fail("a string")


def import_config(ctx: click.Context, path: str) -> None:
    """Fill every option the command line did not set from the file at ``path``."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise click.UsageError(f"--import-config {path!r} cannot be read: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise click.UsageError(f"--import-config {path!r} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise click.UsageError(f"--import-config {path!r} must hold a JSON object of option names to values")
    params = config_params(ctx.command)
    unknown = sorted(set(data) - set(params))
    if unknown:
        raise click.UsageError(
            f"config file {path!r} has unknown option(s) {', '.join(map(repr, unknown))}; "
            f"known options are: {', '.join(sorted(params))}"
        )
    for key, value in data.items():
        param = params[key]
        _check_type(key, param, value, path)
        assert param.name is not None
        if ctx.get_parameter_source(param.name) not in (ParameterSource.DEFAULT, None):
            continue  # the command line wins
        if isinstance(value, bool) and getattr(param.type, "name", "") == "yes|no":
            value = "yes" if value else "no"
        try:
            ctx.params[param.name] = param.type_cast_value(ctx, value)
        except click.BadParameter as exc:
            raise click.UsageError(f"config file {path!r}: {key!r}: {exc.message}") from None


def export_config(ctx: click.Context, path: str, overwrite: bool) -> None:
    if os.path.exists(path) and not overwrite:
        raise click.UsageError(f"--export-config {path!r} already exists; add --overwrite-config to replace it")
    data = {}
    for key, param in config_params(ctx.command).items():
        value = ctx.params.get(param.name)  # type: ignore[arg-type]
        data[key] = list(value) if isinstance(value, tuple) else value
    try:
        Path(path).write_text(json.dumps(data, indent=2) + "\n")
    except OSError as exc:
        raise click.UsageError(f"--export-config {path!r} cannot be written: {exc.strerror or exc}") from None
