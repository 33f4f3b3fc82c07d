"""`python -m ssmquant ...`: the same command line as the `ssmquant` script."""

from .cli import main

main(prog_name="ssmquant")
