"""CoEvolve on AppWorld. Variants: `configs/appworld.py` (full scale), `configs/appworld.py:cpu`.

Same groups and field names as `configs/bfcl.py`; AppWorld-specific fields live in `c.appworld`.
Every field is overridable from the command line, e.g. `--config.appworld.data_root=/data/appworld`.

AppWorld runs in its own virtual environment as HTTP servers (`appworld serve environment`),
because its pins (pydantic < 2) conflict with ours (SPEC section 3). `envs.appworld.check_available`
verifies the servers and the data before anything else starts and says exactly what to install or
start. Training on AppWorld beyond that check is not implemented yet (tracked in its own issue).
"""

import os

import ml_collections

DEFAULT_SERVER_URL = "http://127.0.0.1:8000"  # `appworld serve environment` default port is 8000


def _server_urls_from_env() -> tuple[str, ...]:
  """APPWORLD_SERVER_URLS (comma-separated) or the single default loopback URL.

  A tuple, not a list: ml_collections can override tuples from the command line
  (`--config.appworld.server_urls="('http://127.0.0.1:8000', 'http://127.0.0.1:8001')"`), not lists.
  """
  raw = os.environ.get("APPWORLD_SERVER_URLS", "")
  urls = tuple(u.strip() for u in raw.split(",") if u.strip())
  return urls or (DEFAULT_SERVER_URL,)


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0  # one seed for data split, exploration, sampling and init
  c.env = "appworld"

  c.appworld = ml_collections.ConfigDict()
  # One world per server process: scale with several servers on different loopback ports.
  c.appworld.server_urls = _server_urls_from_env()
  c.appworld.data_root = os.environ.get("APPWORLD_ROOT", "")  # holds data/tasks, data/datasets
  c.appworld.split = "train"  # data/datasets/<split>.txt: train|dev|test_normal|test_challenge
  c.appworld.eval_split = "test_normal"  # the paper's evaluation split (168 tasks)
  c.appworld.timeout_s = 60.0  # per HTTP request to a server; the availability check uses <= 2 s

  c.data = ml_collections.ConfigDict()
  c.data.category = ""  # unused for AppWorld (BFCL only); see c.appworld.split / eval_split
  c.data.eval_size = 168  # evaluation tasks taken from c.appworld.eval_split (test_normal has 168)
  c.data.tool_style = "full"  # API docs in the prompt: "full" or "compact"
  c.data.max_obs_chars = 16384  # environment output truncation (~4096 tokens)

  c.model = ml_collections.ConfigDict()
  c.model.preset = "qwen3_4b"  # QwenConfig preset name
  c.model.checkpoint = ""  # Hugging Face folder with safetensors; "" = random init
  c.model.dtype = "bfloat16"

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = 1
  c.mesh.fsdp = -1  # -1 = all remaining devices
  c.mesh.tensor = 1
  c.mesh.expert = 1

  c.explore = ml_collections.ConfigDict()
  c.explore.explorer = "programmatic"  # "programmatic" | "gemini" | "local"
  c.explore.initial_tasks = 100  # |D0| (paper N = 100)
  c.explore.min_calls = 3  # minimal action sequence length of a synthesized task
  c.explore.max_calls = 6
  c.explore.turns_per_task = 1  # AppWorld tasks are single-instruction
  c.explore.rounds = 4  # exploration runs per context (parent default)
  c.explore.steps_per_round = 18  # actions per run
  c.explore.max_contexts_per_round = 32  # marked trajectories explored per feedback round
  c.explore.near_dup_threshold = 0.8  # MinHash Jaccard above which a task is a near-duplicate
  c.explore.synth_fraction = -1.0  # share of synthesized tasks when sampling; -1 = proportional

  c.signals = ml_collections.ConfigDict()
  c.signals.window = 5  # W, last task scores kept for forgetting
  c.signals.rare_theta_percent = 5.0  # theta
  c.signals.rare_min_total = 50  # N_min
  c.signals.pattern = "tool_sequence"  # or "ngram:N"

  c.warmstart = ml_collections.ConfigDict()
  c.warmstart.steps = 0  # supervised steps on validated D0 solutions before RL (0 = off)
  c.warmstart.batch_size = 8
  c.warmstart.lr = 1e-5

  c.rollout = ml_collections.ConfigDict()
  c.rollout.group_size = 8  # G
  c.rollout.tasks_per_step = 32
  c.rollout.temperature = 0.9
  c.rollout.top_p = 1.0
  c.rollout.top_k = 0
  c.rollout.num_slots = 64  # concurrent episodes (decode slots)
  c.rollout.cache_len = 32768  # tokens per episode (prompt + all turns)
  c.rollout.max_new_tokens = 4096  # per model reply
  c.rollout.max_steps_per_turn = 30  # one instruction per task: the whole episode (paper: 30 steps)
  c.rollout.max_model_steps = 30

  c.train = ml_collections.ConfigDict()
  c.train.steps = 120
  c.train.lr = 1e-6
  c.train.weight_decay = 0.01
  c.train.grad_clip = 1.0
  c.train.mini_batches = 4  # optimizer updates per step (1 epoch over the step's rollouts)
  c.train.clip_eps_low = 0.20
  c.train.clip_eps_high = 0.28
  c.train.dual_clip_c = 3.0
  c.train.kl_beta = 1e-3
  c.train.kl_estimator = "k3"
  c.train.loss_agg = "token-mean"

  c.feedback = ml_collections.ConfigDict()
  c.feedback.every = 10  # F: a feedback round every F steps
  c.feedback.enabled = True

  c.eval = ml_collections.ConfigDict()
  c.eval.max_tasks = 168  # eval_split tasks evaluated greedily before and after training
  c.eval.max_new_tokens = 4096
  c.eval.max_steps_per_turn = 30

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 10
  c.checkpoint.keep = 3

  if variant == "cpu":
    _cpu(c)
  elif variant:
    raise ValueError(f"unknown variant {variant!r} (known: cpu)")
  return c


def _cpu(c: ml_collections.ConfigDict) -> None:
  """Small sizes for CPU (mirrors configs/bfcl.py:cpu); still needs AppWorld servers and data."""
  c.model.preset = "tiny_cpu"
  c.model.dtype = "float32"
  c.appworld.timeout_s = 30.0
  c.data.eval_size = 20
  c.data.tool_style = "compact"
  c.data.max_obs_chars = 600
  c.explore.initial_tasks = 24
  c.explore.min_calls = 3
  c.explore.max_calls = 3
  c.explore.rounds = 2
  c.explore.steps_per_round = 8
  c.explore.max_contexts_per_round = 6
  c.signals.rare_min_total = 16
  c.warmstart.steps = 150
  c.warmstart.batch_size = 8
  c.warmstart.lr = 3e-3
  c.rollout.group_size = 4
  c.rollout.tasks_per_step = 4
  c.rollout.num_slots = 16
  c.rollout.cache_len = 4096
  c.rollout.max_new_tokens = 64
  c.rollout.max_steps_per_turn = 6
  c.rollout.max_model_steps = 6
  c.train.steps = 6
  c.train.lr = 3e-5
  c.train.mini_batches = 2
  c.feedback.every = 3
  c.eval.max_tasks = 8
  c.eval.max_new_tokens = 64
  c.eval.max_steps_per_turn = 3
  c.checkpoint.every = 2
