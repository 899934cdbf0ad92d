"""`GraphStore`: an opt-in directory of serialized graphs that outlives the process.

A restarted job loads a graph's bytes instead of building it. The store is frontend-agnostic: it
keeps opaque payloads (e.g. `graph.serialize(as_bytes=True)`) under a stable digest of the key,
and returns them only when the stored key text and environment match exactly and the payload
checksum verifies. Anything else is skipped with one `GraphStoreWarning` per bad file and
`load` returns None; the caller rebuilds and `save` overwrites the file.

The file format (its name, bytes and checks) is `fused_attn.graph_file`'s.

`env` names everything that invalidates a stored graph (cuDNN backend and frontend versions,
torch version, GPU architecture such as "sm90", the caller's own format version). It is checked,
not hashed into the file name: machines with different environments sharing one directory would
overwrite each other's files, so give each environment its own directory.

Writes go to a unique temporary file in the same directory, are fsynced and `os.replace`d into
place: concurrent writers of a key leave one complete file and readers never see a partial one.
Several processes may share a directory. A directory that cannot be created or written (read-only,
full) costs a warning, never an exception. Disk use is unbounded unless `max_bytes` is given; then
`save` evicts the least recently used files (by mtime; `load` touches a file it returns).
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import threading
import time
import warnings
from pathlib import Path
from typing import Hashable, List, Mapping, NamedTuple, Optional, Tuple, Union

# MAGIC, FORMAT_VERSION, _encode: the format's constants and encoder, still importable from here
from .graph_file import (_SUFFIX, _TMP_SUFFIX, FORMAT_VERSION, MAGIC, _check_env, _decode, _encode, _is_store_file,
                         _is_temp_file, key_digest, stable_repr)
from .memo import BoundedMemo

__all__ = ["GraphStore", "GraphStoreWarning", "StoreInfo", "stable_repr", "key_digest", "FORMAT_VERSION"]

_STALE_TMP_NS = 3600 * 10**9  # a temporary file older than this was abandoned


class GraphStoreWarning(UserWarning):
    """A stored graph was skipped, or the store could not write; the run goes on."""


class StoreInfo(NamedTuple):
    """Counters since creation (or `clear`). Every `load` adds one to exactly one of loads,
    load_misses (no file), skipped_corrupt (unreadable, truncated, bad magic or checksum) or
    skipped_mismatch (other key text, other env, newer format). save_failures: saves not
    written (directory not writable, disk full, payload above max_bytes)."""

    loads: int
    load_misses: int
    saves: int
    skipped_corrupt: int
    skipped_mismatch: int
    save_failures: int
    evictions: int



# the store --------------------------------------------------------------------------------

class GraphStore:
    """A directory of serialized graphs keyed by `key_digest(key)`; safe across threads and processes.

    directory: created if missing (a failure warns; the store then misses and skips saves).
    max_bytes: bound on the total size of stored files, or None (default): no bound, the
        directory grows by one file per distinct key (graphs are typically KB to a few MB).
        Enforced by each `save` after it writes; processes writing at once may each overshoot
        by about one file until their next save.
    Keys must have a `stable_repr` (TypeError otherwise, from load and save alike): drop
    process-local fields first (e.g. a device index, if graphs are shared between ranks).
    """

    def __init__(self, directory: Union[str, "os.PathLike[str]"], max_bytes: Optional[int] = None) -> None:
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"GraphStore: directory must be a str or os.PathLike, got {type(directory).__name__}")
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
            raise ValueError(f"GraphStore: max_bytes must be None or an int >= 1, got {max_bytes!r}")
        self._dir = Path(directory)
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(StoreInfo._fields, 0)
        self._save_warned: set = set()
        self._skip_warned: BoundedMemo[str, Tuple[str, int, int]] = BoundedMemo(4096, "graph_store.skip_warned")
        try:
            self._dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            warnings.warn(f"GraphStore: cannot create {str(self._dir)!r} ({exc.strerror or exc}); graphs will "
                          "be built, not loaded or saved", GraphStoreWarning, stacklevel=2)

    @property
    def directory(self) -> Path:
        return self._dir

    @property
    def max_bytes(self) -> Optional[int]:
        return self._max_bytes

    def path_for(self, key: Hashable) -> Path:
        """The file that holds (or would hold) `key`."""
        return self._dir / (key_digest(key) + _SUFFIX)

    def load(self, key: Hashable, env: Mapping[str, str]) -> Optional[bytes]:
        """The payload saved for `key` under exactly `env`, or None (no file, or a bad one: warned)."""
        key_text = stable_repr(key)
        env = _check_env(env)
        path = self._dir / (hashlib.sha256(key_text.encode("utf-8")).hexdigest() + _SUFFIX)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                blob = f.read()
        except (FileNotFoundError, NotADirectoryError):
            self._count("load_misses")
            return None
        except OSError as exc:
            self._skip(path, "corrupt", f"unreadable ({exc.strerror or exc})", None)
            return None
        payload, kind, why = _decode(blob, key_text, env)
        if payload is None:
            self._skip(path, kind, why, st)
            return None
        try:
            os.utime(path)  # most recently used, for max_bytes eviction
        except OSError:
            pass  # read-only directory or replaced meanwhile: the order is only a hint
        self._count("loads")
        return payload

    def save(self, key: Hashable, env: Mapping[str, str], payload: bytes) -> None:
        """Store `payload` for `key` and `env` atomically, replacing any file for the key.

        Never raises for the file system: a failure warns once per kind (errno) and the run goes on.
        """
        key_text = stable_repr(key)
        env = _check_env(env)
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise TypeError(f"GraphStore.save: payload must be bytes, got {type(payload).__name__} "
                            "(the cuDNN frontend gives bytes with graph.serialize(as_bytes=True))")
        blob = _encode(key_text, env, bytes(payload))
        if self._max_bytes is not None and len(blob) > self._max_bytes:
            self._save_failed("too large", f"a {len(blob)}-byte graph file exceeds max_bytes={self._max_bytes}; "
                                           "it is not stored")
            return
        digest = hashlib.sha256(key_text.encode("utf-8")).hexdigest()
        path = self._dir / (digest + _SUFFIX)
        tmp = self._dir / f".{digest}.{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(4)}{_TMP_SUFFIX}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
            try:
                with open(fd, "wb", closefd=False) as f:
                    f.write(blob)
                    f.flush()
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            name = errno.errorcode.get(exc.errno, type(exc).__name__) if exc.errno else type(exc).__name__
            self._save_failed(name, f"cannot write {str(path)!r} ({exc.strerror or exc})")
            return
        self._fsync_dir()
        self._count("saves")
        if self._max_bytes is not None:
            self._evict(keep=path.name)

    def stats(self) -> StoreInfo:
        with self._lock:
            return StoreInfo(**self._counts)

    def clear(self, reset_stats: bool = True) -> None:
        """Delete every stored graph and stray temporary file of this store's naming in the
        directory (other files are left alone); by default reset the counters. A save running
        meanwhile in another process may then fail with a warning."""
        for entry in self._scan():
            if _is_store_file(entry.name) or _is_temp_file(entry.name):
                _unlink(entry.path)
        self._skip_warned.clear()
        if reset_stats:
            with self._lock:
                self._counts = dict.fromkeys(StoreInfo._fields, 0)

    def __repr__(self) -> str:
        return f"GraphStore({str(self._dir)!r}, max_bytes={self._max_bytes})"

    # internals ----------------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def _skip(self, path: Path, kind: str, why: str, st: Optional[os.stat_result]) -> None:
        """Count a skipped file; warn unless this very file version was already warned about."""
        self._count("skipped_corrupt" if kind == "corrupt" else "skipped_mismatch")
        signature = (why, st.st_size, st.st_mtime_ns) if st is not None else (why, -1, -1)
        if self._skip_warned.get(path.name) == signature:
            return
        self._skip_warned.put(path.name, signature)
        warnings.warn(f"GraphStore: skipped {str(path)!r}: {why}; the graph will be rebuilt and the file "
                      "replaced", GraphStoreWarning, stacklevel=3)

    def _save_failed(self, kind: str, message: str) -> None:
        with self._lock:
            self._counts["save_failures"] += 1
            first = kind not in self._save_warned
            self._save_warned.add(kind)
        if first:
            warnings.warn(f"GraphStore: {message}; graphs are still built and used, later failures of this "
                          "kind are not reported", GraphStoreWarning, stacklevel=3)

    def _fsync_dir(self) -> None:
        """Make the rename durable (best effort; not possible on every platform)."""
        try:
            fd = os.open(self._dir, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)

    def _scan(self) -> List[os.DirEntry]:
        try:
            with os.scandir(self._dir) as it:
                return list(it)
        except OSError:
            return []

    def _evict(self, keep: str) -> None:
        """Delete least recently used graph files until the total is within max_bytes, and
        temporary files older than an hour (left by a process killed while writing)."""
        files = []
        stale = time.time_ns() - _STALE_TMP_NS
        for entry in self._scan():
            is_graph = _is_store_file(entry.name)
            if not is_graph and not _is_temp_file(entry.name):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # removed meanwhile
            if is_graph:
                files.append((st.st_mtime_ns, entry.name, st.st_size, entry.path))
            elif st.st_mtime_ns < stale:
                _unlink(entry.path)
        total = sum(f[2] for f in files)
        evicted = 0
        for _, name, size, file_path in sorted(files):
            if total <= self._max_bytes:  # type: ignore[operator]
                break
            if name == keep:
                continue
            if _unlink(file_path):
                evicted += 1
            total -= size  # gone either way (another process may have evicted it)
        if evicted:
            self._count("evictions", evicted)


def _unlink(path: Union[str, Path]) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False
