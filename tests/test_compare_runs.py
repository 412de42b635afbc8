"""scripts/compare_runs.py: timings and compile counts are ignored, every other difference is
reported."""

import importlib.util
import json
import os

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "compare_runs.py")
_spec = importlib.util.spec_from_file_location("compare_runs", _PATH)
compare_runs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare_runs)


def _run(path, reward, wall_s, step_time):
  os.makedirs(path)
  with open(os.path.join(path, "summary.json"), "w") as f:
    json.dump({"eval_after": 0.5, "wall_s": wall_s, "phase_s": {"train": wall_s}}, f)
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    row = {
      "step": 1,
      "reward/mean": reward,
      "timing/train": step_time,
      "feedback/wait_s": wall_s,
      "compile/count": int(step_time),  # what compiled: also a cost, not a result
      "compile/seconds": 2.0 * step_time,
      "engine/prefill_seconds": 3.0 * step_time,  # the engine's wall time: a timing
      "engine/decode_seconds": 4.0 * step_time,
      "engine/prefill_tokens": 100,  # its work: a result, compared
    }
    f.write(json.dumps(row) + "\n")


def test_timings_differ_only(tmp_path, capsys):
  _run(tmp_path / "a", 0.25, 10.0, 1.0)
  _run(tmp_path / "b", 0.25, 99.0, 7.0)
  assert compare_runs.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0
  assert "same (timings aside)" in capsys.readouterr().out


def test_a_reward_difference_is_reported_unless_within_tolerance(tmp_path, capsys):
  _run(tmp_path / "a", 0.25, 10.0, 1.0)
  _run(tmp_path / "b", 0.25 + 1e-7, 10.0, 1.0)
  assert compare_runs.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 1
  assert "metrics.jsonl[0].reward/mean" in capsys.readouterr().out
  assert compare_runs.main([str(tmp_path / "a"), str(tmp_path / "b"), "--atol", "1e-6"]) == 0


def test_a_file_on_one_side_only_fails(tmp_path):
  _run(tmp_path / "a", 0.25, 10.0, 1.0)
  _run(tmp_path / "b", 0.25, 10.0, 1.0)
  (tmp_path / "b" / "pool.jsonl").write_text('{"task_id": "d0-00000"}\n')
  assert compare_runs.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 1


def test_ignored_prefixes_leave_out_added_keys_only(tmp_path):
  _run(tmp_path / "a", 0.25, 10.0, 1.0)
  _run(tmp_path / "b", 0.25, 10.0, 1.0)
  path = tmp_path / "b" / "metrics.jsonl"
  row = json.loads(path.read_text())
  path.write_text(
    json.dumps({**row, "diag/dead_groups": 1.0, "alerts": ["dead_groups >= 1"]}) + "\n"
  )
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  assert compare_runs.main([a, b]) == 1
  assert compare_runs.main([a, b, "--ignore", "diag/", "--ignore", "alert"]) == 0
  assert compare_runs.main([a, b, "--ignore", "diag/"]) == 1  # "alerts" still differs
