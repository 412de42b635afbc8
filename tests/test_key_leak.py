"""A short run with the Gemini explorer (against a loopback Gemini server) must not write the API
key anywhere: config dump, logs, metrics, feedback and exploration logs, pool, checkpoints."""

import importlib.util
import json
import logging
import os
import uuid

import pytest

from coevolve_jax.testing.gemini_stub import GeminiStub
from coevolve_jax.loop import CoEvolveRun

_CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "bfcl.py")


def tiny_gemini_config(base_url: str):
  spec = importlib.util.spec_from_file_location("bfcl_config", _CONFIG)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cfg = module.get_config("cpu")
  cfg.bfcl.eval_size = 2
  cfg.eval.max_tasks = 1
  cfg.eval.generated_tasks = 0  # two held-out entries: too few states to explore for a set
  cfg.eval.pool_after = False
  cfg.eval.max_new_tokens = 4
  cfg.eval.max_steps_per_turn = 1
  cfg.explore.initial_tasks = 2
  cfg.explore.explorer = "gemini"
  cfg.explore.d0_explorer = "programmatic"
  cfg.feedback.max_contexts = 2
  cfg.explore.rounds = 1
  cfg.explore.steps_per_round = 3
  cfg.explore.gemini.base_url = base_url
  cfg.explore.gemini.attempts = 2
  cfg.explore.gemini.initial_delay_s = 0.01
  cfg.explore.gemini.max_delay_s = 0.02
  cfg.warmstart.steps = 0
  cfg.rollout.tasks_per_step = 2
  cfg.rollout.group_size = 2
  cfg.engine.num_slots = 4
  cfg.episode.max_new_tokens = 4
  cfg.episode.max_model_steps = 1
  cfg.signals.rare_min_total = 1
  cfg.train.steps = 1
  cfg.train.mini_batches = 1
  cfg.feedback.every = 1
  cfg.feedback.lag = 0
  cfg.feedback.mode = "random"  # contexts without signals: a random-init policy fires none
  cfg.compile.ahead = False  # the preset's whole program set would triple this test's time
  cfg.checkpoint.every = 1
  return cfg


def _pool_lines(path):
  with open(path, encoding="utf-8") as f:
    return [line for line in f if line.strip()]


def _assert_key_not_written(workdir, key, stub, capsys, caplog):
  """Every Gemini request carried the key, and no file under `workdir`, output or log holds it."""
  assert stub.requests, "the feedback round never called the Gemini endpoint"
  assert all(r["headers"].get("x-goog-api-key") == key for r in stub.requests)
  files = [os.path.join(d, f) for d, _, fs in os.walk(workdir) for f in fs]
  assert any(f.endswith("config.json") for f in files)
  assert any("checkpoints" in f for f in files)
  assert any(f.endswith("exploration.jsonl") for f in files)
  needle = key.encode()
  leaked = [f for f in files if needle in open(f, "rb").read()]
  assert not leaked, f"API key written to {leaked}"
  out = capsys.readouterr()
  assert key not in out.out and key not in out.err and key not in caplog.text


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_key_never_leaks_and_a_round_in_flight_resumes_exactly(
  tmp_path, monkeypatch, capsys, caplog
):
  """Run 1 starts a feedback round after step 2 (joined after step 3), checkpoints step 2 with
  the round in flight, and dies in step 3. Run 2 resumes from step 2, redoes the round and must
  add exactly the tasks run 1's worker had synthesized. No file or log holds the API key.
  Slow (two runs of three steps); the default run keeps the key check (tests/test_interrupt.py,
  whose interrupted and resumed runs have a Gemini round), and resuming a round in flight is
  covered at unit level by test_feedback_round's round-journal test."""
  key = f"AIzaLEAKCHECK-{uuid.uuid4().hex}"
  monkeypatch.delenv("GOOGLE_API_KEY", raising=False)
  monkeypatch.setenv("GEMINI_API_KEY", key)
  caplog.set_level(logging.DEBUG)
  workdir = str(tmp_path / "run")
  with GeminiStub() as stub:
    cfg = tiny_gemini_config(stub.url)
    cfg.train.steps, cfg.feedback.every, cfg.feedback.lag = 3, 2, 1
    run = CoEvolveRun(cfg, workdir)
    real_step = CoEvolveRun._step

    def dies_in_step_3(self, step):
      if step == 3:
        raise KeyboardInterrupt("killed in step 3")
      return real_step(self, step)

    monkeypatch.setattr(CoEvolveRun, "_step", dies_in_step_3)
    with pytest.raises(KeyboardInterrupt):
      run.fit()
    run.ckpt.wait()
    in_flight = run.state.pending.future.result().tasks  # what run 1's worker synthesized
    assert run.state.pending.round_idx == 1 and run.state.pending.commit_at == 3
    assert len(_pool_lines(os.path.join(workdir, "pool.jsonl"))) == 2  # D0 only: not committed
    monkeypatch.setattr(CoEvolveRun, "_step", real_step)

    cfg = tiny_gemini_config(stub.url)
    cfg.train.steps, cfg.feedback.every, cfg.feedback.lag = 3, 2, 1
    summary = CoEvolveRun(cfg, workdir).fit()
  assert summary["resumed_from_step"] == 2 and summary["steps"] == 3
  assert summary["feedback_rounds"] == 1 and 0.0 <= summary["feedback_share"] < 1.0
  assert in_flight, "the round synthesized nothing: the comparison would be empty"
  with open(os.path.join(workdir, "feedback.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  assert [r["stage"] for r in rows] == ["d0", "round"]
  assert [(r["round"], r["start_step"], r["step"]) for r in rows[1:]] == [(1, 2, 3)]
  dropped = {d[0] for d in rows[1]["dropped"]}
  pool = _pool_lines(os.path.join(workdir, "pool.jsonl"))
  assert len(pool) > 2 and rows[1]["synthesized"] >= len(in_flight)
  assert pool[2:] == [t.to_json() + "\n" for t in in_flight if t.task_id not in dropped]
  _assert_key_not_written(workdir, key, stub, capsys, caplog)
