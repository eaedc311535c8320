"""Faults of the storage, told apart from the program's: which errno means what, and what the
storage under a folder says about a failed write (a writer's own wording is never trusted: torch's
zip writer says a full disk as `unexpected pos`)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
from pathlib import Path

from ..errors import VramfitError


# errno -> what the user is told; these are the storage's faults, never the program's.
STORAGE_ERRNOS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
                  errno.EFBIG: "a file reached the file size limit (ulimit -f)",
                  errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
                  errno.EPERM: "permission denied", errno.EIO: "an input/output error on the disk"}
ACCESS_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS)  # the storage refuses, whatever its free space
# errno -> what is wrong with the path itself (not the storage): a file where a folder must go.
PATH_ERRNOS = {errno.EEXIST: "a file of that name is in the way",
               errno.ENOTDIR: "a file of that name is in the way"}
PROBE_BYTES = 1 << 20
# A folder name's limit on the file systems runs are written to (NAME_MAX, bytes, not characters).
NAME_MAX_BYTES = 255


def storage_fault(error: BaseException, root: Path, written: Path | None = None, need: int = 0,
                  name_file: bool = True) -> str | None:
    """What about the storage under `root` made `error` happen, or None when the storage is fine
    (the error is the program's). Checked in order: an OSError with a storage errno anywhere in the
    exception's chain; a file in `written` that reached the file size limit; a write probe that
    fails; free space under one probe, or under the `need` bytes the write was to take (a writer
    that removes its partial file, such as safetensors', leaves room for the probe). `name_file`:
    the errno's file in brackets (not where the caller names the file itself)."""
    cause = errno_fault(error, name_file)
    if cause is not None:
        return cause
    limit = _file_size_limit()
    if limit is not None and written is not None and written.is_dir():
        sizes = [f.stat().st_size for f in written.rglob("*") if f.is_file()]
        if sizes and max(sizes) >= limit - PROBE_BYTES:
            return f"a file reached the file size limit (ulimit -f: {limit} bytes)"
    probe = Path(root) / f".vramfit-space-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as probe_error:
        return STORAGE_ERRNOS.get(probe_error.errno, probe_error.strerror or str(probe_error))
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    with contextlib.suppress(OSError):
        free = shutil.disk_usage(root).free
        if free < PROBE_BYTES or free < need:
            return STORAGE_ERRNOS[errno.ENOSPC] + (f" ({_size(need)} needed)" if free >= PROBE_BYTES else "")
    return None


def exception_chain(error: BaseException) -> list[BaseException]:
    """`error` and what caused it (`raise ... from`, or raised while handling), each once."""
    chain, e = [], error
    while e is not None and all(e is not c for c in chain):
        chain.append(e)
        e = e.__cause__ or e.__context__
    return chain


def os_cause(error: OSError) -> str:
    """What an OSError says about the storage or the path, in the words the messages use (the
    storage's faults first, then a file in the way, then the system's own words)."""
    return STORAGE_ERRNOS.get(error.errno) or PATH_ERRNOS.get(error.errno) or error.strerror or str(error)


def errno_fault(error: BaseException, name_file: bool = True) -> str | None:
    """The storage fault an OSError anywhere in `error`'s chain names by its errno, or None."""
    for e in exception_chain(error):
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            where = f" ({e.filename})" if name_file and getattr(e, "filename", None) else ""
            return STORAGE_ERRNOS[e.errno] + where
    return None


def _file_size_limit() -> int | None:
    try:
        import resource
    except ImportError:  # not on POSIX
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


# -------------------------------------------------------------------------------------------------
# The one writer: every file vramfit writes is whole or absent, and a write that fails for the
# storage's sake (a full disk, a removed run folder) is one clear error naming the path.

# Run folders a running command writes into: once one is removed (a cleanup script, `rm -rf`), no
# writer recreates it (see `run_folder_removed`).
_watched: set[Path] = set()


def watch(run_dir: Path) -> None:
    """From now on `run_dir` must stay: a writer under it that finds it gone stops the command."""
    _watched.add(Path(run_dir).absolute())


def unwatch(run_dir: Path, keep_removed: bool = False) -> None:
    """`keep_removed`: a removed folder stays known until the error that ends the command is told."""
    root = Path(run_dir).absolute()
    if not (keep_removed and not root.is_dir()):
        _watched.discard(root)


def removed_root(path: Path) -> Path | None:
    """The watched run folder holding `path` that no longer exists, or None."""
    path = Path(path).absolute()
    for root in _watched:
        if (path == root or root in path.parents) and not root.is_dir():
            return root
    return None


def run_folder_removed(root: Path) -> VramfitError:
    # Stop rather than recreate it: its config.yaml, plan, record and checkpoints are gone, and a
    # recreated folder would hold a model/ and a summary.json that look like a whole run's while
    # nothing before the removal could be resumed or checked (nor is the run's lock held any more).
    return VramfitError(f"The run folder {root} was removed while the run was writing it; nothing more "
                        "can be saved there, so the run stops.",
                        hint="re-run the same command to start the run again (or pick another --output)")


def write_error(error: BaseException, path: Path, what: str = "", need: int = 0) -> VramfitError | None:
    """The user's error for `error`, raised while writing `path` (`what` names it), or None when
    the storage is fine and the error is the program's."""
    if isinstance(error, VramfitError):
        return error
    path = Path(path)
    root = removed_root(path)
    if root is not None:
        return run_folder_removed(root)
    where = _existing(path.parent)
    cause = storage_fault(error, where, path if path.is_dir() else None, need, name_file=False)
    if cause is None:
        return None
    # The free space, where the space may be the cause (not for a permission or a read-only disk).
    codes = {e.errno for e in exception_chain(error) if isinstance(e, OSError)}
    access = bool(codes & set(ACCESS_ERRNOS))
    return VramfitError(f"Could not write {what + ' ' if what else ''}{path}: {cause}"
                        f"{'' if access else free_space(where)}. "
                        "Everything saved before it is kept.",
                        hint=f"{_fix_for(codes, where)}, or {_elsewhere(path)}; then re-run the same command")


def _elsewhere(path: Path) -> str:
    # A run's own files move with its --output; a command's single output file (--csv, --plot) is named.
    path = path.absolute()
    in_run = any(path == root or root in path.parents for root in _watched)
    return "pick another --output" if in_run else "name a file on another disk"


def _fix_for(codes: set, where: Path) -> str:
    """What to do about a write that failed with these errnos, on the storage holding `where`."""
    if errno.EROFS in codes:
        return f"mount {where} writable"
    if codes & set(ACCESS_ERRNOS):
        return f"give this user write permission on {where}"
    if errno.EFBIG in codes:
        return "raise the file size limit (`ulimit -f unlimited`)"
    if errno.EDQUOT in codes:
        return f"free space within your quota on {where}"
    return f"free space on the disk holding {where}"


def escaped_fault(error: BaseException, near: Path | None = None, what: str = "a file in the run folder"
                  ) -> VramfitError | None:
    """The user's error for an exception no writer caught (a library's own writer, TensorBoard's
    event file): a watched run folder that is gone, or an OSError with a storage errno in its
    chain, told with its file, or where the error names none (TensorBoard's writer thread's
    doesn't), with the file or folder `near` it was writing (`what` names it); None when neither."""
    oserrors = [e for e in exception_chain(error) if isinstance(e, OSError)]
    gone = next((root for root in _watched if not root.is_dir()), None)
    if oserrors and gone is not None:
        return run_folder_removed(gone)
    if errno_fault(error) is None:
        return None
    named = next((Path(os.fsdecode(e.filename)) for e in oserrors if e.filename), None)
    named = named or _raised_at(oserrors)
    if named is None and near is not None:
        return write_error(error, Path(near), what)
    return write_error(error, named or Path.cwd())


def _raised_at(oserrors: list[OSError]) -> Path | None:
    """The file an OSError without a filename was raised on, from the frame that raised it: a
    file's close() (where a full disk shows with buffered writes) names none, while the writer's
    frame holds the path it opened (TensorBoard's gfile: `filename`, as bytes)."""
    for e in oserrors:
        tb = e.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        local = tb.tb_frame.f_locals if tb is not None else {}
        value = local.get("filename")
        if isinstance(value, (str, bytes, os.PathLike)) and os.path.isabs(value):
            return Path(os.fsdecode(value))
    return None


@contextlib.contextmanager
def saving(path: Path, what: str = "", cleanup=None, tell: bool = True, need: int = 0):
    """Around any write of `path`: a storage fault becomes `write_error`'s message (`tell=False`:
    stays as it was). `cleanup()` (removing a temporary file) runs last, after the storage was
    asked, which it must be while the failed write still fills the disk."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - a storage fault is told below; the program's re-raises
        told = write_error(e, path, what, need) if tell else None
        if told is None or told is e:
            raise
        raise told from None
    finally:
        if cleanup:
            cleanup()


def tensor_bytes(tensors) -> int:
    """What a module's or a state dict's tensors take on disk (the `need` of a weights file)."""
    values = tensors.state_dict().values() if hasattr(tensors, "state_dict") else tensors.values()
    return sum(t.numel() * t.element_size() for t in values if hasattr(t, "element_size"))


def make_folder(path: Path) -> Path:
    """mkdir -p, except that a removed run folder is never recreated."""
    path = Path(path)
    root = removed_root(path)
    if root is not None:
        raise run_folder_removed(root)
    with saving(path, "the folder"):
        path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def atomic_path(path: Path, what: str = "", tell: bool = True):
    """Yields a temporary path beside `path` for a writer that takes a path (safetensors, torch,
    matplotlib); on success it replaces `path` whole, on failure it is removed and `path` is as it
    was. `tell=False`: a failure stays the OSError it was (a best-effort cache's caller notes it)."""
    path = Path(path)
    if tell:
        make_folder(path.parent)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")

    def cleanup():
        with contextlib.suppress(OSError):
            tmp.unlink()

    with saving(path, what, cleanup, tell):
        yield tmp
        fsync(tmp)
        os.replace(tmp, path)


def write_bytes(path: Path, data: bytes, what: str = "", tell: bool = True) -> None:
    with atomic_path(path, what, tell) as tmp:
        tmp.write_bytes(data)


def write_text(path: Path, text: str, what: str = "", tell: bool = True) -> None:
    """Whole or not at all: a crash mid-write leaves the file as it was."""
    write_bytes(path, text.encode(), what, tell)


def write_json(path: Path, obj, what: str = "", tell: bool = True) -> None:
    write_text(path, json.dumps(obj, indent=1, default=str), what, tell)


def append_line(path: Path, line: str, what: str = "") -> None:
    """One line added to a record in one write (a reader skips a line a crash cut short)."""
    root = removed_root(path)
    if root is not None:  # `open(.., "a")` would create a file in a recreated folder
        raise run_folder_removed(root)
    with saving(path, what), open(path, "a") as f:
        f.write(line.rstrip("\n") + "\n")


@contextlib.contextmanager
def atomic_folder(path: Path, what: str = "", need: int = 0):
    """Yields an empty folder beside `path`; on success it takes `path`'s place in one step, so
    `path` is always the old complete folder or the new one, never half of either. `need`: about
    how many bytes it will hold (see `storage_fault`)."""
    path = Path(path)
    make_folder(path.parent)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with saving(path, what, lambda: shutil.rmtree(tmp, ignore_errors=True), need=need):
        tmp.mkdir()
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file():
                fsync(f)
        _swap(tmp, path)


@contextlib.contextmanager
def atomic_files(folder: Path, what: str = "", need: int = 0):
    """Yields an empty folder; on success each file written there replaces its namesake in `folder`
    (other files in `folder` stay): for writers that write several files at once (ONNX's external
    data, timm's weights and config)."""
    folder = make_folder(folder)
    tmp = folder / f".incoming{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    with saving(folder, what, lambda: shutil.rmtree(tmp, ignore_errors=True), need=need):
        tmp.mkdir()
        yield tmp
        for f in sorted(tmp.iterdir()):
            fsync(f)
            os.replace(f, folder / f.name)


def _swap(new: Path, path: Path) -> None:
    """`new` takes `path`'s place. Linux exchanges two names in one step (renameat2's
    RENAME_EXCHANGE, which Python's os does not offer); elsewhere the old folder is moved aside
    first, leaving a moment where `path` is absent but both complete folders exist."""
    if not path.exists():
        os.rename(new, path)
    elif not _exchange(new, path):  # on success `new` holds the old folder; the caller removes it
        aside = path.with_name(f".{path.name}.old{os.getpid()}")
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(path, aside)
        os.rename(new, path)
        shutil.rmtree(aside, ignore_errors=True)
    with contextlib.suppress(OSError):
        fsync(path.parent)


def _exchange(a: Path, b: Path) -> bool:
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def fsync(path: Path) -> None:
    """Flush a file or a folder (its entries: a rename in it) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def free_space(path: Path) -> str:
    """`; N MiB free under PATH` for a message, or nothing where it cannot be read."""
    where = _existing(path)
    try:
        return f"; {_size(shutil.disk_usage(where).free)} free under {where}"
    except OSError:
        return ""


def _existing(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def full_stdout() -> Path | None:
    """Standard output when it is a file (`> out.csv`) on a disk with no room left (or over the file
    size limit): the place a write that names no file failed, if any."""
    try:
        if not stat.S_ISREG(os.fstat(1).st_mode):
            return None
        path = Path(os.readlink("/proc/self/fd/1"))
        st = os.fstatvfs(1)
    except OSError:  # not Linux's /proc, or no standard output
        return None
    limit = _file_size_limit()
    at_limit = limit is not None and path.stat().st_size >= limit - PROBE_BYTES
    if st.f_bavail * st.f_frsize < PROBE_BYTES or at_limit:
        return path
    return None


def quiet_writer_threads() -> None:
    """A storage fault in a writer's own thread (TensorBoard's event writer) is not printed there:
    the writer raises it again in the main thread at its next write, where it is told once."""
    import threading

    if _quiet_threads:
        return
    previous = threading.excepthook

    def hook(args):
        if errno_fault(args.exc_value) is None and not isinstance(args.exc_value, FileNotFoundError):
            previous(args)

    threading.excepthook = hook
    _quiet_threads.append(hook)


_quiet_threads: list = []


def named_output(path: str | Path, default_name: str) -> Path:
    """The file a user named for a command's output (`--csv`, `--plot`): a folder, existing or
    written with a trailing slash, means `default_name` inside it, as `cp FILE DIR` does; the
    folders above it are made."""
    given = str(path)
    out = Path(path)
    if out.is_dir() or given.endswith(("/", os.sep)):
        out = out / default_name
    out.parent.mkdir(parents=True, exist_ok=True)
    return out
