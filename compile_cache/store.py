"""On-disk entry store: file layout, atomic writes, verification, per-key flock, listing.

This module owns the bytes on disk and nothing about kernels or policy. One entry with
key ``K`` (64 hex digits) is three files in the cache directory:

``K.bin``
    The opaque payload (for the CuTe DSL, ``compiled.dump_to_object(prefix)``).
``K.json``
    Metadata, written *after* the payload. It holds the payload's size and sha256, so a
    payload that is truncated, half-replaced or bit-rotted never reads as valid. An entry
    without ``K.json`` does not exist (a crash between the two writes leaves a harmless
    orphan payload that the next build overwrites).
``K.lock``
    An empty file that writers ``fcntl.flock`` so concurrent processes build once.

Every write goes to a temp file in the same directory (``.K.<suffix>.<pid>.<rand>.tmp``),
is fsynced and then ``os.replace``-d into place. Readers take no lock; a reader that sees
an inconsistent pair reports :class:`CorruptEntry` and the caller re-checks under the key
lock before deleting anything, so a reader never deletes an entry a writer is replacing.
Only files matching these patterns are ever listed or deleted, so a cache directory may
be shared with unrelated files. A writer killed between creating and renaming its temp
file leaves it behind; :meth:`DiskStore.sweep_temps` (run when a cache opens a writable
directory) removes such leftovers once they are stale (:func:`sweep_stale`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["CorruptEntry", "DiskStore", "StoredEntry", "probe_directory", "sweep_stale"]

_KEY_RE = re.compile(r"^[0-9a-f]{64}$")
_ENTRY_FILE_RE = re.compile(r"^([0-9a-f]{64})\.(bin|json|lock)$")
_TMP_FILE_RE = re.compile(r"^\.[0-9a-f]{64}\.(bin|json)\.(?P<pid>[0-9]+)\.[0-9a-f]+\.tmp$")

#: A temp file or directory whose writer process is gone is stale after this many seconds
#: (a payload write takes milliseconds; the grace covers a writer on another host sharing
#: the directory, whose pid means nothing here).
DEAD_WRITER_GRACE_SECONDS = 60.0
#: Any temp older than this is stale whatever its pid says (pids are reused).
STALE_TEMP_SECONDS = 3600.0

PAYLOAD_SUFFIX = ".bin"
META_SUFFIX = ".json"
LOCK_SUFFIX = ".lock"


class CorruptEntry(Exception):
    """An entry exists on disk but is not valid (reason in ``str(exc)``)."""


@dataclass(frozen=True)
class StoredEntry:
    """A verified entry: the payload file's path and the parsed metadata."""

    key: str
    payload_path: str
    meta: dict[str, Any]


def probe_directory(path: str, *, create: bool = True) -> tuple[str, str | None]:
    """Create ``path`` if needed (and ``create``) and find out what may be done there.

    Returns ``(mode, reason)`` with mode ``"rw"`` (read and write), ``"ro"`` (an existing
    directory we can read but not write), ``"absent"`` (no such path and ``create`` is
    False) or ``"none"`` (no usable directory); ``reason`` explains anything short of
    ``"rw"``. Writability is tested by really creating and removing a probe file, because
    ``os.access`` answers "yes" for root on a chmod-0o500 directory and "yes" on read-only
    mounts.
    """
    if not create and not os.path.lexists(path):
        return "absent", f"{path} does not exist"
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        if os.path.isdir(path):
            return _probe_existing(path)
        if os.path.exists(path):
            return "none", f"{path} exists and is not a directory"
        return "none", f"cannot create {path}: {exc.strerror or exc}"
    return _probe_existing(path)


def _probe_existing(path: str) -> tuple[str, str | None]:
    try:
        fd, probe = tempfile.mkstemp(prefix=".probe.", suffix=".tmp", dir=path)
    except OSError as exc:
        if os.access(path, os.R_OK | os.X_OK):
            return "ro", f"{path} is not writable ({exc.strerror or exc})"
        return "none", f"{path} is neither writable nor readable ({exc.strerror or exc})"
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return "rw", None


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, owned by someone else
        return True
    return True


def sweep_stale(directory: str, pattern: "re.Pattern[str]", *, now: float | None = None) -> list[str]:
    """Remove the stale temporaries in ``directory`` whose names match ``pattern``.

    An entry is stale when it is older than :data:`STALE_TEMP_SECONDS`, or when the
    pattern's ``pid`` group names a process that no longer exists on this host and it is
    older than :data:`DEAD_WRITER_GRACE_SECONDS` (so a live writer's temp, or one another
    host is writing right now, is never touched). Files are unlinked, directories removed
    with their contents. Returns the names removed; filesystem errors are ignored (a
    leftover that cannot be removed is retried by the next sweep).
    """
    now = time.time() if now is None else now
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = pattern.match(name)
        if not m:
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        age = now - st.st_mtime
        pid = m.groupdict().get("pid")
        dead = pid is not None and not _pid_alive(int(pid))
        if not (age > STALE_TEMP_SECONDS or (dead and age > DEAD_WRITER_GRACE_SECONDS)):
            continue
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except OSError:
            continue
        removed.append(name)
    return removed


def _sha256_file(path: str) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


class DiskStore:
    """Entries of one cache directory. Methods raise OSError on filesystem failures."""

    def __init__(self, root: str, *, format_version: int) -> None:
        self.root = root
        self.format_version = format_version

    # -- paths -----------------------------------------------------------------------
    def _path(self, key: str, suffix: str) -> str:
        if not _KEY_RE.match(key):
            raise ValueError(f"not a cache key: {key!r}")
        return os.path.join(self.root, key + suffix)

    def payload_path(self, key: str) -> str:
        """Path of ``key``'s payload file (may not exist)."""
        return self._path(key, PAYLOAD_SUFFIX)

    def meta_path(self, key: str) -> str:
        """Path of ``key``'s metadata file (may not exist)."""
        return self._path(key, META_SUFFIX)

    def lock_path(self, key: str) -> str:
        """Path of ``key``'s lock file."""
        return self._path(key, LOCK_SUFFIX)

    # -- read ------------------------------------------------------------------------
    def read_meta(self, key: str) -> dict[str, Any] | None:
        """Parsed metadata, None when absent; CorruptEntry when unreadable or malformed."""
        try:
            with open(self.meta_path(key), "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        try:
            meta = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptEntry(f"metadata is not valid JSON ({exc})") from None
        if not isinstance(meta, dict):
            raise CorruptEntry("metadata is not a JSON object")
        if meta.get("format") != self.format_version:
            raise CorruptEntry(f"metadata format {meta.get('format')!r} != {self.format_version}")
        if meta.get("key") != key:
            raise CorruptEntry(f"metadata names key {meta.get('key')!r}")
        payload = meta.get("payload")
        if (
            not isinstance(payload, dict)
            or not isinstance(payload.get("size"), int)
            or not isinstance(payload.get("sha256"), str)
        ):
            raise CorruptEntry("metadata lacks payload size/sha256")
        return meta

    def read(self, key: str, *, verify: bool = True) -> StoredEntry | None:
        """The verified entry for ``key``; None when there is none.

        Raises CorruptEntry when metadata exists but the entry is invalid: payload
        missing, size differs (truncated) or, with ``verify``, sha256 differs.
        """
        meta = self.read_meta(key)
        if meta is None:
            return None
        path = self.payload_path(key)
        want_size = meta["payload"]["size"]
        try:
            if verify:
                size, digest = _sha256_file(path)
            else:
                size, digest = os.stat(path).st_size, meta["payload"]["sha256"]
        except FileNotFoundError:
            raise CorruptEntry("payload file is missing") from None
        if size != want_size:
            raise CorruptEntry(f"payload is {size} bytes, metadata says {want_size} (truncated?)")
        if digest != meta["payload"]["sha256"]:
            raise CorruptEntry("payload sha256 does not match metadata (checksum mismatch)")
        return StoredEntry(key=key, payload_path=path, meta=meta)

    # -- write -----------------------------------------------------------------------
    def _write_atomic(self, dest: str, data: bytes) -> None:
        base = os.path.basename(dest)
        tmp = os.path.join(self.root, f".{base}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dest)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def write(self, key: str, payload: bytes, meta: dict[str, Any]) -> StoredEntry:
        """Store ``payload`` then ``meta`` (completed with format, key, size, sha256).

        The metadata is replaced last, so a reader sees either the old entry, no entry,
        or the new entry, and a stale metadata file never vouches for a new payload
        (its checksum would not match).
        """
        full = dict(meta)
        full["format"] = self.format_version
        full["key"] = key
        full["payload"] = {
            "file": os.path.basename(self.payload_path(key)),
            "size": len(payload),
            "sha256": hashlib.sha256(payload).hexdigest(),
        }
        text = json.dumps(full, sort_keys=True, indent=1, allow_nan=False)
        self._write_atomic(self.payload_path(key), payload)
        self._write_atomic(self.meta_path(key), text.encode("utf-8"))
        return StoredEntry(key=key, payload_path=self.payload_path(key), meta=full)

    def delete(self, key: str) -> None:
        """Remove ``key``'s metadata then payload (metadata first: no entry, then no bytes)."""
        for path in (self.meta_path(key), self.payload_path(key)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    # -- lock ------------------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self, key: str, *, timeout: float) -> Iterator[bool]:
        """Hold an exclusive flock on ``K.lock``; yields True when held.

        Yields False (proceed unlocked) when the lock file cannot be opened or the lock
        is not obtained within ``timeout`` seconds; atomic replaces keep that safe, it
        only risks a duplicate build. A crashed holder's lock is released by the kernel.
        """
        try:
            fd = os.open(self.lock_path(key), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            yield False
            return
        try:
            deadline = time.monotonic() + timeout
            delay = 0.005
            held = False
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held = True
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                        break  # e.g. ENOLCK on some network filesystems
                if time.monotonic() >= deadline:
                    break
                time.sleep(delay)
                delay = min(delay * 1.5, 0.1)
            try:
                yield held
            finally:
                if held:
                    fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    # -- listing / maintenance -------------------------------------------------------
    def _names(self) -> list[str]:
        try:
            return os.listdir(self.root)
        except FileNotFoundError:
            return []

    def keys(self) -> list[str]:
        """Keys that have a metadata file (valid or not), sorted."""
        return sorted(
            m.group(1) for n in self._names() if (m := _ENTRY_FILE_RE.match(n)) and m.group(2) == "json"
        )

    def usage(self) -> tuple[int, int]:
        """``(entries, bytes)``: metadata files and the total size of payload + metadata files."""
        entries = 0
        total = 0
        for n in self._names():
            m = _ENTRY_FILE_RE.match(n)
            if not m or m.group(2) == "lock":
                continue
            entries += m.group(2) == "json"
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(self.root, n)).st_size
        return entries, total

    def sweep_temps(self, *, now: float | None = None) -> list[str]:
        """Remove stale ``.K.<suffix>.<pid>.<rand>.tmp`` files of killed writers (see :func:`sweep_stale`)."""
        return sweep_stale(self.root, _TMP_FILE_RE, now=now)

    def clear(self) -> int:
        """Delete every entry, lock and leftover temp file; return the number of entries removed.

        Removing a lock file that another process holds at that moment cannot corrupt
        anything; at worst that key is built twice.
        """
        removed = 0
        names = self._names()
        # Metadata first so no reader sees a valid entry whose payload is gone.
        names.sort(key=lambda n: 0 if n.endswith(META_SUFFIX) else 1)
        for n in names:
            m = _ENTRY_FILE_RE.match(n)
            if not m and not _TMP_FILE_RE.match(n):
                continue
            try:
                os.unlink(os.path.join(self.root, n))
            except FileNotFoundError:
                continue
            if m and m.group(2) == "json":
                removed += 1
        return removed
