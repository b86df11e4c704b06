"""The click command: help, version, short options, config files, and every usage error.

Built from ``options.OPTIONS``. Plain launches are read by ``fast_args`` instead; whatever it
declines comes here, so click has the last word on what a command line means.
"""

from __future__ import annotations

from typing import Any

import click

from poprun_py import __version__
from poprun_py.options import COUNT, FLAG, INDEX, OPTIONS, POSITIVE, TEXTS, YES_NO, Option, yes_no


class YesNo(click.ParamType):
    name = "yes|no"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> bool:
        try:
            return yes_no(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


CLICK_TYPES: dict[str, click.ParamType] = {
    POSITIVE: click.IntRange(min=1), INDEX: click.IntRange(min=0), YES_NO: YesNo(),
}


def _click_option(option: Option) -> Any:
    settings: dict[str, Any] = {"help": option.help}
    if option.kind == FLAG:
        settings.update(is_flag=True, default=False)
    elif option.kind == COUNT:
        settings.update(count=True)
    else:
        settings.update(default=option.default, multiple=option.kind == TEXTS, show_default=option.show_default)
        if option.kind in CLICK_TYPES:
            settings["type"] = CLICK_TYPES[option.kind]
        if option.metavar:
            settings["metavar"] = option.metavar
    return click.option(*option.flags, option.dest, **settings)


def _with_options(func: Any) -> Any:
    for option in reversed(OPTIONS):
        func = _click_option(option)(func)
    return func


@click.command(
    context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"],
                      "max_content_width": 100},
    epilog="Every instance gets POPDIST_* (see popdist_py), RANK, WORLD_SIZE, LOCAL_RANK and "
           "LOCAL_WORLD_SIZE. Output lines are tagged '[i] ' with their instance index. "
           "Exit status: 0 when every instance succeeds, else the first failing instance's status "
           "(128+N for signal N).",
)
@_with_options
@click.version_option(__version__, "--version", prog_name="poprun (poprun-py)")
@click.argument("program", required=False, metavar="PROGRAM")
@click.argument("args", nargs=-1, type=click.UNPROCESSED, metavar="[ARGS]...")
@click.pass_context
def poprun(ctx: click.Context, **options: Any) -> dict[str, Any]:
    """Launch PROGRAM as --num-instances processes on MPI, each driving its share of --num-replicas."""
    if options["import_config"]:
        from poprun_py.config import import_config

        import_config(ctx, options["import_config"])
        options.update(ctx.params)
    if options["export_config"]:
        from poprun_py.config import export_config

        export_config(ctx, options["export_config"], options["overwrite_config"])
    return options


def parse(argv: list[str]) -> dict[str, Any] | int:
    """The options for ``argv``, or an exit status when there is nothing to launch (help,
    version, or a usage error, already printed as one line)."""
    try:
        result = poprun.main(args=argv, prog_name="poprun", standalone_mode=False)
    except click.UsageError as exc:
        click.echo(f"poprun: error: {exc.format_message()}", err=True)
        return 2
    except click.ClickException as exc:
        click.echo(f"poprun: error: {exc.format_message()}", err=True)
        return exc.exit_code
    except click.exceptions.Abort:
        return 130
    return result if isinstance(result, dict) else int(result or 0)
