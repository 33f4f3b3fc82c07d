"""Helpers shared by the studies: statistics (bootstrap, permutation tests), tables, plots, measurement."""
