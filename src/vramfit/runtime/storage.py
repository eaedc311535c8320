"""Faults of the storage, told apart from the program's: which errno means what, and what the
storage under a folder says about a failed write (a writer's own wording is never trusted: torch's
zip writer says a full disk as `unexpected pos`)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path


# errno -> what the user is told; these are the storage's faults, never the program's.
STORAGE_ERRNOS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
                  errno.EFBIG: "a file reached the file size limit (ulimit -f)",
                  errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
                  errno.EPERM: "permission denied", errno.EIO: "an input/output error on the disk"}
PROBE_BYTES = 1 << 20


def storage_fault(error: BaseException, root: Path, written: Path | None = None) -> str | None:
    """What about the storage under `root` made `error` happen, or None when the storage is fine
    (the error is the program's). Checked in order: an OSError with a storage errno anywhere in the
    exception's chain; a file in `written` that reached the file size limit; a write probe that
    fails; free space under one probe."""
    cause = errno_fault(error)
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
        if shutil.disk_usage(root).free < PROBE_BYTES:
            return STORAGE_ERRNOS[errno.ENOSPC]
    return None


def errno_fault(error: BaseException) -> str | None:
    """The storage fault an OSError anywhere in `error`'s chain names by its errno, or None."""
    seen, e = set(), error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            where = f" ({e.filename})" if getattr(e, "filename", None) else ""
            return STORAGE_ERRNOS[e.errno] + where
        e = e.__cause__ or e.__context__
    return None


def _file_size_limit() -> int | None:
    try:
        import resource
    except ImportError:  # not on POSIX
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


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
