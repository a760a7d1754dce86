"""Outputs that appear whole or not at all.

Every command that writes a folder (``flowrl export``, ``flowrl train-reward``) writes it under a temporary
name beside the destination and renames it into place when it is complete; a full disk, a crash or Ctrl-C
leaves the destination as it was (absent, empty, or the previous output) and nothing half-written under its
name, so the same command can simply be run again. Files are written the same way
(:func:`flowrl.config.atomic_write_text`, ``flowrl score``'s writer), and shards by
:mod:`flowrl.data.webdataset_io`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

__all__ = ["staged_directory", "is_inside", "WRITE_ERRORS"]


def _write_errors() -> tuple[type[BaseException], ...]:
    """What a failed write raises: OSError (disk full, permissions), and safetensors' own error type, which
    reports an I/O failure of the Rust writer without subclassing OSError."""
    try:
        from safetensors import SafetensorError
    except ImportError:  # pragma: no cover - a declared dependency
        return (OSError,)
    return (OSError, SafetensorError)


WRITE_ERRORS = _write_errors()


@contextmanager
def staged_directory(out: str | os.PathLike, *, replace: bool = False) -> Iterator[Path]:
    """Yield a new, empty folder beside ``out``; when the block completes it becomes ``out``.

    Args:
        out: the destination. It must not exist or be an empty folder, unless ``replace`` (then an existing
            ``out`` is moved aside, the new folder renamed into place, and the old one removed).

    On any exception the staged folder is removed and ``out`` is left untouched; the exception propagates.
    """
    out = Path(os.path.abspath(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(stage, 0o777 & ~umask)  # the permissions of a plain mkdir (mkdtemp makes it private)
    try:
        yield stage
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        if out.exists():
            if not replace:
                raise FileExistsError(f"{out} appeared while it was being written")
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(stage, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def is_inside(path: str | os.PathLike, folder: str | os.PathLike) -> bool:
    """``path`` is ``folder`` or lies under it (both resolved; either may not exist yet)."""
    path, folder = Path(path).resolve(), Path(folder).resolve()
    return path == folder or folder in path.parents
