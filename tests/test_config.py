"""coevolve_jax.config.validate: the shipped configs and their variants pass; each bad field is a
ValueError whose message starts with the field's dotted name."""

import dataclasses
import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import ml_collections
import pytest

from coevolve_jax import config
from coevolve_jax import main as cli
from coevolve_jax.config import validate

_CONFIGS = os.path.join(os.path.dirname(__file__), os.pardir, "configs")


def _module(path):
  spec = importlib.util.spec_from_file_location(f"config_test_{os.path.basename(path)}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _get_config(name, variant=""):
  return _module(os.path.join(_CONFIGS, name)).get_config(variant)


def _set(cfg, field, value):
  *groups, name = field.split(".")
  node = cfg
  for g in groups:
    node = node[g]
  node[name] = value


@pytest.mark.parametrize("name", ["bfcl.py", "appworld.py"])
@pytest.mark.parametrize("variant", ["", "cpu", "paper"])
def test_shipped_configs_validate(name, variant):
  cfg = _get_config(name, variant)
  if variant != "cpu":
    cfg.model.checkpoint = "/some/hf/folder"
  validate(cfg)


def test_cpu_real_variant_starts_from_the_imported_smollm2_folder(tmp_path, monkeypatch):
  """`configs/bfcl.py:cpu_real`: the CPU preset on the real model `make real-model` caches, with
  no random fallback, and the generated set also evaluated before the warm-start."""
  from coevolve_jax.cli import import_model  # noqa: PLC0415

  monkeypatch.setenv("COEVOLVE_MODEL_CACHE", str(tmp_path))
  cfg = _get_config("bfcl.py", "cpu_real")
  assert cfg.model.checkpoint == str(tmp_path / import_model.SMOLLM2_NAME)
  assert not cfg.model.allow_random_init and cfg.eval.generated_before_warmstart
  assert cfg.eval.generated_tasks > 0 and cfg.warmstart.steps > 0
  validate(cfg)
  cpu = _get_config("bfcl.py", "cpu")
  assert not cpu.eval.generated_before_warmstart and cpu.model.checkpoint == ""


@pytest.mark.parametrize("name", ["bfcl.py", "appworld.py"])
@pytest.mark.parametrize("variant", ["", "paper"])
def test_full_scale_variants_refuse_random_weights_with_one_line(name, variant):
  """A full-scale run without a checkpoint would spend a pod training noise (issue 40 item 7):
  it is refused with one line naming both ways out; the CPU preset keeps its random tiny model."""
  cfg = _get_config(name, variant)
  with pytest.raises(ValueError, match="allow_random_init") as e:
    validate(cfg)
  assert "\n" not in str(e.value) and "model.checkpoint" in str(e.value)
  cfg.model.allow_random_init = True
  validate(cfg)
  assert _get_config(name, "cpu").model.allow_random_init


@pytest.mark.parametrize("name", ["bfcl.py", "appworld.py"])
@pytest.mark.parametrize("variant", ["", "cpu", "paper"])
def test_no_token_budget_caps_d0_or_a_round_by_default(name, variant):
  """The paper states no budget: D0 makes N tasks, a round explores every selected context
  (issue 40 item 1; the measured costs are in configs/base.py)."""
  ex = _get_config(name, variant).explore
  assert ex.d0_tokens == ex.gemini.tokens_per_round == ex.openai.tokens_per_round == 0


@pytest.mark.parametrize("name", ["bfcl.py", "appworld.py"])
def test_paper_variant_sets_the_papers_knobs_and_refuses_random_weights(name):
  cfg = _get_config(name, "paper")
  with pytest.raises(ValueError, match="allow_random_init"):
    validate(cfg)
  cfg.model.checkpoint = "/some/hf/folder"
  validate(cfg)
  if name == "bfcl.py":
    assert (cfg.episode.max_model_steps, cfg.bfcl.max_obs_tokens) == (30, 4096)
    assert cfg.bfcl.eval_size == cfg.eval.max_tasks == 200 and cfg.train.drop_from_loss == ()
    assert (cfg.explore.explorer, cfg.explore.openai.model) == ("openai", "qwen3-max")
  else:
    assert (cfg.appworld.max_steps, cfg.appworld.max_obs_tokens) == (30, 4096)
    assert cfg.appworld.fail_over_limit
    assert cfg.appworld.eval_split == "test_normal,test_challenge"
  assert cfg.feedback.max_contexts == 0


VARIANTS = [  # (config, variant, overrides): ablations and settings a run may use
  ("bfcl.py", "cpu", {"feedback.kinds": ("forgetting", "boundary")}),
  ("bfcl.py", "cpu", {"feedback.kinds": ()}),
  ("bfcl.py", "cpu", {"feedback.mode": "random"}),
  ("bfcl.py", "cpu", {"feedback.enabled": False, "feedback.validate": False}),
  ("bfcl.py", "cpu", {"feedback.concurrent": False, "feedback.lag": 0}),
  ("bfcl.py", "cpu", {"explore.explorer": "gemini", "explore.d0_explorer": "programmatic"}),
  ("bfcl.py", "cpu", {"explore.explorer": "local", "pool.synth_fraction": 0.5}),
  ("bfcl.py", "cpu", {"model.checkpoint": "/some/hf/folder", "model.preset": "unused"}),
  ("bfcl.py", "cpu", {"sampling.temperature": 0.0, "sampling.top_p": 0.9, "sampling.top_k": 20}),
  ("bfcl.py", "cpu", {"signals.pattern": "ngram:2"}),
  ("bfcl.py", "cpu", {"train.loss_agg": "seq-mean-token-sum-norm", "train.kl_estimator": "k1"}),
  ("bfcl.py", "cpu", {"train.scale_by_std": False, "train.dual_clip_c": 0.0, "train.kl_beta": 0.0}),
  ("bfcl.py", "cpu", {"train.mini_batches": 16, "train.micro_batches": 1}),
  ("bfcl.py", "cpu", {"train.mini_batches": 3, "train.micro_batches": 1}),  # sizes 6, 5, 5
  ("bfcl.py", "cpu", {"train.mini_batches": 2, "train.micro_batches": 4}),
  ("bfcl.py", "cpu", {"train.mini_batches": 3, "train.micro_batches": 0}),  # auto
  ("bfcl.py", "cpu", {"warmstart.steps": 0, "warmstart.lr": 0.0}),
  ("bfcl.py", "cpu", {"train.drop_from_loss": ("context", "error")}),
  ("bfcl.py", "", {"train.drop_from_loss": ("context", "max_model_steps", "error")}),
  ("bfcl.py", "", {"mesh.fsdp": 4, "mesh.tensor": -1}),
  ("bfcl.py", "", {"model.dtype": "float32", "bfcl.tool_style": "compact"}),
  ("appworld.py", "", {"appworld.split": "test_challenge", "appworld.reward": "pass_fraction"}),
  ("appworld.py", "cpu", {"appworld.build.templates": ("count_notes",)}),
  ("appworld.py", "cpu", {"episode.reproducible": False, "episode.decode_steps": 1}),
]


@pytest.mark.parametrize("name,variant,overrides", VARIANTS)
def test_variants_validate(name, variant, overrides):
  cfg = _get_config(name, variant)
  if variant != "cpu":  # full scale starts from a checkpoint
    cfg.model.checkpoint = "/some/hf/folder"
  for field, value in overrides.items():
    _set(cfg, field, value)
  validate(cfg)


def test_the_end_to_end_test_config_validates():
  e2e = _module(os.path.join(os.path.dirname(__file__), "test_main_e2e.py"))
  validate(e2e.small_config())


BAD = [  # (field, value); the bfcl cpu config (16 rollouts a step in 2 mini-batches; every = 3)
  ("env", "webshop"),
  ("seed", -1),
  ("bfcl.eval_size", -1),
  ("bfcl.max_obs_chars", 0),
  ("episode.max_call_chars", 0),
  ("episode.max_calls_per_reply", 0),
  ("bfcl.tool_style", "verbose"),
  ("bfcl.backends.call_wall_s", 0.0),
  ("bfcl.backends.call_wall_s", math.inf),
  ("bfcl.backends.worker_memory_mib", 100),
  ("bfcl.backends.workers", 0),
  ("model.preset", "qwen9_1t"),
  ("model.dtype", "int32"),
  ("model.dtype", "no_such_dtype"),
  ("model.remat", "save_everything"),
  ("mesh.fsdp", 0),
  ("mesh.data", -2),
  ("explore.explorer", "oracle"),
  ("explore.d0_explorer", "oracle"),
  ("explore.initial_tasks", 0),
  ("explore.min_calls", 0),
  ("explore.max_calls", 0),
  ("explore.turns_per_task", 0),
  ("explore.rounds", 0),
  ("explore.steps_per_round", 0),
  ("explore.d0_tokens", -1),
  ("explore.openai.tokens_per_round", -5),
  ("feedback.max_contexts", -1),
  ("bfcl.max_classes", -1),
  ("pool.near_dup_threshold", 1.5),
  ("pool.synth_fraction", 1.5),
  ("explore.local.dtype", "int8"),
  ("signals.window", 0),
  ("signals.rare_theta_percent", 101.0),
  ("signals.rare_min_total", -1),
  ("signals.pattern", "ngram:0"),
  ("signals.pattern", "bigram"),
  ("signals.success_threshold", 1.5),
  ("signals.forgetting", "mean"),
  ("signals.rare_min_count", 0),
  ("signals.rare_count", "patterns"),
  ("bfcl.max_obs_tokens", -1),
  ("warmstart.steps", -1),
  ("warmstart.batch_size", 0),
  ("warmstart.lr", 0.0),
  ("rollout.group_size", 1),
  ("rollout.tasks_per_step", 0),
  ("engine.num_slots", 0),
  ("engine.cache_len", 0),
  ("engine.max_prefill_tokens", 0),
  ("episode.max_new_tokens", 0),
  ("bfcl.max_steps_per_turn", 0),
  ("episode.max_model_steps", 0),
  ("sampling.temperature", -0.5),
  ("sampling.temperature", math.nan),
  ("sampling.top_k", -1),
  ("sampling.top_p", 0.0),
  ("sampling.top_p", 1.5),
  ("train.steps", 0),
  ("train.lr", 0.0),
  ("train.lr", math.inf),
  ("train.weight_decay", -0.1),
  ("train.grad_clip", 0.0),
  ("train.mini_batches", 0),
  ("train.mini_batches", 17),
  ("model.matmul_precision", "tf32"),
  ("train.micro_batches", -1),
  ("train.micro_batches", 3),
  ("train.kl_estimator", "k4"),
  ("train.loss_agg", "sum"),
  ("train.clip_eps_low", 1.0),
  ("train.clip_eps_high", -0.1),
  ("train.dual_clip_c", 0.5),
  ("train.kl_beta", -1e-3),
  ("train.loss_norm_tokens", 0.0),
  ("train.adv_eps", -1e-6),
  ("train.drop_from_loss", ("done",)),  # a scored episode is never dropped
  ("train.drop_from_loss", ("context", "timeout")),
  ("train.drop_from_loss", ("context,error",)),  # what --config...=context,error parses to
  ("train.replay_routing", None),
  ("feedback.kinds", ("rare", "novelty")),
  ("feedback.mode", "guided"),
  ("feedback.every", 0),
  ("feedback.lag", 3),
  ("feedback.lag", -1),
  ("eval.max_tasks", -1),
  ("eval.generated_tasks", -1),
  ("eval.max_new_tokens", 0),
  ("eval.max_steps_per_turn", 0),
  ("checkpoint.every", 0),
  ("checkpoint.keep", 0),
  ("engine.prefill_rows", "all"),
  ("engine.prefill_min_chunk", 48),  # not a power of two
  ("engine.prefill_min_chunk", 1024),  # longer than the longest chunk (512)
  ("engine.prefill_min_kv", 0),
  ("train.len_buckets", (2048,)),  # a 4,096-token trajectory would not fit
  ("train.len_buckets", ()),  # compile.ahead (on in the preset) needs a bounded set
  ("train.len_buckets", (2048, "4096")),
  ("train.target_buckets", (256,)),  # 6 replies x 64 tokens = 384 would not fit
  ("compile.threads", -1),
  ("compile.cache_dir", None),
]


def _raises_naming(cfg, field):
  with pytest.raises(ValueError, match=rf"^{re.escape(field)}[ :]") as e:
    validate(cfg)
  return str(e.value)


@pytest.mark.parametrize("field,value", BAD)
def test_a_bad_field_is_named(field, value):
  cfg = _get_config("bfcl.py", "cpu")
  _set(cfg, field, value)
  _raises_naming(cfg, field)


def test_owner_messages_keep_their_reason():
  cfg = _get_config("bfcl.py", "cpu")
  cfg.signals.pattern = "ngram:0"
  assert "'tool_sequence' or 'ngram:N'" in _raises_naming(cfg, "signals.pattern")
  cfg = _get_config("bfcl.py", "cpu")
  cfg.feedback.kinds = ("rare", "novelty")
  assert "unknown signal kinds ['novelty']" in _raises_naming(cfg, "feedback.kinds")
  cfg = _get_config("bfcl.py", "cpu")
  cfg.train.micro_batches = 3
  assert "16 rollouts in 2 mini-batches of [8]" in _raises_naming(cfg, "train.micro_batches")


def test_two_mesh_axes_of_minus_one_and_a_missing_field():
  cfg = _get_config("bfcl.py")
  cfg.model.checkpoint = "/some/hf/folder"
  cfg.mesh.data = -1  # fsdp is -1 already
  _raises_naming(cfg, "mesh")
  cfg = _get_config("bfcl.py", "cpu")
  del cfg.train["adv_eps"]
  assert "is missing" in _raises_naming(cfg, "train.adv_eps")


APPWORLD_BAD = [  # the appworld cpu config: generated worlds, 10 scenarios
  ("appworld.reward", "partial"),
  ("appworld.source", "cloud"),
  ("appworld.split", "test_challenge"),  # official only
  ("appworld.eval_split", "holdout"),
  ("appworld.eval_split", "test_normal,holdout"),
  ("appworld.eval_split", "test_normal,test_normal"),  # would evaluate twice
  ("appworld.max_obs_tokens", -1),
  ("appworld.server_urls", ()),
  ("appworld.timeout_s", 0.0),
  ("appworld.startup_timeout_s", -1.0),
  ("appworld.exec_timeout_s", 0),
  ("appworld.max_steps", 0),
  ("appworld.max_obs_chars", 0),
  ("appworld.build.num_scenarios", 0),
  ("appworld.build.tasks_per_scenario", 0),
  ("appworld.build.eval_scenarios", 10),
  ("appworld.build.templates", ("no_such_template",)),
  ("eval.generated_tasks", 4),  # needs an LLM explorer for D0 on AppWorld (this preset's: none)
]


@pytest.mark.parametrize("field,value", APPWORLD_BAD)
def test_a_bad_appworld_field_is_named(field, value):
  cfg = _get_config("appworld.py", "cpu")
  _set(cfg, field, value)
  _raises_naming(cfg, field)


def test_validate_starts_no_jax_backend():
  """Safe before jax.distributed.initialize: nothing is computed on a device."""
  code = (
    "import importlib.util, sys\n"
    "from jax._src import xla_bridge\n"
    "from coevolve_jax.config import validate\n"
    f"spec = importlib.util.spec_from_file_location('c', {os.path.join(_CONFIGS, 'bfcl.py')!r})\n"
    "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
    "validate(m.get_config('cpu'))\n"
    "assert not xla_bridge.backends_are_initialized()\n"
    "print('no backend')\n"
  )
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "no backend" in proc.stdout


def test_drop_from_loss_from_the_command_line():
  """The tuple is written as a Python literal; its default keeps every episode (the paper)."""
  from absl import flags  # noqa: PLC0415
  from ml_collections import config_flags  # noqa: PLC0415

  assert _get_config("bfcl.py").train.drop_from_loss == ()
  assert _get_config("appworld.py", "cpu").train.drop_from_loss == ()
  argv = [
    "main",
    f"--config={os.path.join(_CONFIGS, 'bfcl.py')}:cpu",
    "--config.train.drop_from_loss=('context', 'error')",
  ]
  fv = flags.FlagValues()  # as coevolve_jax/main.py declares --config, on a private registry
  config_flags.DEFINE_config_file(
    "config", None, "", flag_values=fv, lock_config=True, sys_argv=argv
  )
  fv(argv)
  assert fv.config.train.drop_from_loss == ("context", "error")
  validate(fv.config)


@pytest.mark.parametrize(
  "old,new",
  [
    ("rollout.temperature", "sampling.temperature"),
    ("rollout.num_slots", "engine.num_slots"),
    ("rollout.max_new_tokens", "episode.max_new_tokens"),
    ("data.tool_style", "bfcl.tool_style"),
    ("backends.workers", "bfcl.backends.workers"),
    ("explore.only_classes", "bfcl.only_classes"),
  ],
)
def test_a_field_that_moved_is_one_error_naming_the_new_field(old, new):
  """Each group has one consumer; a config file written for the old layout (a field left in
  its old group) and a command-line override of the old name both name the new field (the
  command line's line as `coevolve_jax.main` prints it; the command itself below)."""
  assert config.MOVED[old] == new
  cfg = _get_config("bfcl.py", "cpu")
  group, name = old.split(".")
  with cfg.unlocked():
    if group not in cfg:
      cfg[group] = ml_collections.ConfigDict()
    cfg[group][name] = 1
  with pytest.raises(ValueError, match=rf"^config field {re.escape(old)} is now {re.escape(new)}"):
    validate(cfg)
  assert cli._moved_overrides(["--workdir=w", f"--config.{old}=1", "--config.train.steps=2"]) == [
    f"error: --config.{old}: config field {old} is now {new} (fields were regrouped by consumer)"
  ]


def test_an_override_of_a_field_that_moved_stops_the_command_with_one_error_line(tmp_path):
  old, new = "rollout.temperature", "sampling.temperature"
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "coevolve_jax.main",
      f"--config={os.path.join(_CONFIGS, 'bfcl.py')}:cpu",
      f"--workdir={tmp_path}",
      f"--config.{old}=1",
    ],
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 2 and proc.stdout == ""
  assert proc.stderr.strip().splitlines() == [
    f"error: --config.{old}: config field {old} is now {new} (fields were regrouped by consumer)"
  ]


def test_each_benchmark_config_holds_only_its_own_group():
  """The shared groups come from configs/base.py; BFCL's fields are in `bfcl` and AppWorld's in
  `appworld`, and neither config carries the other's (nothing inherited and blanked)."""
  bfcl, appworld = _get_config("bfcl.py", "cpu"), _get_config("appworld.py", "cpu")
  assert "bfcl" in bfcl and "appworld" not in bfcl
  assert "appworld" in appworld and "bfcl" not in appworld
  assert set(bfcl) - {"bfcl"} == set(appworld) - {"appworld"}
  assert {"data", "backends"}.isdisjoint(set(bfcl) | set(appworld))
  assert set(bfcl.rollout) == {"group_size", "tasks_per_step"}


def test_top_k_above_the_models_vocabulary_is_refused_at_start_up(tmp_path):
  """`sampling.top_k` beyond the vocabulary used to pass and crash the first rollout (in
  `jax.lax.top_k`, 252 s in, after the first checkpoint); it is now a start-up error that names
  the vocabulary: the preset's, or the checkpoint's config.json."""
  from coevolve_jax.models import QwenConfig
  from coevolve_jax.models.hf import hf_config

  cfg = _get_config("bfcl.py", "cpu")
  vocab = QwenConfig.preset(cfg.model.preset).vocab_size
  cfg.sampling.top_k = vocab  # every id: allowed (the same as off)
  validate(cfg)
  cfg.sampling.top_k = 200_000
  assert f"vocabulary ({vocab} ids" in _raises_naming(cfg, "sampling.top_k")

  small = dataclasses.replace(QwenConfig.preset(cfg.model.preset), vocab_size=1000)
  (tmp_path / "config.json").write_text(json.dumps(hf_config(small)))
  cfg.model.checkpoint = str(tmp_path)
  cfg.sampling.top_k = 1001
  assert "vocabulary (1000 ids" in _raises_naming(cfg, "sampling.top_k")
  cfg.model.checkpoint = str(tmp_path / "missing")  # unreadable: the model's loading reports it
  validate(cfg)


def test_master_weights_in_another_dtype_than_float32_are_said_with_the_reason():
  """The warning's arithmetic holds: a relative update of 1e-6 is lost in bfloat16 and kept in
  float32; float32 gets no warning."""
  import jax.numpy as jnp

  from coevolve_jax.config import param_dtype_warning

  assert param_dtype_warning("float32") is None
  said = param_dtype_warning("bfloat16")
  assert said is not None and "bfloat16" in said and "round to no change" in said
  one = jnp.ones((), jnp.bfloat16)
  assert one - jnp.bfloat16(1e-6) == one  # what it warns of
  assert jnp.float32(1) - jnp.float32(1e-6) != jnp.float32(1)


def test_qevolve_settings_are_checked():
  """Q-Evolve's fields are checked when it is off too; on, it runs with the default estimator and
  without WIA (both replace the advantages)."""
  for field, value, named in [
    ("qevolve.tau", 1.0, "qevolve"),
    ("qevolve.mode", "offline", "qevolve"),
    ("qevolve.hidden", 0, "qevolve"),
    ("train.advantage_estimator", "qevolve", "train.advantage_estimator"),
  ]:
    cfg = _get_config("bfcl.py", "cpu")
    _set(cfg, field, value)
    assert field.split(".")[-1] in _raises_naming(cfg, named)
  cfg = _get_config("bfcl.py", "cpu")
  cfg.qevolve.enabled = True
  validate(cfg)
  cfg.qevolve.mode = "iterate"
  validate(cfg)
  cfg.role_agent.wia.enabled = True
  assert "both replace the advantages" in _raises_naming(cfg, "qevolve.enabled")
