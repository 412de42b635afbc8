"""scripts/ablations.py: each variant flips exactly its switch; the table and plots are built from
run outputs (hand-written workdirs here; the grid itself is too long for a test)."""

import importlib.util
import json
import os

import pytest

_SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "ablations.py")


@pytest.fixture(scope="module")
def ablations():
  spec = importlib.util.spec_from_file_location("ablations", _SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_each_variant_changes_only_its_switch(ablations):
  base = json.loads(ablations.load_config("coevolve", 0, {}).to_json_best_effort())
  expected = {
    "no_forgetting": ("feedback", "kinds", ["boundary", "rare"]),
    "no_boundary": ("feedback", "kinds", ["forgetting", "rare"]),
    "no_rare": ("feedback", "kinds", ["forgetting", "boundary"]),
    "random_reexplore": ("feedback", "mode", "random"),
    "no_validation": ("feedback", "validate", False),
    "grpo_only": ("feedback", "enabled", False),
  }
  assert set(expected) | {"coevolve"} == set(ablations.VARIANTS)
  for variant, (section, key, value) in expected.items():
    cfg = json.loads(ablations.load_config(variant, 0, {}).to_json_best_effort())
    assert cfg[section][key] == value
    cfg[section][key] = base[section][key]
    assert cfg == base, variant
  cfg = ablations.load_config("coevolve", 3, {"train.steps": 9})
  assert cfg.seed == 3 and cfg.train.steps == 9


def _fake_run(path, reward, accepted, signals, rounds, share):
  os.makedirs(path)
  summary = {
    "eval_before": 0.0,
    "eval_after": 0.25,
    "tasks_accepted": accepted,
    "validation_pass_rate": [r["pass_rate"] for r in rounds],
    "signals": signals,
    "feedback_share": share,
    "wall_s": 100.0,
  }
  with open(os.path.join(path, "summary.json"), "w") as f:
    json.dump(summary, f)
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    for step, r in enumerate(reward, 1):
      f.write(json.dumps({"step": step, "reward/mean": r}) + "\n")
  with open(os.path.join(path, "feedback.jsonl"), "w") as f:
    for r in rounds:
      f.write(json.dumps(r) + "\n")


def test_table_and_plots_from_run_outputs(ablations, tmp_path):
  rnd = {
    "round": 1,
    "step": 3,
    "pass_rate": 0.5,
    "eval_similarity": {"a": 0.2, "b": 0.4},
    "per_signal": {"boundary": {"events": 3}, "rare": {"events": 1}},
  }
  sig = {"forgetting": 1, "boundary": 3, "rare": 1}
  _fake_run(tmp_path / "co", [0.4, 0.8], 2, sig, [rnd], 0.01)
  _fake_run(tmp_path / "ref", [0.2, 0.4], 0, {"forgetting": 0, "boundary": 0, "rare": 0}, [], 0.0)
  results = {
    "coevolve": [ablations.collect(str(tmp_path / "co"))],
    "grpo_only": [ablations.collect(str(tmp_path / "ref"))],
  }
  lines = ablations.table(results)
  assert len(lines) == 4 and lines[1].count("---") == lines[0].count("|") - 1
  co = [c.strip() for c in lines[2].strip("|").split("|")]
  assert co[:6] == ["coevolve", "1", "0.000", "0.250", "0.600", "2.00x"]  # 0.6 / 0.3
  assert co[7] == "0.50" and co[8] == "1.0/3.0/1.0" and co[9] == "0.30" and co[10] == "0.0100"
  ref = [c.strip() for c in lines[3].strip("|").split("|")]
  assert ref[5] == "1.00x" and ref[7] == "-" and ref[9] == "-"
  pytest.importorskip("matplotlib")
  names = ablations.plots(results, str(tmp_path))
  assert len(names) == 4 and all((tmp_path / n).stat().st_size > 1000 for n in names)


def test_record_replaces_its_block_and_keeps_the_document(ablations, tmp_path):
  """The grid writes its record into docs/ablations.md between markers: the hand-written text
  around it survives a rerun, and rewriting the committed record reproduces the file exactly."""
  committed = os.path.join(os.path.dirname(_SCRIPT), os.pardir, "docs", "ablations.md")
  with open(committed, encoding="utf-8") as f:
    text = f.read()
  begin, end = text.index(ablations.RECORD_BEGIN), text.index(ablations.RECORD_END)
  record = text[begin + len(ablations.RECORD_BEGIN) + 1 : end - 1].split("\n")
  doc = tmp_path / "ablations.md"
  doc.write_text(text, encoding="utf-8")
  ablations.write_record(str(doc), record)
  assert doc.read_text(encoding="utf-8") == text
  ablations.write_record(str(doc), ["## Recorded run (new)", "", "| a |"])
  new = doc.read_text(encoding="utf-8")
  assert new.startswith(text[:begin]) and new.endswith(text[end + len(ablations.RECORD_END) :])
  assert "(new)" in new and "Recorded run (2026-11-30)" not in new
  fresh = tmp_path / "sub" / "fresh.md"  # no document yet: created with the block alone
  ablations.write_record(str(fresh), ["x"])
  assert fresh.read_text() == f"{ablations.RECORD_BEGIN}\nx\n{ablations.RECORD_END}\n"
  doc.write_text(ablations.RECORD_END + "\n" + ablations.RECORD_BEGIN)
  with pytest.raises(ValueError, match="unbalanced"):
    ablations.write_record(str(doc), ["x"])
