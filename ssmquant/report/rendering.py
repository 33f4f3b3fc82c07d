"""Rendering an analysis' plots without waiting for them: the plotting stack imported in a background thread while
the analysis runs (``prefetch_plotting``), and the plots drawn at once by forked children (``fork_plots``) while
``files.write_analysis`` writes the tables.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
import warnings

# With at least this many cores (and os.fork, on Linux), the plots render at once: the process forks one child
# per plot but the last, which inherits the imported plotting stack and the tables (nothing to import or
# pass), renders its plot into the output directory and exits; this process writes the tables, then renders
# the last plot. The PNGs are the bytes an in-process render writes (tests/test_cli.py). 0 turns it off.
# (Forked children beat a plotting process per plot that imports the stack itself, and one plotting process fed
# through a pipe, by several seconds on a GPU host: benchmarks/RESULTS.md, "analyze".)
PLOT_FORK_MIN_CPUS = 4

_prefetch: threading.Thread | None = None


def prefetch_plotting() -> None:
    """Get the plots ready while the analysis runs: a background thread imports the plotting stack (matplotlib,
    seaborn and the scipy it imports: about 1-2 s) and loads the fonts. ``write_analysis`` and ``replot`` wait
    for it before plotting; an error in it surfaces there, in the main thread."""
    global _prefetch
    if _prefetch is None and "ssmquant.report.plots" not in sys.modules:
        _prefetch = threading.Thread(target=_warm_plots, name="ssmquant-plot-prefetch", daemon=True)
        _prefetch.start()


def can_fork() -> bool:
    """Whether the plots render in forked children (``PLOT_FORK_MIN_CPUS``, Linux)."""
    return bool(PLOT_FORK_MIN_CPUS) and sys.platform.startswith("linux") and (os.cpu_count() or 1) >= PLOT_FORK_MIN_CPUS


def fork_plots(traces, heads, summary, report: dict, out_dir):
    """Start rendering the plots (``plots.PLOT_FILES``) at once: one forked child per plot but the last. Returns
    ``wait(render=True)``,
    which renders the last plot in this process (unless ``render`` is false: after an error elsewhere) and
    waits for the children; it returns the file names, or raises RuntimeError naming each plot whose child
    failed (its traceback is on stderr).

    A child only draws with matplotlib (no CUDA, no threads of its own) and leaves with os._exit, so none of
    the parent's state is torn down twice."""
    plots = ready_plots()
    names = list(plots.PLOT_FILES)
    sys.stdout.flush()
    sys.stderr.flush()
    children: dict[str, int] = {}

    def wait(render: bool = True) -> list[str]:
        try:
            if render:
                plots.render_one(names[-1], traces, heads, summary, report, out_dir)
        finally:
            failed = []
            for name, pid in children.items():
                _, status = os.waitpid(pid, 0)
                if os.waitstatus_to_exitcode(status) != 0:
                    failed.append(f"{name} (status {os.waitstatus_to_exitcode(status)})")
        if failed:
            raise RuntimeError(f"the process plotting {', '.join(failed)} failed; its traceback is above")
        return names

    try:
        for name in names[:-1]:
            with warnings.catch_warnings():
                # Python warns that forking a multi-threaded process may deadlock the child: the other threads
                # (CUDA's, torch's pools) hold no lock the child's drawing takes
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
            if pid == 0:  # the child
                status = 1
                try:
                    plots.render_one(name, traces, heads, summary, report, out_dir)
                    status = 0
                except KeyboardInterrupt:
                    status = 130
                except BaseException:  # noqa: BLE001 - reported on stderr, the parent names the plot
                    traceback.print_exc()
                finally:
                    sys.stderr.flush()
                    os._exit(status)
            children[name] = pid
    except BaseException:
        wait(render=False)
        raise
    return wait


def _warm_plots() -> None:
    try:
        _plots_module().warm_up()
    except Exception:  # noqa: BLE001 - re-raised by the main thread's own import or plot
        pass


def ready_plots():
    """The plots module, once a running prefetch has finished (matplotlib is not thread-safe)."""
    if _prefetch is not None:
        _prefetch.join()
    return _plots_module()


def _plots_module():
    from . import plots  # matplotlib and seaborn (1-2 s) are imported only when plotting

    return plots
