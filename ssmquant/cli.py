"""The `ssmquant` command line: click commands that parse, call the library and print."""

from __future__ import annotations

import click

from . import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ssmquant")
def main():
    """Can the SSM state of a hybrid LLM be stored in FP8, INT8 or NVFP4? Measure it, calibrate it, export it."""


@main.command("formats")
@click.option(
    "--shape",
    default="64,64,128",
    show_default=True,
    help="State shape heads,rows,state_dim to size the table for (default: a Nemotron-3-Nano layer).",
)
def formats_cmd(shape: str):
    """List the state storage formats with their footprint."""
    from .report.tables import formats_table, parse_shape

    click.echo(formats_table(parse_shape(shape)))


if __name__ == "__main__":  # pragma: no cover
    main()
