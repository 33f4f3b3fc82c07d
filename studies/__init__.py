"""Reproducible studies of quantized SSM state (not part of the installed package).

    python -m studies.run --scale cpu        # simulations -> the committed summary tables studies/<study>/data/
    python studies/make_pages.py             # every page, table and plot from those tables (CPU, seconds)

Each study is one module, `studies/<study>/study.py`, with `collect(ctx)` (runs the library, writes its
summary CSVs) and `page(data, out)` (builds its README.md, tables and plots from them). Shared helpers:
`studies.common` (statistics, tables, plots, measurement).
"""
