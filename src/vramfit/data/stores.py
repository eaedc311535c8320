"""Where shards live: a local path or an fsspec URL (`s3://`, `gs://`, `hf://`, `https://`, `file://`),
opened the same way, so a seek on a remote shard becomes a range request.

A read in the main process (an index, a size, a parquet footer, a tar shard's headers for the
sampler) runs under `within`: a store that stops answering ends the run with a message after
`data.read_timeout_s` instead of hanging it; the loader workers have their own watch (data.loader).
"""

from __future__ import annotations

import os
import re
import threading
from typing import Callable, TypeVar

from ..errors import VramfitError

T = TypeVar("T")
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# A worker reads one sample (a tar header and its image) per seek; fsspec's default 5 MB read-ahead
# would fetch 5 MB for each. 1 MiB holds a typical sample in one range request.
BLOCK_BYTES = 2 ** 20


def is_url(path: str) -> bool:
    return bool(_URL.match(str(path)))


def open_binary(path: str):
    """A seekable binary file: the built-in open for a local path, fsspec's for a URL."""
    if not is_url(path):
        return open(path, "rb")
    import fsspec

    return fsspec.open(path, "rb", block_size=BLOCK_BYTES).open()


def _fs(path: str):
    import fsspec.core

    return fsspec.core.url_to_fs(path)[0]


def size(path: str) -> int:
    return os.stat(path).st_size if not is_url(path) else int(_fs(path).size(path))


def exists(path: str) -> bool:
    return os.path.exists(path) if not is_url(path) else bool(_fs(path).exists(path))


def is_dir(path: str) -> bool:
    return os.path.isdir(path) if not is_url(path) else bool(_fs(path).isdir(path))


def read_bytes(path: str) -> bytes:
    with open_binary(path) as f:
        return f.read()


def read_text(path: str) -> str:
    return read_bytes(path).decode()


def join(folder: str, name: str) -> str:
    return f"{str(folder).rstrip('/')}/{name}" if is_url(folder) else os.path.join(folder, name)


def parent(path: str) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[0] if is_url(path) else os.path.dirname(path)


def within(seconds: float, what: str, fn: Callable[..., T], *args) -> T:
    """`fn(*args)`, or a VramfitError when it has not returned in `seconds` (a stalled store).

    A thread, because a blocked read cannot be interrupted from Python; it is a daemon, so a read
    that never returns does not keep the process alive after the error ends the run."""
    out: dict = {}

    def call():
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            out["error"] = e

    t = threading.Thread(target=call, name="vramfit-read", daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise VramfitError(f"The data stalled: {what} took over {seconds:.0f} s (data.read_timeout_s).",
                           hint="check the store the data is on (network, credentials, a hung mount); "
                                "raise --set data.read_timeout_s=SECONDS for slow storage")
    if "error" in out:
        raise out["error"]
    return out["value"]


def parallel(fn: Callable[[str], T], items: list[str], threads: int = 16) -> list[T]:
    """[fn(x) for x in items] on up to `threads` daemon threads (small reads of many files, e.g.
    parquet footers, each a round trip to a remote store); the first failure is raised.

    Not concurrent.futures: its threads are joined at interpreter exit, so one read stalled for
    ever (the case `within` reports) would keep the process from ending."""
    out: list = [None] * len(items)
    errors: list[tuple[int, BaseException]] = []
    todo = iter(range(len(items)))
    lock = threading.Lock()

    def work():
        while not errors:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            try:
                out[i] = fn(items[i])
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append((i, e))

    workers = [threading.Thread(target=work, name="vramfit-read", daemon=True)
               for _ in range(min(threads, len(items)))]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    if errors:
        raise min(errors, key=lambda e: e[0])[1]
    return out
