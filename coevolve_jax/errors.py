"""The run's errors that `main` reports as one line (`error: ...`, exit status 2), and the
translation of a write that failed for a full disk into one of them."""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Iterable

_DISK_FULL = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}
# TensorStore (orbax's array writer) reports the OS error inside its message.
_TENSORSTORE_OS_ERROR = re.compile(r"\[os_error_code='?(\d+)'?\]")


def move_aside(path: str, suffixes: Iterable[str]) -> str:
  """Renames the damaged file or folder `path` to `path + suffix` for the first suffix of
  `suffixes` that names nothing yet, so earlier damaged copies are kept for inspection.

  Returns the new path. Raises OSError where the rename fails, FileExistsError (one) when every
  suffix is taken (pass an endless iterator, e.g. one made from `itertools.count`, to never run
  out).
  """
  for suffix in suffixes:
    aside = path + suffix
    if not os.path.exists(aside):
      os.replace(path, aside)
      return aside
  raise FileExistsError(f"no free name to move {path} aside")


class RunError(Exception):
  """A run that cannot start, resume or go on as configured (the message says why)."""


class CorruptFileError(RunError, ValueError):
  """A file of the run's workdir is damaged in a way the run cannot repair by itself (the message
  names the file and what to do). Also a ValueError, for callers that catch bad data as such."""


class DiskFullError(RunError):
  """A write failed because its filesystem is full (ENOSPC) or over quota (EDQUOT).

  The message names the path and the space left, e.g. `no space left on device writing
  /runs/x/metrics.jsonl (0 B free on /runs)`, or `(2.1 GiB but no inodes free on /runs)` when the
  filesystem ran out of inodes. Attributes: path, code (the errno), free (bytes), free_inodes
  (None where the filesystem has no inode count; both None when it cannot be asked), mount.
  """

  def __init__(self, path: str, code: int = errno.ENOSPC):
    self.path, self.code = os.fspath(path), code
    self.free, self.free_inodes, self.mount = _free_space(self.path)
    if self.free is None:
      free = "unknown space free"
    elif self.free_inodes == 0:
      free = f"{_size(self.free)} but no inodes free"
    else:
      free = f"{_size(self.free)} free"
    reason = _DISK_FULL.get(code, os.strerror(code))
    super().__init__(f"{reason} writing {self.path} ({free} on {self.mount})")


def disk_full_errno(error: BaseException | None) -> int | None:
  """ENOSPC or EDQUOT when `error`, or an exception it was raised from or during, is a write that
  failed for a full disk: an OSError with that errno, or TensorStore's error text for it. Else
  None."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, DiskFullError):
      return error.code
    if isinstance(error, OSError) and error.errno in _DISK_FULL:
      return error.errno
    match = _TENSORSTORE_OS_ERROR.search(str(error))
    if match and int(match.group(1)) in _DISK_FULL:
      return int(match.group(1))
    error = error.__cause__ or error.__context__
  return None


@contextlib.contextmanager
def writing(path: str):
  """Within: an exception that is a write failing for a full disk (see `disk_full_errno`) becomes
  DiskFullError naming `path`; any other passes unchanged.

  Raises:
    DiskFullError: from the exception that the write raised.
  """
  try:
    yield
  except DiskFullError:
    raise
  except Exception as e:
    code = disk_full_errno(e)
    if code is None:
      raise
    raise DiskFullError(path, code) from e


def describe(error: BaseException) -> str:
  """`Type: first line of the message` (the line cut at 300 characters), for one-line reports."""
  text = str(error).strip()
  return f"{type(error).__name__}: {text.splitlines()[0][:300]}" if text else repr(error)


def _free_space(path: str) -> tuple[int | None, int | None, str]:
  """(free bytes, free inodes or None, mount point) of the filesystem holding `path` (or its
  nearest existing parent); (None, None, mount) when it cannot be asked."""
  existing = os.path.abspath(path)
  while not os.path.exists(existing) and os.path.dirname(existing) != existing:
    existing = os.path.dirname(existing)
  mount = existing
  while not os.path.ismount(mount):
    mount = os.path.dirname(mount)
  try:
    st = os.statvfs(existing)
  except OSError:
    return None, None, mount
  return st.f_bavail * st.f_frsize, (st.f_favail if st.f_files else None), mount


def _size(n: float) -> str:
  if n < 1024:
    return f"{int(n)} B"
  for unit in ("KiB", "MiB", "GiB"):
    n /= 1024
    if n < 1024:
      return f"{n:.1f} {unit}"
  return f"{n / 1024:.1f} TiB"
