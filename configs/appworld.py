"""CoEvolve on AppWorld: the shared groups and defaults of configs/base.py with `c.env =
"appworld"` and the AppWorld fields in `c.appworld` (read by envs/appworld/suite.py, the suite the
loop builds for it).

Variants:
  `configs/appworld.py` (full scale): the shared full-scale groups (Qwen3-4B shape, G = 8, ...) on
    the official AppWorld data (`appworld.source = "official"`: `appworld download data` under
    `appworld.data_root`, default $APPWORLD_ROOT; evaluation on the 168 tasks of
    `appworld.eval_split` = test_normal; 10 code replies per training episode, 30 per evaluation
    episode). All three stages run as the paper's: D0 is `explore.initial_tasks` tasks made by
    unguided LLM exploration of the `appworld.split` worlds (their human-written instructions
    are never used unless `appworld.d0 = "official"`, a baseline), and every feedback round
    explores the marked tasks' worlds under the signals' guidance; abstracted tasks are derived
    from those worlds (envs/appworld/world.py `derive_task`: their reference code's answer and
    database changes become their evaluation) into an overlay of the data under the workdir
    (the official data folder is never written to) and validated by execution plus an LLM
    agent's attempt and the judge. Every candidate context is explored (`feedback.max_contexts
    = 0`), in runs of 30 steps, into tasks of 3 to 18 code steps (`explore.min_calls` /
    `max_calls`; the paper's own AppWorld example has 11). The explorer, abstractor and judge:
    `explore.explorer` (gemini by default).
  `configs/appworld.py:cpu`: the shared CPU preset on generated worlds (`appworld.source =
    "generated"`: worlds built offline from AppWorld's shipped app models and factories, under
    <workdir>/appworld_root, no download), 10 scenarios x 2 worlds with the last 2 scenarios held
    out as test_normal, 2 code replies per episode, shorter observations and replies, up to 12
    D0 tasks (each validated by running its solution) with the CPU preset's warm-start on their
    solutions, and 4 evaluation tasks. Feedback rounds build and validate new worlds of the marked
    tasks' families (up to `feedback.max_contexts` = 3 per round). With an LLM explorer
    (`--config.explore.explorer=openai` and a base_url, or gemini) the generated worlds go
    through the same LLM path as official data.

  `configs/appworld.py:paper`: the full scale with every knob the paper states (30 steps per
    episode, over the limit = failure, observations cut at 4,096 tokens, evaluation on
    test_normal and test_challenge with TGC / SGC per split, as the paper's Table 1); refuses to
    start without `model.checkpoint`.

Any other variant name is refused. Every field is overridable from the
command line, e.g. `--config.appworld.source=generated` or `--config.appworld.data_root=DIR`.

AppWorld runs in its own virtual environment (`appworld.venv`, default .venv-appworld, made by
`make appworld-setup`) because its pins (pydantic < 2) conflict with ours (docs/appworld.md). The
run starts and stops its own AppWorld servers on 127.0.0.1, one per rollout slot plus one for the
feedback round, and `envs.appworld.suite.check_setup` stops it at once, with the set-up steps,
when that environment (or, for "official", the data) is missing. `appworld.server_urls` (default
$APPWORLD_SERVER_URLS or 127.0.0.1:8000) is read only by `envs.appworld.client.check_available`, the
check for servers started by hand (`appworld serve environment`).
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


# `configs/NAME.py:VARIANT` (no variant: full scale); `python -m coevolve_jax.main --help` lists
# them.
VARIANTS = ("cpu", "paper")


def _base():
  """configs/base.py, loaded by path: the groups and defaults every benchmark shares."""
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "base.py")
  spec = importlib.util.spec_from_file_location("coevolve_configs_base", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  """The shared groups and defaults, with AppWorld's environment fields."""
  if variant and variant not in VARIANTS:
    raise ValueError(f"unknown variant {variant!r} (known: {', '.join(VARIANTS)})")
  base = _base()
  c = base.get_config()
  c.env = "appworld"
  if variant == "cpu":
    base.cpu(c)
  elif variant == "paper":
    base.paper(c)

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
  # Address-space limit of each server process, MiB (RLIMIT_AS; 0 = none): code the model writes
  # runs there, and an allocation past it is a MemoryError in that episode, not the machine's
  # memory. An idle server maps ~300 MiB.
  c.appworld.server_memory_mib = 4096
  c.appworld.exec_timeout_s = 20  # AppWorld's own limit per code execution, seconds
  c.appworld.max_steps = 10  # code replies per training episode
  # True: an episode at max_steps without complete_task scores 0 (the paper's rule); False: it
  # is graded on its end state.
  c.appworld.fail_over_limit = False
  c.appworld.max_obs_chars = 4000  # execution output shown to the model, characters
  c.appworld.max_obs_tokens = 0  # > 0: cut it at this many Qwen tokens instead (paper: 4096)
  c.appworld.reward = "binary"  # "binary" (task goal completion) | "pass_fraction" (tests passed)
  c.appworld.build = ml_collections.ConfigDict()  # generated worlds (source = "generated")
  c.appworld.build.num_scenarios = 40  # scenarios; each is one task family, several worlds
  c.appworld.build.tasks_per_scenario = 3  # worlds (tasks) per scenario, as SGC groups them
  c.appworld.build.eval_scenarios = 8  # the last scenarios form test_normal (held out)
  c.appworld.build.templates = ()  # task families (envs/appworld/world.py TEMPLATES; () = all)
  c.appworld.build.num_people = 3  # people per world (each with a Simple Note account)
  c.appworld.build.num_notes = 5  # the supervisor's notes per world

  # D0 (paper Sec. 3.1): "explore" = exploration of the training worlds (by the LLM explorer of
  # explore.explorer / explore.d0_explorer; on generated worlds the programmatic explorer's
  # template tasks), "official" = the split's human-written tasks as they are (a baseline).
  c.appworld.d0 = "explore"
  # The explorer, abstractor and judge are the shared config's: an LLM at full scale (gemini; the
  # paper variant the OpenAI-compatible endpoint of Qwen3-Max), programmatic in the CPU preset.
  if variant == "cpu":  # generated worlds; one code reply solves a task (~150 tokens)
    c.appworld.build.num_scenarios = 10
    c.appworld.build.tasks_per_scenario = 2
    c.appworld.build.eval_scenarios = 2
    c.appworld.max_steps = 2
    c.appworld.max_obs_chars = 600
    c.feedback.max_contexts = 3  # contexts turned into new worlds per round
    c.explore.initial_tasks = 12
    c.engine.num_slots = 8
    c.episode.max_new_tokens = 256
    c.episode.max_model_steps = 2
    c.train.target_buckets = (256, 512)  # two replies of up to 256 tokens (compile.ahead's bound)
    c.eval.max_tasks = 4
    c.eval.max_new_tokens = 256
    c.eval.max_steps_per_turn = 2  # AppWorld: code replies per evaluation episode
    # The generated held-out set needs an LLM explorer on AppWorld (the programmatic one's D0
    # tasks are the worlds themselves): off in this preset.
    c.eval.generated_tasks = 0
    c.eval.pool_after = False
  if variant != "cpu":
    # Every candidate context per round (the paper's reading; one per (task, signal kind)).
    c.feedback.max_contexts = 0
    # Up to 18 code steps per derived task (the paper's own AppWorld example has 11), from runs of
    # 30 steps (the parent's upper bound): steps that raise are not triplets, so a run needs room
    # beyond a task's steps. The validating attempt gets max_calls + 1 replies at least.
    c.explore.max_calls = 18
    c.explore.steps_per_round = 30
    c.eval.max_tasks = 168  # evaluation tasks of c.appworld.eval_split (test_normal has 168)
    c.eval.max_steps_per_turn = 30  # AppWorld episodes are single-instruction, up to 30 steps
  if variant == "paper":  # every knob the paper states (docs/design.md §1.6)
    c.appworld.max_steps = 30  # 30 steps per training episode; over the limit = failure
    c.appworld.fail_over_limit = True
    c.appworld.max_obs_tokens = 4096  # observations cut at 4,096 tokens
    c.appworld.eval_split = "test_normal,test_challenge"  # both of the paper's test splits
    c.eval.max_tasks = 585  # 168 + 417 tasks, TGC / SGC per split (and their blend)
  return c
