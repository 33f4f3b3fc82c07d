"""Output directories: choosing one, claiming it (a lock against a concurrent run), and writing into it
atomically without ever removing what the user did not ask to replace.

A command's files are written into a temporary sibling directory that is renamed into place only when complete
(`write_atomically`); `--force` replaces a directory only when it is a previous output of the same command
(OUTPUT_MARKER) holding nothing else; leftovers of interrupted runs are cleaned only when they are recognisably
ssmquant's.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import pathlib
import re
import shutil
import tempfile
import warnings

from .. import __version__
from ..errors import SsmquantError
from ..filemodes import follow_umask

try:
    import fcntl
except ImportError:  # not on Windows: claim_out_dir's lock falls back to a pid file
    fcntl = None


class OutputError(SsmquantError, ValueError):
    """The output directory cannot be used (exists and is not empty without --force, ...)."""



# What each command writes, for recognising a previous output of it: `write_atomically` leaves OUTPUT_MARKER in
# every output directory, naming the command and every file it wrote; an output written before the marker existed
# is recognised by its report file, which lists its files. `--force` replaces a directory only when it is such an
# output of the same command and holds nothing else.
OUTPUT_MARKER = ".ssmquant-output.json"
REPORT_FILES = {"analyze": "report.json", "eval": "eval.json", "calibrate": "ssm_quant_config.json",
                "export": "export_report.json"}  # fmt: skip


# Outputs another command writes inside this command's output: `export` writes into the recipe directory
# (RECIPE/export-TARGET), so a recipe replaced by `calibrate --force` takes its exports, made from it, along.
NESTED_OUTPUTS = {"calibrate": ("export",)}


def _listed_files(directory: pathlib.Path, command: str) -> set[str] | None:
    """The files a previous `ssmquant COMMAND` output in ``directory`` consists of (with those of the outputs
    NESTED_OUTPUTS allows inside it), or None when it is not one."""
    own = _own_listed_files(directory, command)
    if own is None:
        return None
    for sub in (p for p in directory.iterdir() if p.is_dir() and not p.is_symlink()):
        for nested in NESTED_OUTPUTS.get(command, ()):
            files = _own_listed_files(sub, nested)
            if files is not None:
                own |= {f"{sub.name}/{f}" for f in files}
    return own


def _own_listed_files(directory: pathlib.Path, command: str) -> set[str] | None:
    marker = directory / OUTPUT_MARKER
    try:
        if marker.is_file():
            doc = json.loads(marker.read_text())
            if doc.get("command") != command:
                return None
            return {*doc["files"], OUTPUT_MARKER}
        report = directory / REPORT_FILES[command]
        if not report.is_file():
            return None
        listed = json.loads(report.read_text()).get("files")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if isinstance(listed, dict):  # a recipe names its files by role
        listed = list(listed.values())
    if not isinstance(listed, list) or not all(isinstance(f, str) for f in listed):
        return None
    return {*listed, REPORT_FILES[command]}


def _protected(out: pathlib.Path) -> str | None:
    """Why ``out`` (resolved) must never be replaced, or None: the current directory or one above it, the home
    directory, a filesystem root or a mount point."""
    cwd = pathlib.Path.cwd().resolve()
    if out == cwd:
        return "is the current directory"
    if out in cwd.parents:
        return "contains the current directory"
    if out == pathlib.Path.home().resolve():
        return "is the home directory"
    if out == pathlib.Path(out.anchor) or os.path.ismount(out):
        return "is a filesystem root or mount point"
    return None


def check_out_dir(out_dir, force: bool, command: str = "analyze") -> pathlib.Path:
    """Refuse, before any work, a DIR that cannot be written: an empty name; the current directory, a parent of
    it, the home directory or a filesystem root; a non-empty existing directory, unless ``force`` and it is a
    previous output of ``command`` (one of REPORT_FILES) holding nothing else; a path that is a file; or one whose
    nearest existing parent is not a writable directory (the run creates DIR beside its temporary sibling there,
    and renames it into place)."""
    if out_dir is None or not str(out_dir).strip():
        raise OutputError("--out is empty; name the output directory")
    out = pathlib.Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out} exists and is not a directory")
    resolved = out.resolve()
    why = _protected(resolved)
    if why is not None:
        raise OutputError(
            f"--out {out} {why}; ssmquant writes a new directory, choose one such as {out / 'ssmquant-out'}"
        )
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise OutputError(f"--out {out} exists and is not empty; pass --force to replace it, or choose another DIR")
        listed = _listed_files(out, command)
        if listed is None:
            raise OutputError(
                f"--out {out} is not a previous `ssmquant {command}` output; --force replaces only such a directory: "
                "choose another DIR"
            )
        foreign = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() or p.is_symlink()
                         if str(p.relative_to(out)) not in listed)  # fmt: skip
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise OutputError(
                f"--out {out} holds files that `ssmquant {command}` did not write ({shown}); --force replaces only "
                "ssmquant's own files: move them or choose another DIR"
            )
    parent = out.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(f"--out {out} cannot be created: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"--out {out} cannot be created: {parent} is not writable; choose another DIR")
    return out


class OutputBusyError(OutputError):
    """Another live ssmquant run holds the output directory (``claim_out_dir``)."""


# This process's claims: resolved DIR -> the lock file's descriptor (a claim inside a claim of the same DIR, e.g.
# write_atomically's inside the command's, takes nothing more).
_claims: dict[pathlib.Path, int] = {}


def lock_path(out: pathlib.Path) -> pathlib.Path:
    """The lock file of output directory ``out``: a hidden sibling, beside the temporary directory it is written in."""
    return out.parent / f".{out.name}.lock"


@contextlib.contextmanager
def claim_out_dir(out_dir, force: bool, command: str = "analyze"):
    """Hold output directory DIR for a run, from its start to the end of the block: ``check_out_dir``; then DIR's
    parent is created where missing and proven writable (a temporary directory is made in it and removed: a
    permission check passes for root on /proc, where nothing can be created); then DIR's lock file is locked, so
    that a second run into the same DIR is refused at its start (OutputBusyError, naming the pid holding it)
    instead of after all its work; then DIR is checked again (another run may have written it meanwhile).

    The lock is an exclusive ``flock`` on ``.DIR.lock`` beside DIR, which the kernel releases when its process
    dies: a lock file left by a killed run is taken over. (Where flock is missing or refused, the file is created
    exclusively and holds the pid: a file whose pid is no longer running is taken over.) The lock file, and the
    parents this claim created while DIR was not written, are removed at the end. Yields DIR (``check_out_dir``'s
    path); a claim of a DIR this process already holds only checks it."""
    out = check_out_dir(out_dir, force, command)
    key = out.resolve()
    if key in _claims:
        yield out
        return
    created = _make_parents(out, key.parent)
    try:
        _probe_writable(out, key.parent)
        fd = _lock(out, lock_path(key))
    except BaseException:
        _remove_empty(created)
        raise
    _claims[key] = fd
    try:
        clean_leftovers(key, command)
        check_out_dir(out_dir, force, command)
        yield out
    finally:
        del _claims[key]
        with contextlib.suppress(OSError):
            if os.stat(lock_path(key)).st_ino == os.fstat(fd).st_ino:
                lock_path(key).unlink()  # before the lock is released: a waiting run then creates a new file
        os.close(fd)
        if not key.exists():
            _remove_empty(created)


def _make_parents(out: pathlib.Path, parent: pathlib.Path) -> list[pathlib.Path]:
    missing = []
    while not parent.exists() and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    created = []
    try:
        for d in reversed(missing):
            d.mkdir()
            created.append(d)
    except OSError as err:
        _remove_empty(created)
        raise OutputError(f"--out {out} cannot be created: {err.strerror or err} ({err.filename})") from None
    return created


def _remove_empty(created: list[pathlib.Path]) -> None:
    for d in reversed(created):
        try:
            d.rmdir()
        except OSError:
            return


def _probe_writable(out: pathlib.Path, parent: pathlib.Path) -> None:
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".{out.name}.probe-", dir=parent))
    except OSError as err:
        raise OutputError(
            f"--out {out} cannot be created: no directory can be made in {parent} ({err.strerror or err}); choose "
            "another DIR"
        ) from None


# What an ssmquant lock file holds: a lock file whose content is not this (or, from earlier versions, a bare pid)
# is the user's, and is never truncated, taken over or removed.
LOCK_SIGNATURE = "ssmquant output lock, pid "


def _lock_text() -> bytes:
    return f"{LOCK_SIGNATURE}{os.getpid()}\n".encode()


def _lock_owner(text: bytes) -> tuple[bool, int | None]:
    """(is it an ssmquant lock, the pid in it) for a lock file's content."""
    line = text.decode(errors="replace").strip()
    if line.startswith(LOCK_SIGNATURE):
        line = line[len(LOCK_SIGNATURE) :]
    elif not re.fullmatch(r"\d+", line):
        return False, None
    return True, int(line) if line.isdigit() else None


def _not_a_lock(out: pathlib.Path, path: pathlib.Path) -> OutputError:
    return OutputError(
        f"--out {out} is held through the lock file {path}, which exists and is not ssmquant's; ssmquant leaves it "
        "as it is: rename or remove it, or choose another DIR"
    )


def _open_lock(out: pathlib.Path, path: pathlib.Path) -> int | None:
    """A descriptor of ``path``, an ssmquant lock file: created with its content in one step (a linked temporary
    file) where missing, opened and its content checked where present. None: created or removed meanwhile by
    another run, try again."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        try:
            handle, tmp = tempfile.mkstemp(prefix=f"{path.name}.", suffix=".new", dir=path.parent)
        except OSError as err:
            raise _uncreatable(out, path, err) from None
        try:
            os.write(handle, _lock_text())
            os.close(handle)
            os.link(tmp, path)
        except FileExistsError:
            return None
        except OSError as err:
            raise _uncreatable(out, path, err) from None
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        try:
            return os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return None
    except OSError as err:
        raise _uncreatable(out, path, err) from None
    ours, _ = _lock_owner(os.pread(fd, 256, 0))
    if not ours:
        os.close(fd)
        raise _not_a_lock(out, path)
    return fd


def _lock(out: pathlib.Path, path: pathlib.Path) -> int:
    """Lock ``path`` for this process (``claim_out_dir``); returns its descriptor."""
    for _ in range(5):
        fd = _open_lock(out, path)
        if fd is None:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _, holder = _lock_owner(os.pread(fd, 256, 0))
            os.close(fd)
            raise _busy(out, holder) from None
        except (OSError, AttributeError):  # no flock here (another OS, a file system without locks)
            os.close(fd)
            return _lock_by_pid(out, path)
        try:  # a run that finished meanwhile removed the file this descriptor opened: lock the one named now
            current = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current:
            os.ftruncate(fd, 0)
            os.pwrite(fd, _lock_text(), 0)
            return fd
        os.close(fd)
    raise _busy(out, None)


def _lock_by_pid(out: pathlib.Path, path: pathlib.Path) -> int:
    for _ in range(5):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            try:
                ours, holder = _lock_owner(path.read_bytes())
            except OSError:
                continue
            if not ours:
                raise _not_a_lock(out, path) from None
            if holder is not None and _alive(holder):
                raise _busy(out, holder) from None
            with contextlib.suppress(OSError):
                path.unlink()  # the run that left it is gone
            continue
        except OSError as err:
            raise _uncreatable(out, path, err) from None
        os.write(fd, _lock_text())
        return fd
    raise _busy(out, None)


def _uncreatable(out: pathlib.Path, path: pathlib.Path, err: OSError) -> OutputError:
    return OutputError(f"--out {out} cannot be created: {path} cannot be created ({err.strerror or err})")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def _busy(out: pathlib.Path, holder: int | None) -> OutputBusyError:
    who = f"another ssmquant run (pid {holder})" if holder else "another ssmquant run"
    return OutputBusyError(f"--out {out} is being written by {who}; wait for it to finish or choose another DIR")


DEFAULT_OUT_ROOT = "ssmquant-out"


def default_out_dir(command: str, model: str, *, synthetic: bool = False) -> pathlib.Path:
    """The output directory of a run without --out: ``ssmquant-out/COMMAND-MODEL`` under the current directory
    (MODEL: the preset, shipped model or checkpoint directory's name, ``-synthetic`` for synthetic inputs), or
    the first of ``-2``, ``-3``, ... that neither exists nor is being written: a run never replaces an output
    it did not name."""
    name = pathlib.Path(os.path.abspath(os.path.expanduser(str(model)))).name
    name = re.sub(r"[^A-Za-z0-9._+-]+", "-", name).strip(".-") or "model"
    base = pathlib.Path(DEFAULT_OUT_ROOT) / f"{command}-{name}{'-synthetic' if synthetic else ''}"
    out, i = base, 1
    while out.exists() or out.is_symlink() or lock_path(out).exists():
        i += 1
        out = base.with_name(f"{base.name}-{i}")
    return out


# Inside a temporary output directory while it is written (removed before it is renamed into place): marks it as
# ssmquant's, so that a later run into the same DIR removes what a killed run left (``clean_leftovers``).
PARTIAL_MARKER = ".ssmquant-partial"


class OutputWarning(UserWarning):
    """Something about the output the user should know, the run having succeeded (the CLI prints one line)."""


def _leftovers(out: pathlib.Path) -> list[pathlib.Path]:
    """The temporary siblings of DIR a run creates: ``.DIR.tmp-*`` (being written), ``.DIR.old-*`` (the output
    being replaced), ``.DIR.probe-*`` (the writability probe)."""
    return sorted(p for kind in ("tmp", "old", "probe") for p in out.parent.glob(f".{glob.escape(out.name)}.{kind}-*"))


def clean_leftovers(out: pathlib.Path, command: str) -> list[pathlib.Path]:
    """Remove what runs of ``command`` into ``out`` killed by an uncatchable signal left beside it; the caller holds
    DIR's lock, so no live run is writing them. Only ssmquant's own: a ``.DIR.tmp-*`` holding PARTIAL_MARKER or
    OUTPUT_MARKER, the files a ``.DIR.old-*`` output of ``command`` lists (anything else in it stays), an empty
    ``.DIR.probe-*``. Returns what was removed."""
    removed = []
    for path in _leftovers(out):
        if path.is_symlink() or not path.is_dir():
            continue
        kind = path.name[len(out.name) + 2 :].split("-", 1)[0]
        if kind == "tmp" and ((path / PARTIAL_MARKER).is_file() or (path / OUTPUT_MARKER).is_file()):
            shutil.rmtree(path, ignore_errors=True)
        elif kind == "old":
            _remove_listed(path, command)
        elif kind == "probe":
            with contextlib.suppress(OSError):
                path.rmdir()
        if not path.exists():
            removed.append(path)
    return removed


def _remove_listed(directory: pathlib.Path, command: str) -> list[str]:
    """Remove the files ``directory``, an output of ``command``, lists (``_listed_files``), then the directories
    left empty, ``directory`` itself included. Returns the paths (relative) that are not ssmquant's and stay."""
    for rel in _listed_files(directory, command) or set():
        path = directory / rel
        if path.is_file() or path.is_symlink():
            with contextlib.suppress(OSError):
                path.unlink()
    for sub in sorted((p for p in directory.rglob("*") if p.is_dir() and not p.is_symlink()), reverse=True):
        with contextlib.suppress(OSError):
            sub.rmdir()  # only when empty
    with contextlib.suppress(OSError):
        directory.rmdir()
    if not directory.exists():
        return []
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if not p.is_dir() or p.is_symlink())


def write_atomically(out_dir, force: bool, fill, command: str = "analyze") -> pathlib.Path:
    """Create out_dir by calling fill(tmp_dir) on a temporary sibling, then renaming it into place; its
    files and directories get the modes the user's umask gives (``follow_umask``), and OUTPUT_MARKER names
    ``command`` and the files, so that a later ``force`` recognises the output. The directory is checked again
    here, and held while it is written (``claim_out_dir``: a no-op check when the caller already holds it, as the
    commands do from their start). A file-system error (permissions changed since the check, disk full) becomes
    an OutputError naming DIR; nothing is left.

    Replacing a previous output (``force``): the old directory is moved aside and the new one renamed into its
    place; then only the files the old output lists are removed. A file the user put into it while the run worked
    is moved back into DIR at the same path (an OutputWarning names it); where the new output has a file of that
    name, the old directory stays beside DIR under a visible name with the user's files, and the warning says so."""
    with claim_out_dir(out_dir, force, command) as claimed:
        return _write_atomically(claimed.resolve(), fill, command)


def _write_atomically(out: pathlib.Path, fill, command: str) -> pathlib.Path:
    try:
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        (tmp / PARTIAL_MARKER).write_text(f"{os.getpid()}\n")
    except OSError as err:
        raise OutputError(f"--out {out} cannot be created: {err.strerror or err}") from None
    try:
        fill(tmp)
        written = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file() and p.name != PARTIAL_MARKER)
        marker = {"command": command, "ssmquant": __version__, "files": written}
        (tmp / OUTPUT_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        (tmp / PARTIAL_MARKER).unlink()  # OUTPUT_MARKER marks it as ssmquant's from here on
        follow_umask(tmp)
        if out.exists():
            with contextlib.suppress(OSError):
                out.rmdir()  # an empty directory, which --out may name without --force
        if out.exists():
            _replace(out, tmp, command)
        else:
            tmp.rename(out)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OutputError(f"cannot write --out {out}: {err}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _replace(out: pathlib.Path, new: pathlib.Path, command: str) -> None:
    """Put the finished output ``new`` in the place of the previous output ``out`` (``write_atomically``)."""
    if _listed_files(out, command) is None:  # changed while the run worked: not ours to replace any more
        kept = _free_sibling(out, "new")
        new.rename(kept)
        raise OutputError(
            f"--out {out} is no longer a previous `ssmquant {command}` output (it changed while this run worked); "
            f"it was left as it is, and this run's output is in {kept}"
        )
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    out.rename(old)
    new.rename(out)
    stay = _remove_listed(old, command)
    if not stay:
        return
    clashes = [rel for rel in stay if (out / rel).exists() or (out / rel).is_symlink()]
    if not clashes:
        for rel in stay:
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            (old / rel).rename(out / rel)
        _remove_listed(old, command)
        warnings.warn(
            f"--out {out}: kept {', '.join(stay)}, written into it while this run worked (not ssmquant's)",
            OutputWarning,
            stacklevel=4,
        )
        return
    kept = _free_sibling(out, "kept")
    old.rename(kept)
    warnings.warn(
        f"--out {out}: {', '.join(stay)} appeared in it while this run worked and are not ssmquant's; the new output "
        f"has files of the same name ({', '.join(clashes)}), so they are kept in {kept}",
        OutputWarning,
        stacklevel=4,
    )


def _free_sibling(out: pathlib.Path, word: str) -> pathlib.Path:
    i = 1
    while True:
        path = out.with_name(f"{out.name}.{word}" + (f"-{i}" if i > 1 else ""))
        if not path.exists() and not path.is_symlink():
            return path
        i += 1
