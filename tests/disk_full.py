"""Test helpers for writes on a full disk: a short write then ENOSPC, an orbax write failing with
ENOSPC, and the check of the one-line DiskFullError message."""

import errno
import os
import re

from etils import epath

from coevolve_jax.errors import DiskFullError, RunError


def short_write_then_disk_full(monkeypatch, nbytes=7):
  """os.write writes `nbytes` bytes of its first call, then fails as on a full disk (ENOSPC)."""
  real = os.write
  calls = []

  def write(fd, data):
    calls.append(fd)
    if len(calls) == 1:
      return real(fd, bytes(data[:nbytes]))
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  monkeypatch.setattr(os, "write", write)


def assert_disk_full(error, path):
  """`error` is the DiskFullError of a write to `path`, its message naming the free space."""
  assert isinstance(error, DiskFullError) and isinstance(error, RunError)
  assert str(error).startswith(f"no space left on device writing {path} (")
  assert re.search(r"\((\d+ B|[\d.]+ [KMGT]iB) free on /[^)]*\)$", str(error)), str(error)


def orbax_write_fails(monkeypatch, method, name_end, within=""):
  """Makes orbax's `method` ("mkdir", "write_text") of local paths ending in `name_end` fail as on
  a full disk (ENOSPC); with `within` (a regular expression), only the paths it matches (e.g.
  r"/checkpoints/2[./]": step 2's checkpoint, the earlier ones written)."""
  cls = type(epath.Path("/"))
  original = getattr(cls, method)

  def failing(self, *args, **kwargs):
    if str(self).endswith(name_end) and re.search(within, str(self)):
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
    return original(self, *args, **kwargs)

  monkeypatch.setattr(cls, method, failing)
