"""CoEvolve on AppWorld. Variants: `configs/appworld.py` (full scale), `configs/appworld.py:cpu`.

Same groups and field names as `configs/bfcl.py`; AppWorld-specific fields live in `c.appworld`.
Every field is overridable from the command line, e.g. `--config.appworld.data_root=/data/appworld`.

AppWorld runs in its own virtual environment as HTTP servers (`appworld serve environment`),
because its pins (pydantic < 2) conflict with ours (SPEC section 3). `envs.appworld.check_available`
verifies the servers and the data before anything else starts and says exactly what to install or
start. Training on AppWorld beyond that check is not implemented yet (tracked in its own issue).
"""

import importlib.util
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


def _bfcl_module():
  """configs/bfcl.py, loaded by path: the groups and defaults both environments share."""
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bfcl.py")
  spec = importlib.util.spec_from_file_location("coevolve_configs_bfcl", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  """The BFCL config's groups and defaults, with AppWorld's environment fields."""
  c = _bfcl_module().get_config(variant)
  c.env = "appworld"

  c.appworld = ml_collections.ConfigDict()
  # One world per server process: scale with several servers on different loopback ports.
  c.appworld.server_urls = _server_urls_from_env()
  c.appworld.data_root = os.environ.get("APPWORLD_ROOT", "")  # holds data/tasks, data/datasets
  c.appworld.split = "train"  # data/datasets/<split>.txt: train|dev|test_normal|test_challenge
  c.appworld.eval_split = "test_normal"  # the paper's evaluation split (168 tasks)
  c.appworld.timeout_s = 30.0 if variant == "cpu" else 60.0  # per HTTP request to a server
  # Where tasks come from: "official" (appworld download data under data_root) or "generated"
  # (worlds built offline from the shipped app models and factories, under <workdir>).
  c.appworld.source = "generated" if variant == "cpu" else "official"
  c.appworld.venv = ""  # AppWorld's own virtual environment ("" = .venv-appworld in the repo)
  c.appworld.startup_timeout_s = 120.0  # per server start (first health check)
  c.appworld.exec_timeout_s = 20  # AppWorld's own limit per code execution, seconds
  c.appworld.max_steps = 10  # code replies per training episode before it is graded anyway
  c.appworld.max_obs_chars = 4000  # execution output shown to the model, characters
  c.appworld.reward = "binary"  # "binary" (task goal completion) | "pass_fraction" (tests passed)
  c.appworld.build = ml_collections.ConfigDict()  # generated worlds (source = "generated")
  c.appworld.build.num_scenarios = 40  # scenarios; each is one task family, several worlds
  c.appworld.build.tasks_per_scenario = 3  # worlds (tasks) per scenario, as SGC groups them
  c.appworld.build.eval_scenarios = 8  # the last scenarios form test_normal (held out)
  c.appworld.build.templates = ()  # task families (envs/appworld/world.py TEMPLATES; () = all)
  c.appworld.build.num_people = 3  # people per world (each with a Simple Note account)
  c.appworld.build.num_notes = 5  # the supervisor's notes per world

  c.data.category = ""  # unused for AppWorld (BFCL only); see c.appworld.split / eval_split
  c.explore.only_classes = ()  # BFCL backends: not used for AppWorld
  if variant == "cpu":  # generated worlds; one code reply solves a task (~150 tokens)
    c.appworld.build.num_scenarios = 10
    c.appworld.build.tasks_per_scenario = 2
    c.appworld.build.eval_scenarios = 2
    c.appworld.max_steps = 2
    c.appworld.max_obs_chars = 600
    c.feedback.max_contexts = 3  # contexts turned into new worlds per round
    c.explore.initial_tasks = 12
    c.rollout.num_slots = 8
    c.rollout.max_new_tokens = 256
    c.rollout.max_model_steps = 2
    c.eval.max_tasks = 4
    c.eval.max_new_tokens = 256
    c.eval.max_steps_per_turn = 2  # AppWorld: code replies per evaluation episode
  if variant != "cpu":
    c.feedback.max_contexts = 8  # each context builds and validates a new world
    c.data.eval_size = 168  # evaluation tasks from c.appworld.eval_split (test_normal has 168)
    c.eval.max_tasks = 168
    c.eval.max_steps_per_turn = 30  # AppWorld episodes are single-instruction, up to 30 steps
  return c
