"""BFCL evaluation: official loop semantics, the ground-truth replay at 100%, the CLI end to end."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from envs.bfcl import evaluate
from coevolve_jax.agent import QwenChat
from coevolve_jax.models import Qwen, QwenConfig
from coevolve_jax.testing.replay_engine import ReplayEngine
from coevolve_jax.types import Action, ToolCall
from envs.bfcl import env as bfcl
from envs.bfcl.suite import BfclSuite, make_episode

import kit


_spec = importlib.util.spec_from_file_location(
  "_cfg_bfcl", os.path.join(os.path.dirname(__file__), "..", "configs", "bfcl.py")
)
bfcl_config = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bfcl_config)


@pytest.fixture(scope="module")
def cfg():
  c = bfcl_config.get_config("cpu")
  c.eval.max_steps_per_turn = bfcl.MAX_STEPS_PER_TURN  # what the CLI sets by default
  return c


@pytest.fixture(scope="module")
def chat():
  return QwenChat(enable_thinking=False)


@pytest.fixture(scope="module")
def base_tasks():
  return bfcl.load_bfcl_tasks("multi_turn_base")


def _replay(tasks, chat, cfg, num_slots):
  return ReplayEngine(
    tasks,
    chat,
    lambda t, e: make_episode(cfg, t, e, eval=True),
    num_slots,
    parse_call=bfcl.parse_call_string,
    max_steps_per_turn=bfcl.MAX_STEPS_PER_TURN,
  )


def test_ground_truth_replay_scores_100_percent_on_multi_turn_base(cfg, chat, base_tasks):
  # Every 8th entry (25 of 200, all eight backends) keeps this test at a few seconds; the whole
  # category scores 100% too: `python -m envs.bfcl.evaluate --config=configs/bfcl.py:cpu
  # --policy=ground_truth --categories=multi_turn_base --max_new_tokens=4096` (~40 s).
  tasks = base_tasks[::8]
  assert len({c for t in tasks for c in t.involved_classes}) == 8
  engine = _replay(tasks, chat, cfg, num_slots=4)  # fewer slots than entries: slots are reused
  result = evaluate.evaluate_category(engine, chat, tasks, cfg, max_new_tokens=4096)
  assert result["n"] == len(tasks)
  bad = [(r["id"], r["finish"], r["checker"]) for r in result["entries"] if r["reward"] != 1.0]
  assert not bad and result["accuracy"] == 1.0
  for task, row in zip(tasks, result["entries"]):
    assert row["id"] == task.task_id and row["finish"] == "done" and row["parse_errors"] == 0
    classes = task.involved_classes

    def norm(turns, classes=classes):
      return [[bfcl.parse_call_string(c, classes) for c in turn] for turn in turns]

    assert norm(row["calls"]) == norm(task.ground_truth)


def test_replay_with_a_short_token_limit_fails_like_a_model_would(cfg, chat, base_tasks):
  # The same policy cut at 16 tokens per reply: every call reply is truncated, which ends the turn
  # under the official loop, so the checker sees empty turns and fails the entry.
  tasks = base_tasks[:2]
  engine = _replay(tasks, chat, cfg, num_slots=2)
  result = evaluate.evaluate_category(engine, chat, tasks, cfg, max_new_tokens=16)
  assert result["accuracy"] == 0.0
  assert all(r["finish"] == "done" and r["parse_errors"] > 0 for r in result["entries"])


def test_official_loop_semantics(cfg, base_tasks):
  task = base_tasks[0]  # 4 user turns
  env = make_episode(cfg, task, "official", eval=True)
  try:
    env.reset()
    # An undecodable reply ends the user turn (BFCL: "Proceed to next turn").
    result = env.step(Action(error="invalid JSON"))
    assert not result.done and result.messages == [{"role": "user", "content": task.turns[1]}]
    # 20 executed steps are allowed in a turn; the 21st force-terminates the entry.
    ls = Action(tool_calls=[ToolCall("ls", {})])
    for _ in range(bfcl.MAX_STEPS_PER_TURN):
      result = env.step(ls)
      assert not result.done and result.messages[0]["role"] == "tool"
    result = env.step(ls)
    assert result.done and result.reward == 0.0
    assert result.info["checker"]["error_type"] == "multi_turn:force_terminated"
  finally:
    env.close()
  # The training loop differs: a parse error is an observation and the turn goes on.
  env = bfcl.make_env(task, "training")
  try:
    env.reset()
    result = env.step(Action(error="invalid JSON"))
    assert not result.done and result.messages[0]["role"] == "tool"
    assert "could not parse" in result.messages[0]["content"]
  finally:
    env.close()


def _save_run_checkpoint(path, model):
  from coevolve_jax.checkpoint import RunCheckpointer  # noqa: PLC0415
  from coevolve_jax.trainer import TrainState  # noqa: PLC0415

  params = nnx.state(model, nnx.Param)
  ckpt = RunCheckpointer(path, keep=1)
  ckpt.save(3, TrainState(params, {"count": np.zeros((), np.int32)}, params), {"step": 3})
  ckpt.wait()
  ckpt.close()


# Full vocabulary (real token ids), everything else minimal: compiles in seconds.
TINY = kit.tiny_config(
  vocab_size=151936,
  hidden_size=16,
  intermediate_size=32,
  num_hidden_layers=1,
  num_attention_heads=2,
  num_key_value_heads=1,
  head_dim=8,
)


def test_cli_model_policy_end_to_end(cfg, tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(QwenConfig, "preset", classmethod(lambda cls, name: TINY))
  model = Qwen(TINY, rngs=nnx.Rngs(7))
  _save_run_checkpoint(str(tmp_path / "checkpoints"), model)
  loaded = evaluate.load_model(cfg, str(tmp_path))  # the workdir: its checkpoints/ is found
  for a, b in zip(
    jax.tree.leaves(nnx.state(model, nnx.Param)),
    jax.tree.leaves(nnx.state(loaded, nnx.Param)),
    strict=True,
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  small = bfcl_config.get_config("cpu")
  small.engine.num_slots, small.eval.max_new_tokens = 2, 4
  out = tmp_path / "report.json"
  report = evaluate.run(
    small, str(tmp_path), ["multi_turn_miss_param"], max_tasks=2, policy="model", output=str(out)
  )
  # No config.json in the workdir (a copied checkpoint): --config's model group, with a warning.
  assert f"warning: {tmp_path / 'config.json'} does not exist" in capsys.readouterr().err
  on_disk = json.loads(out.read_text())
  assert on_disk["categories"].keys() == {"multi_turn_miss_param"}
  # The report names the data it scored (issue 40 item 8): bfcl-eval ships BFCL_v4-named files.
  release = on_disk["data_release"]
  assert release["package"].startswith("bfcl-eval==") and release["release"] == "BFCL_v4"
  files = release["files"]["multi_turn_miss_param"]
  assert files["prompt"].startswith("BFCL_v4_multi_turn_miss_param.json sha256:")
  assert "missing" not in files["answer"]
  cat = on_disk["categories"]["multi_turn_miss_param"]
  assert (
    cat["n"] == 2 and cat["accuracy"] == report["categories"]["multi_turn_miss_param"]["accuracy"]
  )
  for task, row in zip(bfcl.load_bfcl_tasks("multi_turn_miss_param"), cat["entries"]):
    # A random model: every reply is cut at 4 tokens, which ends each user turn (official
    # loop), so the episode sees each of the entry's turns once and fails.
    assert row["id"] == task.task_id and row["finish"] == "done" and row["reward"] == 0.0
    assert row["model_steps"] == len(task.turns) and row["generated_tokens"] == 4 * len(task.turns)


# orbax's failed TensorStore read leaves a callback for its closed asyncio loop, which Python
# reports as unraisable after the test's error is raised and checked (orbax's, not ours).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_damaged_checkpoint_is_one_clear_error(cfg, tmp_path, monkeypatch):
  """Array files cut short (a bad disk): CorruptFileError naming the step and folder and what a
  resume does, not orbax's 174-line TensorStore traceback (evaluate's command prints it as one
  line, exit 2)."""
  from coevolve_jax.errors import CorruptFileError  # noqa: PLC0415

  monkeypatch.setattr(QwenConfig, "preset", classmethod(lambda cls, name: TINY))
  _save_run_checkpoint(str(tmp_path / "checkpoints"), Qwen(TINY, rngs=nnx.Rngs(7)))
  for root, _, files in os.walk(tmp_path / "checkpoints" / "3" / "params"):
    for name in files if os.path.basename(root) == "d" else ():
      os.truncate(os.path.join(root, name), os.path.getsize(os.path.join(root, name)) // 2)
  with pytest.raises(CorruptFileError) as e:
    evaluate.load_model(cfg, str(tmp_path))
  message = str(e.value)
  assert message.startswith(f"checkpoint step 3 in {tmp_path / 'checkpoints'} cannot be read (")
  assert "moves it aside" in message and "\n" not in message


def test_missing_checkpoint_is_a_clear_error(cfg, tmp_path):
  with pytest.raises(FileNotFoundError, match="no such folder"):
    evaluate.load_model(cfg, str(tmp_path / "nope"))
  os.makedirs(tmp_path / "empty")
  with pytest.raises(FileNotFoundError, match="neither a Hugging Face folder"):
    evaluate.load_model(cfg, str(tmp_path / "empty"))


def test_the_runs_evaluation_uses_the_same_episodes_as_the_cli(tmp_path):
  """eval_before / eval_after (the suite's eval envs) and the CLI share `make_episode(eval=True)`:
  BFCL's own loop, with the run's eval.max_steps_per_turn; training episodes keep the training
  semantics and bfcl.max_steps_per_turn."""
  c = bfcl_config.get_config("cpu")
  suite = BfclSuite(c, str(tmp_path))
  task = suite.eval_tasks[0]
  evaluation, training = suite.make_env(task, "e", eval=True), suite.make_env(task, "t")
  try:
    assert evaluation.official_loop and evaluation.max_steps_per_turn == c.eval.max_steps_per_turn
    assert not training.official_loop
    assert training.max_steps_per_turn == c.bfcl.max_steps_per_turn
    evaluation.reset()
    result = evaluation.step(Action(error="invalid JSON"))  # ends the user turn, as in BFCL
    assert result.messages == [{"role": "user", "content": task.turns[1]}]
  finally:
    evaluation.close()
    training.close()
    suite.close()


class _EndOfTextReplay(ReplayEngine):
  """The ground-truth replay, but every reply ends with <|endoftext|> (151643) instead of
  <|im_end|> and then runs on with filler for as long as it is asked: what a Qwen3 instruct
  checkpoint may sample."""

  def prefill(self, slot, ids, rng, sampling):
    first = super().prefill(slot, ids, rng, sampling)
    queue = self._queue[slot]
    assert queue[-1] == 151645
    queue[-1] = 151643
    queue.extend([self._closing[0]] * 4096)
    return first


def test_cli_stops_replies_at_the_checkpoints_generation_eos_ids(cfg, chat, tmp_path, monkeypatch):
  """A Hugging Face folder whose generation_config.json lists 151645 and 151643: replies that end
  with 151643 stop there and the ground-truth calls score 100%, where a stop set of <|im_end|>
  alone cuts every reply at the token limit (nothing runs, 0%)."""
  from coevolve_jax.models.hf import save_pretrained  # noqa: PLC0415
  from coevolve_jax.rollout import engine as engine_lib  # noqa: PLC0415

  folder = save_pretrained(Qwen(TINY, rngs=nnx.Rngs(0)), tmp_path / "hf")
  (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
  small = bfcl_config.get_config("cpu")
  small.engine.num_slots = 2
  tasks = bfcl.load_bfcl_tasks("multi_turn_base")[:2]
  make = lambda t, e: make_episode(small, t, e, eval=True)  # noqa: E731
  monkeypatch.setattr(
    engine_lib,
    "Engine",
    lambda model, *a, **k: _EndOfTextReplay(
      tasks, chat, make, 2, parse_call=bfcl.parse_call_string, max_steps_per_turn=3
    ),
  )
  report = evaluate.run(
    small,
    str(folder),
    ["multi_turn_base"],
    max_tasks=2,
    policy="model",
    output=str(tmp_path / "report.json"),
    max_new_tokens=256,
  )
  rows = report["categories"]["multi_turn_base"]["entries"]
  assert [r["finish"] for r in rows] == ["done", "done"]
  assert [r["reward"] for r in rows] == [1.0, 1.0] and [r["parse_errors"] for r in rows] == [0, 0]
  assert all(r["generated_tokens"] < 256 * r["model_steps"] for r in rows)


# ---------------------------------------------------------------------------------------------
# The model of a run's checkpoint is the run's own: its config.json's model group.
# ---------------------------------------------------------------------------------------------


def _run_from_hf_folder(tmp_path, seed=7):
  """A run's workdir as `coevolve_jax.main` leaves it, for a run started from a Hugging Face
  folder of the TINY shape whose generation_config.json adds 151643 (`<|endoftext|>`) to the
  stop ids (its config.json has none): config.json (`workdir.check_config`) records
  model.checkpoint = the folder; checkpoints/ holds the trained parameters (another seed than the
  folder's). Returns (workdir, folder, the trained model)."""
  from coevolve_jax.models.hf import save_pretrained  # noqa: PLC0415
  from coevolve_jax.workdir import check_config  # noqa: PLC0415

  folder = save_pretrained(Qwen(TINY, rngs=nnx.Rngs(0)), tmp_path / "hf")
  (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
  run_cfg = bfcl_config.get_config("cpu")
  run_cfg.model.checkpoint = str(folder)
  workdir = tmp_path / "run"
  workdir.mkdir()
  check_config(str(workdir), run_cfg.to_json_best_effort(), fresh=True)
  trained = Qwen(TINY, rngs=nnx.Rngs(seed))
  _save_run_checkpoint(str(workdir / "checkpoints"), trained)
  return workdir, folder, trained


def _same_params(a, b):
  for x, y in zip(
    jax.tree.leaves(nnx.state(a, nnx.Param)), jax.tree.leaves(nnx.state(b, nnx.Param)), strict=True
  ):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("given", ["workdir", "checkpoints"])
def test_a_run_started_from_a_hf_folder_is_evaluated_with_that_folders_model(
  chat, tmp_path, monkeypatch, capsys, given
):
  """--config=cpu names the tiny_cpu preset (another shape, no eos ids); the run's config.json
  names the Hugging Face folder it started from. The checkpoint is rebuilt in the folder's shape
  (no mismatch) with the trained parameters, and replies stop at the folder's
  generation_config.json id 151643: the ground-truth replay scores 100%, where a stop set without
  it cuts every reply at the token limit (0%)."""
  from coevolve_jax.rollout import engine as engine_lib  # noqa: PLC0415

  workdir, folder, trained = _run_from_hf_folder(tmp_path)
  small = bfcl_config.get_config("cpu")
  small.engine.num_slots = 2
  assert small.model.checkpoint == "" and small.model.preset == "tiny_cpu"
  tasks = bfcl.load_bfcl_tasks("multi_turn_base")[:2]
  make = lambda t, e: make_episode(small, t, e, eval=True)  # noqa: E731
  built = []

  def engine(model, *a, **k):
    built.append(model)
    return _EndOfTextReplay(
      tasks, chat, make, 2, parse_call=bfcl.parse_call_string, max_steps_per_turn=3
    )

  monkeypatch.setattr(engine_lib, "Engine", engine)
  path = workdir if given == "workdir" else workdir / "checkpoints"
  report = evaluate.run(
    small,
    str(path),
    ["multi_turn_base"],
    max_tasks=2,
    policy="model",
    output=str(tmp_path / "report.json"),
    max_new_tokens=256,
  )
  (model,) = built
  assert model.config.hidden_size == TINY.hidden_size
  assert model.config.eos_token_ids == (151645, 151643)
  _same_params(model, trained)  # the orbax parameters, not the folder's safetensors
  rows = report["categories"]["multi_turn_base"]["entries"]
  assert [r["reward"] for r in rows] == [1.0, 1.0]
  assert all(r["generated_tokens"] < 256 * r["model_steps"] for r in rows)
  line = (
    f"model config: the run's {workdir / 'config.json'} (model.checkpoint={str(folder)!r}: shape "
    f"from its config.json, eos ids [151645, 151643] from its config.json and "
    f"generation_config.json); --config's model group differs in model.checkpoint ('' there): "
    f"the run's is used"
  )
  assert line in capsys.readouterr().err.splitlines()
  assert report["model_config"] == line
  assert small.model.checkpoint == ""  # the caller's config is not changed


def test_the_runs_preset_wins_over_the_configs(cfg, tmp_path, monkeypatch):
  """A run of one preset, --config naming another (of another depth): the run's config.json
  preset rebuilds the checkpoint; with that config.json gone, --config's preset is used (with a
  warning) and the checkpoint does not fit it: CheckpointMismatchError names the arrays."""
  from coevolve_jax.checkpoint import CheckpointMismatchError  # noqa: PLC0415
  from coevolve_jax.models.checkpoints import model_config_for_checkpoint  # noqa: PLC0415
  from coevolve_jax.workdir import check_config  # noqa: PLC0415

  shapes = {"tiny_cpu": TINY, "qwen3_0_6b": kit.tiny_config(num_hidden_layers=3)}
  monkeypatch.setattr(QwenConfig, "preset", classmethod(lambda cls, name: shapes[name]))
  trained = Qwen(TINY, rngs=nnx.Rngs(5))
  _save_run_checkpoint(str(tmp_path / "checkpoints"), trained)
  check_config(str(tmp_path), cfg.to_json_best_effort(), fresh=True)  # preset tiny_cpu
  other = bfcl_config.get_config("cpu")
  other.model.preset = "qwen3_0_6b"
  resolved, line = model_config_for_checkpoint(other, str(tmp_path / "checkpoints"))
  assert resolved.model.preset == "tiny_cpu" and other.model.preset == "qwen3_0_6b"
  assert "model.preset ('qwen3_0_6b' there): the run's is used" in line
  _same_params(evaluate.load_model(resolved, str(tmp_path)), trained)

  os.remove(tmp_path / "config.json")
  resolved, line = model_config_for_checkpoint(other, str(tmp_path))
  assert line.startswith(f"warning: {tmp_path / 'config.json'} does not exist, so the model is ")
  assert "model.preset='qwen3_0_6b'" in line and resolved.model.to_dict() == other.model.to_dict()
  with pytest.raises(CheckpointMismatchError, match=r"saved for another model: \d+ arrays differ"):
    evaluate.load_model(resolved, str(tmp_path))


def test_a_recorded_hf_folder_that_is_gone_is_one_error_line_and_exit_status_2(tmp_path):
  """The folder a run started from was deleted: the CLI says so in one `error:` line naming it
  and exits with status 2, no traceback (the run's config.json still names the folder)."""
  workdir, folder, _ = _run_from_hf_folder(tmp_path)
  shutil.rmtree(folder)
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "envs.bfcl.evaluate",
      "--config=configs/bfcl.py:cpu",
      f"--checkpoint={workdir}",
      "--categories=multi_turn_base",
      "--max_tasks=1",
    ],
    cwd=os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
  assert errors == [proc.stderr.strip().splitlines()[-1]]
  assert errors[0].startswith(
    f"error: {workdir / 'config.json'} records model.checkpoint={str(folder)!r}, a Hugging Face "
    "folder that no longer exists"
  )
  assert not (workdir / "eval_bfcl.json").exists()
