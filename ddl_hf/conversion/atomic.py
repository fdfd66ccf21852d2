"""All-or-nothing output directories: a job writes into a temporary directory that becomes `output` only on success.

`atomic_directory` is the one place that knows how: it checks the output path, makes the temporary directory
beside it (same filesystem, so the final rename is atomic), turns SIGTERM into KeyboardInterrupt while it is open,
renames the finished directory into place (an existing output is replaced only then, and restored if that rename
fails), and on any exception removes the temporary directory and every parent directory it created.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

from transformers.utils import logging as hf_logging

from .errors import ConversionError

logger = hf_logging.get_logger(__name__)


@contextlib.contextmanager
def atomic_directory(output: str | os.PathLike, *, force: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory to write into; on a clean exit it is renamed to `output`.

    Refuses (ConversionError, nothing created) when `output` is a file, or a non-empty directory and `force` is
    False. With `force=True` an existing `output` is replaced only once the new one is complete. On any exception,
    including KeyboardInterrupt, a full disk or SIGTERM (`kill PID`, raised as KeyboardInterrupt while the context
    is open on the main thread), nothing is left behind and `output` is as it was. Only SIGKILL can leave a
    temporary directory, hidden as `.OUT.tmp-*` beside OUT, never a partial OUT.
    """
    output = Path(os.path.abspath(output))  # no `..`: the final renames move directories that it would name
    _check_output(output, force)
    created_parents = [p for p in reversed(output.parents) if not p.exists()]
    tmp: Path | None = None
    with _sigterm_as_interrupt():
        try:
            output.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
            tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it private; the output should get the usual permissions
            yield tmp
            _commit_directory(tmp, output)
            tmp = None
        except BaseException:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            for parent in reversed(created_parents):
                with contextlib.suppress(OSError):
                    parent.rmdir()
            raise


def _check_output(output: Path, force: bool) -> None:
    if output.exists() and not output.is_dir():
        raise ConversionError(f"--output {output} exists and is a file; choose a directory path.")
    if output.is_dir() and any(output.iterdir()) and not force:
        raise ConversionError(
            f"--output {output} already exists and is not empty; nothing was written. "
            "Choose another directory, or pass --force (force=True) to replace it."
        )


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _commit_directory(tmp: Path, output: Path) -> None:
    """Move the finished `tmp` into place as `output`; an existing `output` is replaced only once tmp is complete."""
    if output.exists() and any(output.iterdir()):
        logger.info(f"Replacing the existing {output}.")
        backup = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.parent))
        backup.rmdir()
        os.replace(output, backup)
        try:
            os.replace(tmp, output)
        except BaseException:
            os.replace(backup, output)
            raise
        shutil.rmtree(backup, ignore_errors=True)
    else:
        if output.exists():
            output.rmdir()  # empty directory: same as absent
        os.replace(tmp, output)


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """`kill PID` cleans up like Ctrl-C. Off the main thread signals cannot be handled, so they are left alone."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


__all__ = ["atomic_directory"]
