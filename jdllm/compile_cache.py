"""JAX's persistent compilation cache, on by default for jdllm.

A first `generate` spends most of its time compiling (minutes for a large model on a GPU);
with the cache a second process loads the compiled programs from disk instead. `enable()`
turns it on; `jdllm.load`, `prepare` / `generate`, the serving engine and the command line
call it before they compile, so a user does nothing. Once per process, idempotent, cheap
(a stat, a probe file and a 4-byte read per cache entry, the first time only).

Where the cache lives:
- `$JDLLM_CACHE_DIR` when set; `JDLLM_CACHE_DIR=off` turns the cache off;
- else `$XDG_CACHE_HOME/jdllm/xla`, else `~/.cache/jdllm/xla`;
- a cache the user configured for JAX itself (`JAX_COMPILATION_CACHE_DIR` or
  `jax.config.update("jax_compilation_cache_dir", ...)` before jdllm's first call) wins:
  jdllm then changes none of JAX's settings.

JAX's cache is process-wide: once on, the user's own jitted functions are cached there too.

Bad input: a directory that cannot be created or written, or one holding entries that are
not compiled programs, gives one warning (unreadable entries are removed and compiled again;
if they cannot be removed, or the directory cannot be written, the run goes on without the
cache); `JDLLM_CACHE_DIR` naming an existing file raises `errors.CacheDirError`. The entry
check reads 4 bytes (the compression header), so an entry cut short mid-write passes it: JAX
itself then warns when it reads that entry and compiles the program again (never a failure);
deleting the directory clears it.

The thresholds (measured on models/tiny-sdar and tiny-ar, benchmarks/RESULTS.md "Persistent
compilation cache"): every program that took at least `MIN_COMPILE_TIME_SECS` to compile is
written; JAX's own settings for anything else (entry size, the XLA GPU autotune cache kept
beside it) are left at their defaults. An environment variable JAX reads
(`JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`) overrides jdllm's choice.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import threading

from jdllm import errors

ENV = "JDLLM_CACHE_DIR"
OFF = "off"
MIN_COMPILE_TIME_SECS = 0.0  # see the module docstring and benchmarks/RESULTS.md
ENTRY_SUFFIX = "-cache"  # how JAX names its cache entries (jax._src.lru_cache)
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_ZLIB_HEADERS = {b"\x78\x01", b"\x78\x5e", b"\x78\x9c", b"\x78\xda"}


@dataclasses.dataclass(frozen=True)
class Status:
    """What `enable()` did. path: the directory compiles are cached in (None: no cache);
    source: "jdllm" (jdllm set it), "jax" (the user's own JAX setting, left alone), "off"
    (JDLLM_CACHE_DIR=off) or "unusable" (a warning said why)."""

    path: str | None
    source: str


_lock = threading.Lock()
_status: Status | None = None


def default_dir(environ=None) -> str:
    """`$XDG_CACHE_HOME/jdllm/xla`, else `~/.cache/jdllm/xla`."""
    base = (os.environ if environ is None else environ).get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):  # the XDG spec: a relative value is ignored
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jdllm", "xla")


def enable() -> Status:
    """Turn JAX's persistent compilation cache on for this process (see the module docstring).
    The first call decides; later calls return the same `Status` at once."""
    global _status
    if _status is None:
        with _lock:
            if _status is None:
                _status = _enable()
    return _status


def status() -> Status | None:
    """What the first `enable()` decided, or None before it ran."""
    return _status


def _enable() -> Status:
    import jax  # noqa: PLC0415

    st = resolve(os.environ, getattr(jax.config, "jax_compilation_cache_dir", None))
    if st.source == "jdllm":
        _update(jax, "jax_compilation_cache_dir", st.path)
        if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
            _update(jax, "jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_SECS)
    return st


def resolve(environ, jax_dir: str | None = None) -> Status:
    """Where the cache goes given the environment `environ` and JAX's current cache directory
    `jax_dir`; prepares the directory (creates it, checks it can be written, removes unreadable
    entries) and warns or raises as the module docstring says, but changes no JAX setting."""
    theirs = environ.get("JAX_COMPILATION_CACHE_DIR") or jax_dir
    if theirs:
        return Status(str(theirs), "jax")
    raw = environ.get(ENV, "").strip()
    if raw.lower() == OFF:
        return Status(None, "off")
    path = os.path.abspath(os.path.expanduser(raw)) if raw else default_dir(environ)
    if os.path.exists(path) and not os.path.isdir(path):
        if raw:
            raise errors.CacheDirError(
                f"{ENV}={raw} is a file, not a directory: point {ENV} at a directory for jdllm's compilation "
                f"cache (it is created if missing), or set {ENV}={OFF} to run without the cache")
        return _unusable(path, "is a file, not a directory")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):  # the directory exists and we may write to it
            pass
    except OSError as e:
        return _unusable(path, f"cannot be written ({e.strerror or e})")
    bad = unreadable_entries(path)
    if bad:
        try:
            for name in bad:
                os.remove(os.path.join(path, name))
        except OSError as e:
            return _unusable(path, f"holds {len(bad)} unreadable entries (e.g. {bad[0]}) that cannot be removed "
                                   f"({e.strerror or e})")
        errors.warn(f"the compilation cache {path} held {len(bad)} unreadable entries (e.g. {bad[0]}): removed "
                    "them; those programs compile again", RuntimeWarning)
    return Status(path, "jdllm")


def unreadable_entries(path: str) -> list[str]:
    """Names of the cache entries in `path` that are not compressed programs (JAX writes each
    entry zstd- or zlib-compressed): garbage JAX would warn about and never replace."""
    bad = []
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return bad
    for name in names:
        if not name.endswith(ENTRY_SUFFIX):
            continue
        try:
            with open(os.path.join(path, name), "rb") as f:
                head = f.read(4)
        except IsADirectoryError:
            continue
        except OSError:
            head = b""
        if head != _ZSTD_MAGIC and head[:2] not in _ZLIB_HEADERS:
            bad.append(name)
    return bad


def _unusable(path: str, why: str) -> Status:
    errors.warn(f"the compilation cache directory {path} {why}: running without the cache (every first call "
                f"compiles); set {ENV} to a writable directory, or {ENV}={OFF}", RuntimeWarning)
    return Status(None, "unusable")


def _update(jax, name: str, value) -> None:
    """jax.config.update, skipping an option this JAX version does not have."""
    try:
        jax.config.update(name, value)
    except AttributeError:
        pass


__all__ = ["enable", "status", "resolve", "default_dir", "unreadable_entries", "Status", "ENV", "MIN_COMPILE_TIME_SECS"]
