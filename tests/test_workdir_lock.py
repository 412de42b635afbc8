"""One run per workdir (issue 42 item 5): a second run on a workdir in use stops with one line
naming the other process; the lock of a killed run is taken over; only the primary locks. And
a damaged config.json on resume."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from coevolve_jax.errors import RunError
from coevolve_jax.workdir import WorkdirLock, check_config

_HOLD = (
  "import sys, time; from coevolve_jax.workdir import WorkdirLock; "
  "lock = WorkdirLock(sys.argv[1]); lock.acquire(); print('held', flush=True); time.sleep(600)"
)


def _holder(workdir) -> subprocess.Popen:
  """A process that takes the workdir's lock and keeps it until killed."""
  proc = subprocess.Popen(
    [sys.executable, "-c", _HOLD, str(workdir)], stdout=subprocess.PIPE, text=True
  )
  assert proc.stdout.readline().strip() == "held"
  return proc


def test_a_second_run_on_a_workdir_in_use_is_one_error_naming_the_other(tmp_path):
  holder = _holder(tmp_path)
  try:
    with pytest.raises(RunError) as e:
      WorkdirLock(str(tmp_path)).acquire()
    assert f"{tmp_path} is in use by another run (pid {holder.pid} on " in str(e.value)
    assert "use another --workdir" in str(e.value)
    # The same through the job itself: it stops before building anything.
    from coevolve_jax.loop import CoEvolveRun  # noqa: PLC0415
    from test_main_e2e import small_config  # noqa: PLC0415

    start = time.monotonic()
    with pytest.raises(RunError, match=f"pid {holder.pid}"):
      CoEvolveRun(small_config(), str(tmp_path)).fit()
    assert time.monotonic() - start < 10
    assert sorted(os.listdir(tmp_path)) == ["run.lock", "run.lock.owner"]
  finally:
    holder.kill()
    holder.wait()


def test_the_lock_of_a_killed_run_is_taken_over_and_renamed(tmp_path):
  holder = _holder(tmp_path)
  os.kill(holder.pid, signal.SIGKILL)  # no clean-up: its owner file stays behind
  holder.wait()
  with open(tmp_path / "run.lock.owner") as f:
    assert json.load(f)["pid"] == holder.pid
  lock = WorkdirLock(str(tmp_path))
  lock.acquire()
  with open(tmp_path / "run.lock.owner") as f:
    owner = json.load(f)
  assert owner["pid"] == os.getpid() and owner["argv"] == sys.argv
  with pytest.raises(RunError, match=f"pid {os.getpid()}"):  # one process, two runs: refused
    WorkdirLock(str(tmp_path)).acquire()
  lock.release()
  again = WorkdirLock(str(tmp_path))  # released at the end of a session: the next one runs
  again.acquire()
  again.release()


@pytest.mark.parametrize("damage", [b"garbage\n", b'["a list"]', b"\xff\xfe"])
def test_a_damaged_config_json_is_moved_aside_and_the_resume_goes_on(tmp_path, capsys, damage):
  """config.json only lists what changed since the run started (the checkpoints carry their own
  config): damaged, it is kept as config.json.damaged with one warning, and this run's config
  takes its place; an intact one lists the changed fields."""
  path = tmp_path / "config.json"
  check_config(str(tmp_path), json.dumps({"train": {"steps": 2}}), fresh=True)
  check_config(str(tmp_path), json.dumps({"train": {"steps": 6}}), fresh=False)
  assert "config train.steps changed since this run started: 2 -> 6" in capsys.readouterr().out
  path.write_bytes(damage)
  check_config(str(tmp_path), json.dumps({"train": {"steps": 6}}), fresh=False)
  out = capsys.readouterr().out
  assert out.startswith(f"warning: {path} is damaged (") and "config.json.damaged" in out
  assert (tmp_path / "config.json.damaged").read_bytes() == damage
  assert json.loads(path.read_text()) == {"train": {"steps": 6}}
  # Damaged again: the first damaged copy is kept, the second goes beside it.
  path.write_bytes(b"{torn")
  check_config(str(tmp_path), json.dumps({"train": {"steps": 6}}), fresh=False)
  assert "moved to config.json.damaged.1 " in capsys.readouterr().out
  assert (tmp_path / "config.json.damaged").read_bytes() == damage
  assert (tmp_path / "config.json.damaged.1").read_bytes() == b"{torn"


def test_only_the_primary_reads_moves_or_warns_about_config_json(tmp_path, capsys, monkeypatch):
  """Another process of a multi-process run leaves config.json alone: no warning of its own,
  and no read of a file the primary may be moving aside at that moment."""
  from coevolve_jax import distributed  # noqa: PLC0415

  path = tmp_path / "config.json"
  check_config(str(tmp_path), json.dumps({"train": {"steps": 2}}), fresh=True)
  monkeypatch.setattr(distributed, "is_primary", lambda: False)
  check_config(str(tmp_path), json.dumps({"train": {"steps": 6}}), fresh=False)
  path.write_bytes(b"garbage")
  check_config(str(tmp_path), json.dumps({"train": {"steps": 6}}), fresh=False)
  assert capsys.readouterr().out == ""
  assert sorted(os.listdir(tmp_path)) == ["config.json"] and path.read_bytes() == b"garbage"
