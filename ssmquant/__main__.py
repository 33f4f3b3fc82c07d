"""`python -m ssmquant ...`: the same command line as the `ssmquant` script."""

from .cli import entry

entry()
