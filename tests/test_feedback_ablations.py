"""scripts/ablations.py: each variant flips exactly its switch; the tables (paired differences with
their intervals, per-signal accounting) and plots are built from run outputs (hand-written
workdirs here; the grid itself is too long for a test); a rerun resumes a partly finished grid."""

import importlib.util
import json
import os
import shutil
import subprocess

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
    "aiw": ("role_agent.aiw", "enabled", True),
    "aiw_only": ("role_agent.aiw", "enabled", True),
    "wia": ("role_agent.wia", "enabled", True),
    "qevolve": ("qevolve", "enabled", True),
  }
  also = {  # the other fields a variant sets
    "aiw_only": {"feedback.enabled": False},
    "qevolve": {"qevolve.order": "fit_first"},
    "wia": {
      "role_agent.wia.char_cap": 200,
      "episode.max_new_tokens": 128,
      "eval.max_new_tokens": 128,
      "train.target_buckets": [256, 384, 768],
    },
  }
  assert set(expected) | {"coevolve"} == set(ablations.VARIANTS)

  def node(cfg, dotted):
    for part in dotted.split("."):
      cfg = cfg[part]
    return cfg

  for variant, (section, key, value) in expected.items():
    cfg = json.loads(ablations.load_config(variant, 0, {}).to_json_best_effort())
    assert node(cfg, section)[key] == value
    node(cfg, section)[key] = node(base, section)[key]
    for dotted, value in also.get(variant, {}).items():
      parent, _, leaf = dotted.rpartition(".")
      assert node(cfg, parent)[leaf] == value, (variant, dotted)
      node(cfg, parent)[leaf] = node(base, parent)[leaf]
    assert cfg == base, variant
  cfg = ablations.load_config("coevolve", 3, {"train.steps": 9})
  assert cfg.seed == 3 and cfg.train.steps == 9


def _fake_run(path, seed, *, reward, gen, accepted=0, rounds=(), groups=(), pool_eval=(), d0=None):
  """A finished run's workdir as the loop writes it (only the fields the script reads)."""
  os.makedirs(path, exist_ok=True)  # `CoEvolveRun` makes it
  summary = {
    "complete": True,
    "d0": d0 or {"added": 2},
    "eval_before": 0.0,
    "eval_after": 0.0,
    "eval_generated_before": {"success": gen[0], "reward": gen[0], "tasks": 4},
    "eval_generated_after": {"success": gen[1], "reward": gen[1], "tasks": 4},
    "eval_pool_after": {"d0": {"success": 0.5, "reward": 0.5, "tasks": 2}},
    "tasks_accepted": accepted,
    "signals": {"forgetting": 0, "boundary": 0, "rare": 0},
    "wall_s": 100.0,
  }
  files = {
    "summary.json": [summary],
    "metrics.jsonl": [{"step": 0, "warmstart/loss": 2.0 + seed}]
    + [{"step": i, "reward/mean": r} for i, r in enumerate(reward, 1)],
    "feedback.jsonl": list(rounds),
    "groups.jsonl": list(groups),
    "eval_pool_after.jsonl": list(pool_eval),
  }
  for name, rows in files.items():
    with open(os.path.join(path, name), "w") as f:
      if name.endswith(".json"):
        json.dump(rows[0], f)
      else:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def test_paired_differences_get_a_t_interval_and_a_verdict_only_when_it_excludes_zero(
  ablations, tmp_path
):
  """Three seeds: the generated set's gain over GRPO-only is +0.2, +0.25, +0.3 (mean 0.25, sd
  0.05: the 95% interval 0.25 -/+ 4.302653 * 0.05 / sqrt(3) = [0.1258, 0.3742], better); the
  rollout reward differs by +0.1, -0.1, +0.3 (sd 0.2: [-0.3968, +0.5968], no difference shown)."""
  ref_gen, co_gen = (0.25, 0.25), None
  results = {"coevolve": [], "grpo_only": []}
  for seed, (d_gen, d_rew) in enumerate(((0.2, 0.1), (0.25, -0.1), (0.3, 0.3))):
    co_gen = (0.25, 0.25 + d_gen)
    _fake_run(tmp_path / f"co{seed}", seed, reward=[0.5 + d_rew], gen=co_gen)
    _fake_run(tmp_path / f"ref{seed}", seed, reward=[0.5], gen=ref_gen)
    for v, name in (("coevolve", "co"), ("grpo_only", "ref")):
      results[v].append({**ablations.collect(str(tmp_path / f"{name}{seed}")), "seed": seed})
  rows = {r["figure"]: r for r in ablations.paired(results)}
  gain = rows["gen_after"]
  assert gain["diffs"] == pytest.approx([0.2, 0.25, 0.3])
  assert gain["ci"] == pytest.approx((0.12579, 0.37421), abs=1e-5)
  assert gain["verdict"] == "**better**"
  reward = rows["rollout_reward"]
  assert reward["ci"] == pytest.approx((-0.39683, 0.59683), abs=1e-5)
  assert reward["verdict"] == "no difference shown"
  assert rows["eval_after"]["ci"] == (0.0, 0.0) and "no difference" in rows["eval_after"]["verdict"]
  # The worse side, and one seed (no interval).
  assert ablations.verdict((-0.3, -0.1)) == "**worse**"
  assert ablations.t_interval([0.4]) is None
  table = ablations.summary_table(results)
  co = [c.strip() for c in table[2].strip("|").split("|")]
  header = [c.strip() for c in table[0].strip("|").split("|")]
  assert co[header.index("gen_after")] == "0.500 ± 0.050"
  assert ablations.same_start(results) == []  # same warm-start losses and figures per seed
  # A figure a later version of the job adds to the summary is not a different start ...
  results["grpo_only"][1]["summary"]["eval_generated_before"]["call_recall"] = 0.25
  assert ablations.same_start(results) == []
  results["grpo_only"][1]["summary"]["eval_generated_before"]["success"] += 0.125  # ... this is
  assert ablations.same_start(results) == ["seed 1: coevolve, grpo_only differ"]
  results["grpo_only"][1]["summary"]["eval_generated_before"]["success"] -= 0.125
  results["grpo_only"][1]["warmstart"] = [9.0]
  assert ablations.same_start(results) == ["seed 1: coevolve, grpo_only differ"]
  pytest.importorskip("matplotlib")
  names = ablations.plots(results, ablations.paired(results), str(tmp_path))
  assert len(names) == 4 and all((tmp_path / n).stat().st_size > 1000 for n in names)


def test_per_signal_accounting_follows_fired_and_synthesized_tasks(ablations, tmp_path):
  groups = [
    {"step": 1, "task_id": "d0-a", "rewards": [1.0, 0.0], "fired": ["boundary"]},
    {"step": 1, "task_id": "d0-b", "rewards": [0.0, 0.0], "fired": ["forgetting", "rare"]},
    {"step": 2, "task_id": "d0-a", "rewards": [1.0, 1.0], "fired": []},  # mixed -> solved
    {"step": 3, "task_id": "d0-b", "rewards": [0.0, 1.0], "fired": ["boundary"]},  # not solved
  ]
  pool_eval = [
    {"task_id": "d0-a", "reward": 1.0, "origin": "d0"},
    {"task_id": "d0-b", "reward": 0.0, "origin": "d0"},
    {"task_id": "s1", "reward": 1.0, "origin": "synth:boundary"},
    {"task_id": "s2", "reward": 0.0, "origin": "synth:boundary"},
    {"task_id": "s3", "reward": 0.0, "origin": "synth:forgetting"},
  ]
  rounds = [
    {"round": 1, "per_signal": {"boundary": {"accepted": 2}, "forgetting": {"accepted": 0}}},
    {"round": 2, "per_signal": {"forgetting": {"accepted": 1}}},
  ]
  _fake_run(
    tmp_path / "run",
    0,
    reward=[0.5],
    gen=(0.0, 0.0),
    rounds=rounds,
    groups=groups,
    pool_eval=pool_eval,
  )
  acc = ablations.signal_accounting(ablations.collect(str(tmp_path / "run")))
  # boundary fired on a (step 1) and b (step 3); a was revisited at step 2 and solved there.
  assert acc["boundary"] == {
    "fired": 2,
    "fired_solved_after": 0.5,
    "revisited": 1,
    "revisited_solved": 1.0,
    "accepted": 2,
    "synth_solved_after": 0.5,
  }
  # forgetting fired on b at step 1; its revisit at step 3 was not solved in every rollout.
  assert acc["forgetting"] == {
    "fired": 1,
    "fired_solved_after": 0.0,
    "revisited": 1,
    "revisited_solved": 0.0,
    "accepted": 1,
    "synth_solved_after": 0.0,
  }
  assert acc["rare"]["fired"] == 1 and acc["rare"]["synth_solved_after"] is None


def test_generated_recall_is_computed_from_the_runs_files(ablations, tmp_path):
  """gen_recall_before/after: the mean share of ground-truth calls each greedy episode made,
  from eval_generated.jsonl and eval_generated_<tag>.jsonl (also for runs whose summary lacks
  it)."""
  run = tmp_path / "run"
  _fake_run(run, 0, reward=[0.5], gen=(0.0, 0.0))
  truth = [
    {"task_id": "g0", "ground_truth": [["a()", "b()"]]},
    {"task_id": "g1", "ground_truth": [["c(x=1)"]]},
  ]
  (run / "eval_generated.jsonl").write_text("".join(json.dumps(t) + "\n" for t in truth))
  rows = {"before": [[["a()"]], [[]]], "after": [[["a()", "b()"]], [["c(x=1)"]]]}
  for tag, calls in rows.items():
    lines = [json.dumps({"task_id": t["task_id"], "calls": c}) for t, c in zip(truth, calls)]
    (run / f"eval_generated_{tag}.jsonl").write_text("\n".join(lines) + "\n")
  got = ablations.collect(str(run))
  assert got["gen_recall"] == {"before": 0.25, "after": 1.0}  # (1/2 + 0) / 2, then all
  figures = {name: get({**got, "seed": 0}) for name, _, get in ablations.FIGURES}
  assert figures["gen_recall_before"] == 0.25 and figures["gen_recall_after"] == 1.0


def test_tool_call_rates_and_the_mixed_group_share_come_from_the_runs_files(ablations, tmp_path):
  """gen_calls_init/before/after: the summary's per-reply tool-call rates of the generated set
  (None where a run did not measure one); mixed_groups: groups with unequal rewards over all
  GRPO steps' groups, from metrics.jsonl (2 of 4, then 1 of 4: 3 / 8)."""
  run = tmp_path / "run"
  _fake_run(run, 0, reward=[0.5, 0.25], gen=(0.0, 0.0))
  summary = json.loads((run / "summary.json").read_text())
  summary["eval_generated_init"] = {"success": 0.0, "tool_call_rate": 0.0}
  summary["eval_generated_before"]["tool_call_rate"] = 0.75
  (run / "summary.json").write_text(json.dumps(summary))
  rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  for row, (mixed, groups) in zip(rows[1:], [(2, 4), (1, 4)]):
    row.update({"rollout/mixed_groups": mixed, "rollout/groups": groups})
  (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  figures = {
    name: get({**ablations.collect(str(run)), "seed": 0}) for name, _, get in ablations.FIGURES
  }
  assert (figures["gen_calls_init"], figures["gen_calls_before"]) == (0.0, 0.75)
  assert figures["gen_calls_after"] is None  # the fake run's "after" has no rate
  assert figures["mixed_groups"] == 3 / 8


def test_a_rerun_resumes_the_grid_and_runs_only_what_is_unfinished(
  ablations, tmp_path, monkeypatch
):
  """Finished runs (summary.json complete) are read back, the rest are run (a killed run resumes
  from its own checkpoint inside `CoEvolveRun`); `--report` runs nothing."""
  grid = tmp_path / "grid"
  _fake_run(grid / "coevolve-s0", 0, reward=[0.5], gen=(0.0, 0.5))
  _fake_run(grid / "grpo_only-s0", 0, reward=[0.5], gen=(0.0, 0.25))
  os.makedirs(grid / "coevolve-s1")  # killed before it finished: no summary
  ran = []
  caches = [str(grid / ablations.GRID_CACHE)]

  class FakeRun:
    def __init__(self, cfg, workdir):
      self.cfg, self.workdir = cfg, workdir
      os.makedirs(workdir, exist_ok=True)  # as `CoEvolveRun` does

    def bootstrap(self):
      ran.append((os.path.basename(self.workdir), self.cfg.seed, "step 0"))
      assert self.cfg.compile.cache_dir == caches[-1]  # one cache for the grid
      # The full loop's config, whichever variant asked for the start.
      assert self.cfg.feedback.enabled and self.cfg.feedback.mode == "signals"
      os.makedirs(os.path.join(self.workdir, "checkpoints"), exist_ok=True)
      with open(os.path.join(self.workdir, "config.json"), "w") as f:
        f.write(self.cfg.to_json_best_effort())
      with open(os.path.join(self.workdir, "pool.jsonl"), "w") as f:
        f.write("D0\n")
      return 0

    def fit(self):
      ran.append((os.path.basename(self.workdir), self.cfg.seed, self.cfg.train.steps))
      assert self.cfg.compile.cache_dir == caches[-1]
      copied = os.path.join(self.workdir, ablations.COPIED_FROM)
      was_copied = os.path.exists(copied)
      if was_copied:  # a copy of the seed's start, without its config
        want = [ablations.COPIED_FROM, ablations.CODE_FILE, "checkpoints", "pool.jsonl"]
        assert sorted(os.listdir(self.workdir)) == sorted(want)
        variant = os.path.basename(self.workdir).rsplit("-s", 1)[0]
        assert self.cfg.feedback.enabled == (variant != "grpo_only")  # its own switch
      shutil.rmtree(self.workdir, ignore_errors=True)
      _fake_run(self.workdir, self.cfg.seed, reward=[0.5], gen=(0.0, 0.5))
      if was_copied:
        open(copied, "w").close()  # the mark survives the run (the loop leaves it alone)

  import coevolve_jax.loop  # noqa: PLC0415

  monkeypatch.setattr(coevolve_jax.loop, "CoEvolveRun", FakeRun)
  args = [
    "--workdir",
    str(grid),
    "--out",
    str(tmp_path / "plots"),
    "--variants",
    "coevolve,grpo_only",
  ]
  ablations.main([*args, "--seeds", "0,1", "--report"])
  assert ran == []
  text = (tmp_path / "plots.md").read_text()
  assert "| coevolve | 0 |" in text and "one seed" in text
  assert "Every run made its own step 0." in text  # hand-written runs, no copy mark
  ablations.main([*args, "--seeds", "0,1", "--steps", "7"])
  # coevolve-s1 resumes its own workdir; grpo_only-s1 starts from a copy of seed 1's step 0,
  # made with the full loop's config.
  assert ran == [("coevolve-s1", 1, 7), ("start-s1", 1, "step 0"), ("grpo_only-s1", 1, 7)]
  assert not os.path.exists(grid / "grpo_only-s1.copying")
  text = (tmp_path / "plots.md").read_text()
  assert "| coevolve | 0,1 |" in text and "Same start per seed" in text
  assert "1 of 4 runs resumed from a copy of it" in text
  assert "made their own: coevolve-s0, coevolve-s1, grpo_only-s0." in text
  # A new seed: one step 0 for both variants; a rerun finds it done.
  ran.clear()
  ablations.main([*args, "--seeds", "3", "--steps", "3"])
  assert ran == [("start-s3", 3, "step 0"), ("coevolve-s3", 3, 3), ("grpo_only-s3", 3, 3)]
  assert "every run resumed from a copy of it" in (tmp_path / "plots.md").read_text()
  shutil.rmtree(grid / "grpo_only-s3")
  ran.clear()
  ablations.main([*args, "--seeds", "3", "--steps", "5"])  # more GRPO steps: the same start
  assert ran == [("grpo_only-s3", 3, 5)]
  shutil.rmtree(grid / "grpo_only-s3")
  ran.clear()  # another compilation cache (--set): the same start; the record's command names it
  caches.append(str(tmp_path / "own_cache"))
  own = f"compile.cache_dir={json.dumps(caches[-1])}"
  ablations.main([*args, "--seeds", "3", "--steps", "5", "--set", own])
  assert ran == [("grpo_only-s3", 3, 5)]
  assert "own_cache" in (tmp_path / "plots.md").read_text()  # the command
  caches.pop()
  shutil.rmtree(grid / "grpo_only-s3")
  ran.clear()  # JAX's own cache setting is left to JAX (the config's "" reaches the run)
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env_cache"))
  caches.append("")
  ablations.main([*args, "--seeds", "3", "--steps", "5"])
  assert ran == [("grpo_only-s3", 3, 5)]
  caches.pop()
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
  shutil.rmtree(grid / "grpo_only-s3")
  with pytest.raises(RuntimeError, match=r"other settings \(warmstart.steps\)"):
    ablations.main([*args, "--seeds", "3", "--set", "warmstart.steps=7"])
  assert not os.path.exists(grid / "grpo_only-s3")
  # A start made before a field was added to the project (absent from its config.json) still
  # serves (the field's default keeps earlier behaviour), unless the command sets that field.
  made = json.loads((grid / "start-s3" / "config.json").read_text())
  del made["role_agent"]
  (grid / "start-s3" / "config.json").write_text(json.dumps(made))
  ran.clear()
  ablations.main([*args, "--seeds", "3", "--steps", "5"])
  assert ran == [("grpo_only-s3", 3, 5)]
  shutil.rmtree(grid / "grpo_only-s3")
  with pytest.raises(RuntimeError, match=r"other settings \(role_agent.wia.enabled\)"):
    ablations.main([*args, "--seeds", "3", "--set", "role_agent.wia.enabled=true"])
  # A start that went past step 0 is not copied.
  ran.clear()
  FakeRun.bootstrap = lambda self: ran.append("step 0") or 2
  with pytest.raises(RuntimeError, match="step 2, not a step-0 start"):
    ablations.main([*args, "--seeds", "4", "--steps", "3"])
  assert not os.path.exists(grid / "coevolve-s4")
  ran.clear()
  ablations.main([*args, "--seeds", "2", "--steps", "3", "--no-shared-start"])  # own step 0 each
  assert ran == [("coevolve-s2", 2, 3), ("grpo_only-s2", 2, 3)]
  assert "Every run made its own step 0." in (tmp_path / "plots.md").read_text()
  # Step 0 reads no_validation's switch (AppWorld validates D0 by feedback.validate), WIA's (the
  # demonstrations' predictions) and Q-Evolve's (the demonstrations fill its replay buffer).
  own = [v for v in ablations.VARIANTS if not ablations.shares_start(v)]
  assert own == ["no_validation", "wia", "qevolve"]
  with pytest.raises(KeyError, match="no field"):
    ablations.load_config("coevolve", 0, {"train.stepz": 3})


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
  assert "(new)" in new and record[0] not in new
  fresh = tmp_path / "sub" / "fresh.md"  # no document yet: created with the block alone
  ablations.write_record(str(fresh), ["x"])
  assert fresh.read_text() == f"{ablations.RECORD_BEGIN}\nx\n{ablations.RECORD_END}\n"
  doc.write_text(ablations.RECORD_END + "\n" + ablations.RECORD_BEGIN)
  with pytest.raises(ValueError, match="unbalanced"):
    ablations.write_record(str(doc), ["x"])


def test_saved_runs_outlive_their_workdirs_while_their_settings_hold(
  ablations, tmp_path, monkeypatch
):
  """A finished run is saved under `--out/runs`; with its workdir gone (a new session's checkout),
  the grid reads it back unless the command asks for other settings (how programs compile
  aside)."""
  grid, out = tmp_path / "grid", tmp_path / "plots"
  args = ["--workdir", str(grid), "--out", str(out), "--variants", "coevolve", "--seeds", "0"]
  _fake_run(grid / "coevolve-s0", 0, reward=[0.25], gen=(0.0, 0.75))
  made = ablations.load_config("coevolve", 0, {"compile.cache_dir": str(grid / "xla_cache")})
  (grid / "coevolve-s0" / "config.json").write_text(made.to_json_best_effort())
  ran = []

  class FakeRun:
    def __init__(self, cfg, workdir):
      self.cfg, self.workdir = cfg, workdir
      os.makedirs(workdir, exist_ok=True)  # as `CoEvolveRun` does

    def fit(self):
      ran.append(self.cfg.train.steps)
      _fake_run(self.workdir, 0, reward=[0.5], gen=(0.0, 0.5))

  import coevolve_jax.loop  # noqa: PLC0415

  monkeypatch.setattr(coevolve_jax.loop, "CoEvolveRun", FakeRun)
  ablations.main(args)
  saved = out / "runs" / "coevolve-s0.json"
  assert json.loads(saved.read_text())["run"]["rewards"] == [[1, 0.25]]
  shutil.rmtree(grid)
  ablations.main([*args, "--set", f"compile.cache_dir={json.dumps(str(tmp_path / 'other'))}"])
  assert ran == []  # read back: only the compilation cache differs
  assert "| coevolve | 0 |" in (tmp_path / "plots.md").read_text()
  # A field added to the project after the run (absent from its config): read back.
  saved_run = json.loads(saved.read_text())
  del saved_run["config"]["role_agent"]
  saved.write_text(json.dumps(saved_run))
  ablations.main(args)
  assert ran == []
  ablations.main([*args, "--set", "role_agent.aiw.enabled=true", "--no-shared-start"])
  assert len(ran) == 1  # unless the command sets it
  ran.clear()
  shutil.rmtree(grid)
  ablations.main([*args, "--steps", "3", "--no-shared-start"])  # other GRPO steps: run again
  assert ran == [3]
  assert json.loads(saved.read_text())["run"]["rewards"] == [[1, 0.5]]


def test_a_workdir_of_other_settings_is_refused_but_grpo_only_ignores_its_unread_clock(
  ablations, tmp_path
):
  """A run in the grid's workdir, finished or not, made with other settings is neither resumed,
  reported nor paired; GRPO only never reads the feedback clock or the synthesized share, so a
  schedule change leaves its runs (and the seed's start) valid."""
  grid, out = tmp_path / "grid", tmp_path / "plots"
  args = ["--workdir", str(grid), "--out", str(out), "--seeds", "0", "--report"]
  made = {v: ablations.load_config(v, 0, {}) for v in ("coevolve", "grpo_only")}
  for variant, cfg in made.items():
    _fake_run(grid / f"{variant}-s0", 0, reward=[0.5], gen=(0.0, 0.5))
    (grid / f"{variant}-s0" / "config.json").write_text(cfg.to_json_best_effort())
  ablations.main([*args, "--variants", "coevolve,grpo_only"])  # the settings it ran: read
  schedule = ["--set", "feedback.every=2", "--set", "pool.synth_fraction=0.5"]
  ablations.main([*args, "--variants", "grpo_only", *schedule])  # unread by GRPO only
  with pytest.raises(RuntimeError, match=r"coevolve-s0 ran other settings \(feedback.every, po"):
    ablations.main([*args, "--variants", "coevolve", *schedule])
  with pytest.raises(RuntimeError, match=r"grpo_only-s0 ran other settings \(train.lr\)"):
    ablations.main([*args, "--variants", "grpo_only", "--set", "train.lr=0.5"])
  os.remove(grid / "grpo_only-s0" / "summary.json")  # unfinished: refused before it resumes
  with pytest.raises(RuntimeError, match=r"grpo_only-s0 ran other settings \(train.lr\)"):
    ablations.main([*args, "--variants", "grpo_only", "--set", "train.lr=0.5"])
  # Only where both sides run no rounds and no AIW.
  grpo = made["grpo_only"]
  for key in ("feedback.every", "feedback.lag", "pool.synth_fraction", "feedback.kinds"):
    assert key in ablations.UNREAD_WITHOUT_ROUNDS
  as_run = json.loads(grpo.to_json_best_effort())
  cfg = ablations.load_config("grpo_only", 0, {"feedback.every": 2, "pool.synth_fraction": 0.5})
  assert ablations.changed_settings(as_run, cfg, {}) == []
  aiw = ablations.load_config("aiw_only", 0, {"feedback.every": 2})
  as_run["role_agent"]["aiw"]["enabled"] = True  # AIW's analyser keeps the clock
  assert ablations.changed_settings(as_run, aiw, {}) == ["feedback.every"]
  # The seed's start serves a new schedule (read in GRPO steps only).
  assert ablations.SCHEDULE <= ablations.START_MAY_DIFFER


def test_runs_record_the_code_they_ran(ablations, tmp_path, monkeypatch):
  """A run's workdir lists the code versions that worked on it (a commit once each, in order;
  "+dirty" where tracked files differ from it), its saved run carries them, and the record says
  whether a seed's runs ran the same code."""
  repo = tmp_path / "checkout"
  repo.mkdir()
  git = lambda *a: subprocess.run(["git", *a], cwd=repo, check=True, capture_output=True, text=True)  # noqa: E731
  git("init", "-q")
  (repo / "model.py").write_text("a = 1\n")
  git("add", "model.py")
  git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
  commit = git("rev-parse", "--short=12", "HEAD").stdout.strip()
  monkeypatch.setattr(ablations, "ROOT", str(repo))
  assert ablations.code_version() == commit
  (repo / "model.py").write_text("a = 2\n")
  assert ablations.code_version() == commit + "+dirty"
  monkeypatch.setattr(ablations, "ROOT", str(tmp_path / "nowhere"))
  assert ablations.code_version() == "unknown"

  run = tmp_path / "coevolve-s0"
  _fake_run(run, 0, reward=[0.5], gen=(0.0, 0.5))
  assert ablations.note_code(str(run), "aaa") == ["aaa"]
  assert ablations.note_code(str(run), "aaa") == ["aaa"]  # resumed by the same code
  assert ablations.note_code(str(run), "bbb") == ["aaa", "bbb"]
  assert ablations.collect(str(run))["code"] == ["aaa", "bbb"]
  same = {"coevolve": [{"seed": 0, "code": ["aaa"]}], "grpo_only": [{"seed": 0, "code": ["aaa"]}]}
  assert ablations.code_sentence(same) == "Code: every run at aaa."
  mixed = {"coevolve": [{"seed": 0, "code": ["aaa", "bbb"]}], "grpo_only": [{"seed": 0}]}
  assert ablations.code_sentence(mixed) == (
    "Code: **the runs ran different code or CPUs** (in the order they ran): "
    "coevolve-s0: aaa, bbb; grpo_only-s0: unknown."
  )
