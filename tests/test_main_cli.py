"""The entry points as a user runs them: `python -m coevolve_jax.main --config=... --workdir=...`
and the tools `python -m coevolve_jax.cli.NAME` and `python -m envs.bfcl.evaluate`."""

import contextlib
import logging
import os
import re
import socket
import subprocess
import sys
import time

import pytest
from disk_full import orbax_write_fails

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _main(*args: str, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
  """`python -m coevolve_jax.main ARGS` from the repository root, output captured."""
  return subprocess.run(
    [sys.executable, "-m", "coevolve_jax.main", *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def test_appworld_without_server_or_data_stops_at_once_with_setup_steps(tmp_path):
  env = dict(
    os.environ,
    APPWORLD_SERVER_URLS=f"http://127.0.0.1:{_free_port()}",
    APPWORLD_ROOT=str(tmp_path / "no-data"),
  )
  start = time.monotonic()
  proc = _main(
    "--config=configs/appworld.py",
    "--config.model.allow_random_init=True",  # the set-up check comes after the model's
    f"--workdir={tmp_path / 'run'}",
    timeout=60,
    env=env,
  )
  assert proc.returncode == 2, proc.stderr
  assert time.monotonic() - start < 20
  for step in (
    "pip install appworld",
    "appworld install",
    "appworld download data",
    "appworld serve environment",
  ):
    assert step in proc.stderr
  assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize(
  "args,says",
  [
    (
      ["--config.train.stepz=3"],
      "--config.train.stepz: unknown field 'stepz'. Did you mean \"steps\"",
    ),
    (["--config.train.steps=abc"], "--config.train.steps=abc: invalid literal for int()"),
    (
      ["--config=configs/bfcl.py:tpu-typo"],
      "unknown variant 'tpu-typo' (known: cpu, cpu_real, paper)",
    ),
    (["--config=configs/nope.py"], "No such file or directory: 'configs/nope.py'"),
    (["--config.explore.explorer=foo"], "explore.explorer must be one of"),
    (["--config.mesh.fsdp=3"], "mesh: mesh {'data': 1, 'fsdp': 3, 'tensor': 1, 'expert': 1} needs"),
    (["--nosuchflag"], "Unknown command line flag 'nosuchflag'"),
  ],
)
def test_every_command_line_mistake_is_one_error_line_and_exit_status_2(tmp_path, args, says):
  """A typo'd field printed absl's 57-line traceback, a missing config file 41 lines, a bad
  variant or mesh a traceback too (issue 42 item 2); each is now one line, status 2, and no
  work starts (the mesh is checked before the suite or the model)."""
  proc = _main("--config=configs/bfcl.py:cpu", *args, f"--workdir={tmp_path / 'run'}", timeout=120)
  assert proc.returncode == 2, proc.stderr[-2000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1 and says in errors[0], proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr
  assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_config_file_that_raises_is_one_error_line(tmp_path):
  """The config file's own code raising (here RuntimeError) gave a 30-line traceback and exit 1:
  one line naming the exception, exit 2, no workdir."""
  config = tmp_path / "raising.py"
  config.write_text('raise RuntimeError("boom from the config")\n')
  proc = _main(f"--config={config}", f"--workdir={tmp_path / 'run'}", timeout=60)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines() == [
    "error: --config: the config file raised RuntimeError: boom from the config"
  ]
  assert not (tmp_path / "run").exists()


def test_config_file_errors_name_where_they_come_from(tmp_path):
  """What `flag_errors.config_error` says of exceptions a config file or the loader raises: a
  syntax error with its file and line, a KeyError of the file's own code as that (not as an
  unknown field, which only an override names), a missing file by its path (not the loader's
  module name)."""
  from coevolve_jax.flag_errors import config_error  # noqa: PLC0415

  bad = tmp_path / "syntax.py"
  bad.write_text('def get_config(v=""):\n  return dict(a=(1\n')
  try:
    compile(bad.read_text(), str(bad), "exec")
  except SyntaxError as e:
    said = config_error(e, [])
  assert said == f"--config: syntax error in {bad}, line 2: '(' was never closed"
  assert config_error(KeyError("x"), ["--config=c.py"]) == (
    "--config: the config file raised KeyError: 'x'"
  )
  unknown = KeyError('\'stepz\'\nDid you mean "steps" instead of "stepz"?')
  assert config_error(AttributeError(unknown), ["--config.train.stepz=3"]) == (
    '--config.train.stepz: unknown field \'stepz\'. Did you mean "steps" instead of "stepz"?'
  )
  missing = OSError(
    "Configuration is not available because of an earlier failure to load: Failed loading "
    "config file config_config\n  Attempted [Relative path]:\n    /x/nope.py\n      [Errno 2] "
    "No such file or directory: '/x/nope.py'"
  )
  assert config_error(missing, []) == (
    "--config: [Errno 2] No such file or directory: '/x/nope.py'"
  )


def test_help_exits_0_and_lists_the_configs_and_their_variants():
  proc = _main("--help", timeout=60)
  assert proc.returncode == 0, proc.stderr
  for line in ("--config=configs/NAME.py[:VARIANT]", "--workdir=DIR"):
    assert line in proc.stdout
  assert (
    "configs/bfcl.py  CoEvolve on BFCL multi-turn  (variants :cpu, :cpu_real, :paper)"
    in proc.stdout
  )
  assert "configs/appworld.py  CoEvolve on AppWorld  (variants :cpu, :paper)" in proc.stdout


def test_a_full_scale_config_on_a_small_cpu_machine_stops_at_start_up_with_the_plan(tmp_path):
  """The full-scale BFCL config (Qwen3-4B, fp32 master, 64 x 32k cache) on host CPU devices
  with a fake 16 GiB machine: one error line with the planner's table and exit 2, before any
  parameter is allocated (before this check it was killed for memory minutes later)."""
  code = (
    "import os, sys; real = os.sysconf; "
    "os.sysconf = lambda n: 4096 if n == 'SC_PAGE_SIZE' else "
    "(16 * 2**30 // 4096 if n == 'SC_PHYS_PAGES' else real(n)); "
    "from coevolve_jax.main import run; sys.argv[0] = 'main'; run()"
  )
  proc = subprocess.run(
    [
      sys.executable,
      "-c",
      code,
      "--config=configs/bfcl.py",
      "--config.model.allow_random_init=True",
      f"--workdir={tmp_path}",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "error: the run does not fit its devices" in proc.stderr
  assert "16.0 GiB available" in proc.stderr and "| qwen3_4b | 1,1,1,1 |" in proc.stderr
  assert "Traceback" not in proc.stderr
  assert not os.path.exists(os.path.join(tmp_path, "checkpoints"))


def test_a_missing_checkpoint_folder_is_one_error_line(tmp_path):
  proc = _main(
    "--config=configs/bfcl.py:cpu",
    f"--config.model.checkpoint={tmp_path}/no-such-model",
    f"--workdir={tmp_path}/run",
    timeout=300,
  )
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "error: model.checkpoint=" in proc.stderr and "config.json not found" in proc.stderr
  assert "Traceback" not in proc.stderr


def test_unusable_workdir_fails_fast_with_a_clear_error(tmp_path):
  afile = tmp_path / "afile"
  afile.write_text("keep me")
  start = time.monotonic()
  proc = _main("--config=configs/bfcl.py:cpu", f"--workdir={afile}", timeout=60)
  assert proc.returncode == 2
  assert f"cannot use --workdir={afile}: it is a file, not a folder" in proc.stderr
  assert time.monotonic() - start < 20
  assert afile.read_text() == "keep me"


@pytest.mark.parametrize(
  "tool", ["coevolve_jax.cli.bench", "coevolve_jax.cli.plan_device_memory", "envs.bfcl.evaluate"]
)
def test_command_line_tools_run_as_modules(tool):
  """Each tool of coevolve_jax/cli/ (and envs/bfcl/evaluate.py) starts with `python -m MODULE`
  and its help shows the command it documents (absl exits with status 1 after printing help)."""
  proc = subprocess.run(
    [sys.executable, "-m", tool, "--helpshort"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert f"python -m {tool} " in proc.stdout


@pytest.mark.parametrize(
  "args,says",
  [
    (
      ["envs.bfcl.evaluate", "--config=configs/bfcl.py:cpu", "--max_tasks=-3"],
      "flag --max_tasks=-3: -3 is not a non-negative integer",
    ),
    (
      ["coevolve_jax.cli.plan_device_memory", "--activations=residuals", "--devices=8,0"],
      "--devices: '0' is not a device count (an integer >= 1)",
    ),
    (
      ["coevolve_jax.cli.bench", "--config=configs/bfcl.py:cpu", "--out={tmp}/afile/x.json"],
      "--out={tmp}/afile/x.json: cannot make its folder {tmp}/afile",
    ),
  ],
)
def test_the_tools_mistakes_are_one_error_line_and_exit_status_2(tmp_path, args, says):
  """The command-line tools' bad arguments (a negative count, a bad device count, an --out that
  cannot be written; every tool parses its flags through `flag_errors.run`, as the gate and the
  backtest do) are one `error:` line with status 2 before any work,
  where they printed absl's usage or a traceback with status 1, or (evaluate's --max_tasks=-3)
  evaluated all 200 entries, or (bench) measured for two minutes and then failed to write."""
  (tmp_path / "afile").write_text("keep me")
  module, *rest = args
  proc = subprocess.run(
    [sys.executable, "-m", module, *(a.format(tmp=tmp_path) for a in rest)],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr[-2000:]
  assert proc.stderr.startswith("error: ") and says.format(tmp=tmp_path) in proc.stderr
  assert (tmp_path / "afile").read_text() == "keep me"


def test_a_full_disk_stops_the_run_with_one_error_line_and_exit_status_2(tmp_path):
  """The run's first write, config.json, meets a real ENOSPC (its temporary file is /dev/full):
  one line naming the file and the free space, exit status 2, no traceback, no file left."""
  workdir = tmp_path / "run"
  workdir.mkdir()
  os.symlink("/dev/full", workdir / "config.json.tmp")
  proc = _main("--config=configs/bfcl.py:cpu", f"--workdir={workdir}", timeout=120)
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  last = proc.stderr.strip().splitlines()[-1]
  assert re.fullmatch(
    rf"error: no space left on device writing {re.escape(str(workdir))}/config\.json "
    r"\((\d+ B|[\d.]+ [KMGT]iB) free on /.*\)",
    last,
  ), last
  assert not os.path.lexists(workdir / "config.json")
  assert not os.path.lexists(workdir / "config.json.tmp")


def test_orbax_reports_of_a_full_disk_are_left_to_the_one_error_line(tmp_path, monkeypatch, caplog):
  """A background checkpoint write fails for a full disk: orbax logs that one failure four times
  over with tracebacks (and its threads go on reporting); main's filter keeps them off the console,
  where the run's DiskFullError is printed once."""
  import jax.numpy as jnp  # noqa: PLC0415 (keep the other tests of this file light)

  from coevolve_jax.checkpoint import RunCheckpointer  # noqa: PLC0415
  from coevolve_jax.errors import DiskFullError  # noqa: PLC0415
  from coevolve_jax.main import _AfterDiskFull  # noqa: PLC0415
  from coevolve_jax.trainer import TrainState  # noqa: PLC0415

  state = TrainState({"w": jnp.ones((3, 2))}, {"m": jnp.zeros((3, 2))}, {"w": jnp.ones((3, 2))})

  def failed_save(directory):
    ckpt = RunCheckpointer(str(directory), keep=2)
    with monkeypatch.context() as m:
      orbax_write_fails(m, "write_text", "meta.orbax-checkpoint-tmp/metadata")
      ckpt.save(1, state, {"step": 1})
      with pytest.raises(DiskFullError):
        ckpt.wait()
    with contextlib.suppress(DiskFullError):
      ckpt.close()

  absl_logger = logging.getLogger("absl")
  with caplog.at_level(logging.WARNING):
    failed_save(tmp_path / "unfiltered")
    assert [r for r in caplog.records if r.name == "absl" and r.exc_info]  # what it would print
    caplog.clear()
    keep = _AfterDiskFull()
    absl_logger.addFilter(keep)
    try:
      absl_logger.warning("before the disk filled up")
      failed_save(tmp_path / "filtered")
      time.sleep(0.5)  # orbax's threads report late too
    finally:
      absl_logger.removeFilter(keep)
  assert [r.getMessage() for r in caplog.records if r.name == "absl"] == [
    "before the disk filled up"
  ]
