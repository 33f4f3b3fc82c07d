"""A plotting process forked when `ssmquant analyze` starts, before it imports torch.

The plots need matplotlib, seaborn and the scipy and pandas they import (1-2 s of imports and font loading)
and nothing of torch. Imported in a thread of the analysing process (``files.prefetch_plotting``), they hold
its GIL while the host queues the emulation's kernels and reduces the finished layers, which on a GPU sets
the pace of the run. Forked first thing, the server imports them on a core of its own and then waits; at the
end the tables are sent to it (pickled through a pipe, so it receives the same values), and it renders the
plots into the output directory (one forked child per plot but the last, ``files._fork_plots``: the bytes an
in-process render writes) while this process writes the tables. It only draws with matplotlib: no CUDA, no
threads of its own, and it leaves with ``os._exit``, so none of the parent's state is torn down twice.
Closing the request pipe without a job (an error, or Ctrl-C, in the analysis) ends it.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
import threading
import traceback

_HEADER = struct.Struct("<Q")  # the length of one pickled message


def _write_message(fd: int, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exactly(fd: int, n: int) -> bytes | None:
    parts, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None  # the other end closed
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _read_message(fd: int):
    """The next message, or None when the other end closed the pipe first."""
    head = _read_exactly(fd, _HEADER.size)
    if head is None:
        return None
    data = _read_exactly(fd, _HEADER.unpack(head)[0])
    return None if data is None else pickle.loads(data)


def _serve(requests: int, replies: int) -> None:
    """The server's life: import and warm up the plotting stack, render the one job it is sent, reply."""
    try:
        from .plots import warm_up

        warm_up()
    except Exception:  # noqa: BLE001, S110 - the same import fails again below, and is replied then
        pass
    job = _read_message(requests)
    if job is None:
        return
    traces, heads, summary, report, out_dir = job
    try:
        from .files import _fork_plots

        names = _fork_plots(traces, heads, summary, report, out_dir)()
        reply = ("ok", names)
    except Exception as err:  # noqa: BLE001 - its traceback on stderr, its message to the parent
        traceback.print_exc()
        reply = ("error", str(err) if isinstance(err, RuntimeError) else f"{type(err).__name__}: {err}")
    _write_message(replies, reply)


class PlotServer:
    """The parent's handle on a forked plotting process (``start``); ``render`` sends it the tables, ``close``
    ends it without a job."""

    def __init__(self, pid: int, requests: int, replies: int):
        self.pid, self._requests, self._replies = pid, requests, replies

    @classmethod
    def start(cls) -> PlotServer:
        """Fork the server. Call it before torch (and CUDA) are loaded, from a process with no other threads."""
        sys.stdout.flush()
        sys.stderr.flush()
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the server
            status = 1
            try:
                os.close(req_w)
                os.close(rep_r)
                _serve(req_r, rep_w)
                status = 0
            except KeyboardInterrupt:
                status = 130
            except BaseException:  # noqa: BLE001 - reported on stderr; the parent reads a closed pipe
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(status)
        os.close(req_r)
        os.close(rep_w)
        return cls(pid, req_w, rep_r)

    def render(self, traces, heads, summary, report: dict, out_dir):
        """Send the tables; the server renders files.PLOT_FILES into out_dir. Returns ``wait(render=True)``,
        which waits for the server and returns the file names, or raises RuntimeError with the server's
        message (a failed plot's traceback is on stderr); ``render=False`` (after an error elsewhere) only
        waits, so that no plotting process outlives the run. The tables are sent from a thread (the pipe
        holds 64 KiB; the server may still be importing), so this returns at once."""
        failed: list[BaseException] = []
        fd = self._requests

        def send():
            try:
                _write_message(fd, (traces, heads, summary, report, str(out_dir)))
            except BaseException as err:  # noqa: BLE001 - a server that died closed its end: reported by wait
                failed.append(err)
            finally:
                os.close(fd)

        sender = threading.Thread(target=send, name="ssmquant-plot-send", daemon=True)
        sender.start()
        self._requests = -1

        def wait(render: bool = True) -> list[str]:
            sender.join()
            reply = _read_message(self._replies)
            status = self._reap()
            if not render:
                return []
            if reply is None:
                cause = f": {failed[0]}" if failed else ""
                raise RuntimeError(f"the plotting process ended (status {status}) without plotting{cause}")
            kind, value = reply
            if kind != "ok":
                raise RuntimeError(value)
            return list(value)

        return wait

    def close(self) -> None:
        """End a server that got no job (closing its request pipe); harmless after ``render``'s wait."""
        if self._requests >= 0:
            os.close(self._requests)
            self._requests = -1
        if self.pid:
            self._reap()

    def _reap(self) -> int:
        os.close(self._replies)
        self._replies = -1
        _, status = os.waitpid(self.pid, 0)
        self.pid = 0
        return os.waitstatus_to_exitcode(status)
