"""CoEvolve on BFCL multi-turn. Variants: `configs/bfcl.py` (full scale), `configs/bfcl.py:cpu`
(2 CPU cores, a random tiny model), `configs/bfcl.py:cpu_real` (2 CPU cores, the real
SmolLM2-135M-Instruct that `make real-model` imports), `configs/bfcl.py:paper` (full scale with
every knob the paper states; needs `model.checkpoint`).

The shared groups and defaults are configs/base.py's; BFCL's own fields are the `bfcl` group
(read by envs/bfcl/suite.py). Every field is overridable from the command line, e.g.
`--config.train.lr=1e-6`.
"""

import importlib.util
import os

import ml_collections


# `configs/NAME.py:VARIANT` (no variant: full scale); `python -m coevolve_jax.main --help` lists
# them.
VARIANTS = ("cpu", "cpu_real", "paper")


def _base():
  """configs/base.py, loaded by path (config files are loaded by path, not as a package)."""
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "base.py")
  spec = importlib.util.spec_from_file_location("coevolve_configs_base", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  base = _base()
  c = base.get_config()
  c.env = "bfcl"

  c.bfcl = b = ml_collections.ConfigDict()
  b.category = "multi_turn_base"  # BFCL category whose entries supply states and eval tasks
  b.eval_size = 50  # held-out evaluation entries (seeded split; training never sees them)
  b.tool_style = "full"  # tool docs in the prompt: "full" (BFCL text) or "compact"
  b.max_obs_chars = 16384  # environment output truncation (~4096 tokens)
  b.max_obs_tokens = 0  # > 0: cut outputs at this many Qwen tokens instead (paper: 4096)
  # BFCL category whose entries' environment states D0 and the feedback rounds explore ("" = the
  # training split of bfcl.category); set when every entry of bfcl.category is held out.
  b.explore_category = ""
  b.max_steps_per_turn = 20  # model steps per user turn in a training episode
  # Wall-clock seconds the tool calls of one model reply share (each call is also bounded by
  # backends.call_wall_s); once spent, the reply's remaining calls are not run and each gets an
  # error observation. BFCL calls take milliseconds, so honest replies never come near it; 20 s
  # (twice call_wall_s) leaves room for one call stopped at its bound, and caps a reply of many
  # slow calls at about 30 s (budget + one call) instead of n x call_wall_s (~18 min for the ~100
  # calls that fit in 4096 tokens).
  b.reply_wall_s = 20.0
  b.max_classes = 0  # backend classes per D0 context (0 = all of the entry's)
  b.only_classes = ()  # explore only these BFCL backends for D0 (empty = all)
  # Bounds on BFCL backend execution (envs/bfcl/backends.py): every tool call of an episode, an
  # explorer or validation sandbox and the official checker runs in a worker process. A call over
  # a bound is stopped (error observation, no effect) and its worker replaced.
  b.backends = ml_collections.ConfigDict()
  b.backends.call_wall_s = 10.0  # wall-clock seconds per call (a replay or check of n calls: n+1x)
  b.backends.worker_memory_mib = 4096  # address-space limit (RLIMIT_AS) of each worker, MiB
  b.backends.workers = 4  # worker processes (episodes are spread over them; 4 = env threads)

  if variant in ("cpu", "cpu_real"):
    base.cpu(c)
    _cpu(c)
    if variant == "cpu_real":
      _cpu_real(c)
  elif variant == "paper":
    base.paper(c)
    _paper(c)
  elif variant:
    raise ValueError(f"unknown variant {variant!r} (known: {', '.join(VARIANTS)})")
  return c


def _paper(c: ml_collections.ConfigDict) -> None:
  """BFCL's part of the paper's settings (docs/design.md §1.6: setting -> field)."""
  c.bfcl.max_obs_tokens = 4096  # observations cut at 4,096 tokens
  # Evaluation on all 200 multi_turn_base entries (paper Table 3); exploration then uses the
  # environment states of multi_turn_miss_param, the same backends' entries with one parameter
  # left out of the question (paper silent on which states BFCL's D0 explores).
  c.bfcl.eval_size = 200
  c.eval.max_tasks = 200
  c.bfcl.explore_category = "multi_turn_miss_param"


def _cpu(c: ml_collections.ConfigDict) -> None:
  """BFCL's part of the CPU preset (~15 minutes on 2 cores)."""
  c.bfcl.eval_size = 20
  c.bfcl.tool_style = "compact"
  c.bfcl.max_obs_chars = 600
  c.bfcl.backends.workers = 2  # one per core
  c.bfcl.max_classes = 1  # one backend per D0 task
  # The two backends with the shortest tool lists (~600 prompt tokens of tools): a training
  # sequence then fits in ~1k tokens, which is what makes the warm-start affordable on 2 cores.
  c.bfcl.only_classes = ("MessageAPI", "TicketAPI")
  c.bfcl.max_steps_per_turn = 5


def _cpu_real(c: ml_collections.ConfigDict) -> None:
  """The CPU preset with a real language model: SmolLM2-135M-Instruct (Llama architecture, 30
  layers, ChatML tokenizer), imported once by `make real-model` into the model cache. Zero-shot
  it writes almost no parseable tool call, so the warm-start on D0's demonstrations teaches the
  format first (docs/ablations.md, "A policy that can read"). Sized for about an hour on 2 cores:
  a 30-layer forward and backward costs ~60x the tiny model's per token.
  """
  from coevolve_jax.cli.import_model import smollm2_folder  # noqa: PLC0415 (stdlib only)

  c.model.checkpoint = str(smollm2_folder())
  c.model.allow_random_init = False
  c.model.remat = "full"  # 30 layers: keep only each layer's input for the backward pass
  # The warm-start must teach the tool format without memorising D0: 16 steps over D0's 11
  # demonstrations (2026-12-05) took the generated set's tool-call rate from 0.0 to 0.67 and its
  # success from 0 to 5 of 8, but drove the loss to 8e-4, and GRPO step 1 then solved every
  # rollout (no group with mixed rewards, nothing to learn). So a D0 of 24 and 10 steps of 4
  # (~1.7 passes; ~45 s a step of ~1k-token demonstrations on 2 cores).
  c.explore.initial_tasks = 24
  c.warmstart.steps = 10
  c.warmstart.lr = 2e-4
  c.rollout.tasks_per_step = 2
  c.engine.num_slots = 8
  c.train.lr = 1e-5
  c.train.mini_batches = 1
  # Rounds that GRPO acts on within 6 steps of 2 tasks. With the CPU preset's clock (a round
  # every 3 steps, joining one step later) and a proportional draw, CoEvolve seed 0 (2026-12-06)
  # accepted 5 synthesized tasks and trained on none of them: round 1 joined after step 4 and
  # steps 5-6 drew 4 D0 tasks from a pool of 28, so the pair against GRPO only could differ only
  # in which D0 tasks were drawn. Here a round runs after every 2nd step and joins before the
  # next (its synthesis takes ~0.1 s with the programmatic explorer), and once synthesized tasks
  # exist every step draws one of its 2 from them, so steps 3-6 train on 4. Not the paper's
  # (F = 10 of 120 steps, a proportional draw: `:paper`); a run without rounds draws as before.
  c.feedback.every = 2
  c.feedback.lag = 0
  c.pool.synth_fraction = 0.5
  c.eval.generated_before_warmstart = True
