"""A short run with the Gemini explorer (against a loopback Gemini server) must not write the API
key anywhere: config dump, logs, metrics, feedback and exploration logs, pool, checkpoints."""

import importlib.util
import logging
import os
import uuid

import pytest

from coevolve_jax.feedback.gemini_stub import GeminiStub
from coevolve_jax.loop import CoEvolveRun

_CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "bfcl.py")


def tiny_gemini_config(base_url: str):
  spec = importlib.util.spec_from_file_location("bfcl_config", _CONFIG)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cfg = module.get_config("cpu")
  cfg.data.eval_size = 2
  cfg.eval.max_tasks = 1
  cfg.eval.max_new_tokens = 4
  cfg.eval.max_steps_per_turn = 1
  cfg.explore.initial_tasks = 2
  cfg.explore.explorer = "gemini"
  cfg.explore.d0_explorer = "programmatic"
  cfg.explore.max_contexts_per_round = 2
  cfg.explore.rounds = 1
  cfg.explore.steps_per_round = 3
  cfg.explore.gemini.base_url = base_url
  cfg.explore.gemini.attempts = 2
  cfg.explore.gemini.initial_delay_s = 0.01
  cfg.explore.gemini.max_delay_s = 0.02
  cfg.warmstart.steps = 0
  cfg.rollout.tasks_per_step = 2
  cfg.rollout.group_size = 2
  cfg.rollout.num_slots = 4
  cfg.rollout.max_new_tokens = 4
  cfg.rollout.max_model_steps = 1
  cfg.signals.rare_min_total = 1
  cfg.train.steps = 1
  cfg.train.mini_batches = 1
  cfg.feedback.every = 1
  cfg.feedback.lag = 0
  cfg.feedback.mode = "random"  # contexts without signals: a random-init policy fires none
  cfg.checkpoint.every = 1
  return cfg


@pytest.mark.timeout(600)
def test_api_key_never_reaches_the_workdir_or_logs(tmp_path, monkeypatch, capsys, caplog):
  key = f"AIzaLEAKCHECK-{uuid.uuid4().hex}"
  monkeypatch.delenv("GOOGLE_API_KEY", raising=False)
  monkeypatch.setenv("GEMINI_API_KEY", key)
  caplog.set_level(logging.DEBUG)
  workdir = tmp_path / "run"
  with GeminiStub() as stub:
    summary = CoEvolveRun(tiny_gemini_config(stub.url), str(workdir)).fit()
  assert stub.requests, "the feedback round never called the Gemini endpoint"
  assert all(r["headers"].get("x-goog-api-key") == key for r in stub.requests)
  assert summary["feedback_rounds"] == 1 and "feedback_share" in summary

  files = [os.path.join(d, f) for d, _, fs in os.walk(workdir) for f in fs]
  assert any(f.endswith("config.json") for f in files)
  assert any("checkpoints" in f for f in files)
  needle = key.encode()
  leaked = [f for f in files if needle in open(f, "rb").read()]
  assert not leaked, f"API key written to {leaked}"
  out = capsys.readouterr()
  assert key not in out.out and key not in out.err and key not in caplog.text
