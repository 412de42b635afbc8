"""Greedy BFCL multi-turn evaluation of a checkpoint.

    python -m envs.bfcl.evaluate --config=configs/bfcl.py:cpu --checkpoint=PATH

runs one greedy episode per entry of multi_turn_base, multi_turn_miss_func, multi_turn_miss_param
and multi_turn_long_context with BFCL's own loop semantics (an undecodable or call-free reply ends
the user turn; more than `--max_steps_per_turn` executed steps in a turn, 20 by default as in
BFCL, force-terminate the entry; an entry passes only if the official `multi_turn_checker` passes
every turn), prints accuracy per category and writes the same, with per-entry rows, to JSON. The
episodes are the ones the training run's own `eval_before` / `eval_after` use
(`envs.bfcl.suite.make_episode(eval=True)`); the run's evaluation only takes its step limit from
`eval.max_steps_per_turn` and its entries from the held-out split of `bfcl.category`.

PATH is a run's orbax checkpoint folder (`<workdir>/checkpoints`, or the workdir itself) or a
Hugging Face folder (`config.json` + safetensors), loaded by
`coevolve_jax.models.checkpoints.load_model`. The model is the checkpoint's own
(`checkpoints.model_config_for_checkpoint`): a run's checkpoint is rebuilt from the `model` group
of the run's `<workdir>/config.json`, which wins over `--config`'s (a run started from a Hugging
Face folder, `model.checkpoint`, takes that folder's architecture and end-of-sequence ids); one
line on stderr says where the model config came from and which `model.*` fields of `--config`
differed. Without that config.json (an old or copied checkpoint) `--config`'s model group is used,
with a warning; a recorded Hugging Face folder that no longer exists is an `error:` line and exit
status 2. A reply also ends at every `eos_token_id` of the Hugging Face folder's config.json and
generation_config.json.
`--policy=ground_truth` replays each entry's ground-truth calls through the same loop instead of a
model: a check of the harness itself (template, parsing, execution, checker), which scores 100% on
multi_turn_base.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from coevolve_jax.models.checkpoints import load_model, model_config_for_checkpoint
from coevolve_jax.rollout.slots import SlotEngine
from coevolve_jax.testing.replay_engine import ReplayEngine
from coevolve_jax.types import Task
from envs.bfcl import env as bfcl
from envs.bfcl.data import data_release
from envs.bfcl.suite import make_episode

CATEGORIES = (
  "multi_turn_base",
  "multi_turn_miss_func",
  "multi_turn_miss_param",
  "multi_turn_long_context",
)


def evaluate_category(
  engine,
  chat,
  tasks: Sequence[Task],
  cfg,
  rng=None,
  max_new_tokens: int = 0,
  stop_ids: Sequence[int] = (),
) -> dict[str, Any]:
  """Greedy episodes of `tasks` on `engine`; returns {"accuracy", "n", "entries": [...]}.

  The official loop has no episode-wide step limit (only `cfg.eval.max_steps_per_turn` executed
  steps per user turn, enforced by the environment), so none cuts an episode here; replies are
  cut at `cfg.eval.max_new_tokens` tokens and an episode that fills its KV cache
  (`cfg.engine.cache_len`) fails with finish "context".

  Args:
    engine: a rollout `Engine` (or any object with its slot interface, e.g. `ReplayEngine`).
    chat: the chat format (`QwenChat`).
    tasks: BFCL tasks of one category.
    cfg: the run config (bfcl.tool_style, bfcl.max_obs_chars, eval.max_new_tokens are read).
    rng: PRNG key (greedy decoding does not use it).
    max_new_tokens: tokens per reply; 0 = `cfg.eval.max_new_tokens`.
    stop_ids: the checkpoint's end-of-sequence ids (`model.config.eos_token_ids`); a reply ends
      at any of them or at `<|im_end|>`.
  """
  import jax  # noqa: PLC0415

  from coevolve_jax.agent import AgentRunner, EpisodeLimits  # noqa: PLC0415
  from coevolve_jax.rollout.sampling import SamplingParams  # noqa: PLC0415

  runner = AgentRunner(
    engine,
    chat,
    functools.partial(make_episode, cfg, eval=True),
    EpisodeLimits.for_evaluation(
      tasks, max_new_tokens or cfg.eval.max_new_tokens, cfg.eval.max_steps_per_turn
    ),
    stop_ids=stop_ids,
    decode_steps=cfg.episode.decode_steps,
  )
  trajs = runner.run(
    [(t, i) for i, t in enumerate(tasks)],
    SamplingParams(temperature=0.0),
    jax.random.key(0) if rng is None else rng,
  )
  rows = [
    {
      "id": t.task_id,
      "reward": t.reward,
      "finish": t.finish,
      "model_steps": t.model_steps,
      "parse_errors": t.parse_errors,
      "generated_tokens": t.num_generated,
      "calls": t.calls,
      "checker": t.info.get("checker"),
    }
    for t in trajs
  ]
  accuracy = float(np.mean([r["reward"] for r in rows])) if rows else 0.0
  return {"accuracy": accuracy, "n": len(rows), "entries": rows}


def run(
  cfg,
  checkpoint: str,
  categories: Sequence[str],
  max_tasks: int,
  policy: str,
  output: str,
  max_new_tokens: int = 0,
) -> dict[str, Any]:
  """Evaluates every category; prints a table and writes the JSON report to `output`.

  With `policy="model"`, the model group is the checkpoint's own (`model_config_for_checkpoint`:
  the run's config.json, or the Hugging Face folder), not `cfg`'s; the line saying so goes to
  stderr and into the report ("model_config").

  Raises:
    FileNotFoundError: no such checkpoint, or the Hugging Face folder its run recorded is gone.
    CheckpointFormatError: an unreadable Hugging Face folder. CheckpointMismatchError: the orbax
      checkpoint does not fit the model group used (`cfg`'s, when the run's config.json is gone).
  """
  from coevolve_jax.agent import QwenChat  # noqa: PLC0415
  from coevolve_jax.tokenizer import run_tokenizer_folder  # noqa: PLC0415

  engine: SlotEngine | None
  engine, stop_ids, source = None, (), None
  if policy == "model":
    import jax.numpy as jnp  # noqa: PLC0415

    from coevolve_jax.models import apply_matmul_precision  # noqa: PLC0415
    from coevolve_jax.rollout.engine import Engine  # noqa: PLC0415

    cfg, source = model_config_for_checkpoint(cfg, checkpoint)
    print(source, file=sys.stderr, flush=True)
    apply_matmul_precision(cfg.model)  # as the run decodes
    model = load_model(cfg, checkpoint)
    stop_ids = model.config.eos_token_ids  # a Hugging Face folder's generation_config.json ids
    engine = Engine(
      model,
      cfg.engine.num_slots,
      cfg.engine.cache_len,
      jnp.dtype(cfg.model.dtype),
      cfg.engine.max_prefill_tokens,
      record_routing=False,  # nothing is trained on evaluation episodes
      scan_layers=cfg.engine.scan_layers and model.stacked,  # as the run decodes
    )
  chat = QwenChat(  # after the checkpoint's own model group: its tokenizer
    enable_thinking=False,
    max_call_chars=cfg.episode.max_call_chars,
    max_calls_per_reply=cfg.episode.max_calls_per_reply,
    tokenizer_folder=run_tokenizer_folder(cfg.model),
  )
  report: dict[str, Any] = {
    "checkpoint": checkpoint,
    "policy": policy,
    **({"model_config": source} if source else {}),
    "max_new_tokens": max_new_tokens or cfg.eval.max_new_tokens,
    "tool_style": cfg.bfcl.tool_style,
    "data_release": data_release(list(categories)),
    "categories": {},
  }
  for category in categories:
    tasks = bfcl.load_bfcl_tasks(category)
    tasks = tasks[:max_tasks] if max_tasks > 0 else tasks
    start = time.perf_counter()
    if policy == "ground_truth":
      engine = ReplayEngine(
        tasks,
        chat,
        functools.partial(make_episode, cfg, eval=True),
        num_slots=cfg.engine.num_slots,
        parse_call=bfcl.parse_call_string,
        max_steps_per_turn=cfg.eval.max_steps_per_turn,
      )
    result = evaluate_category(
      engine, chat, tasks, cfg, max_new_tokens=max_new_tokens, stop_ids=stop_ids
    )
    result["wall_s"] = round(time.perf_counter() - start, 2)
    report["categories"][category] = result
    print(
      f"{category:<26} {result['accuracy'] * 100:6.1f}%  ({result['n']} entries, "
      f"{result['wall_s']:.0f} s)",
      flush=True,
    )
  os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
  with open(output, "w", encoding="utf-8") as f:
    json.dump(report, f, indent=1)
  print(f"wrote {output}")
  return report


def main(argv: Sequence[str]) -> int:
  from absl import flags  # noqa: PLC0415

  del argv
  f = flags.FLAGS
  cfg = f.config
  unknown = [c for c in f.categories if c not in CATEGORIES]
  if unknown:
    print(f"error: unknown categories {unknown} (known: {', '.join(CATEGORIES)})", file=sys.stderr)
    return 2
  if f.policy == "model" and not f.checkpoint:
    print("error: --checkpoint is required with --policy=model", file=sys.stderr)
    return 2
  output = f.output or os.path.join(f.checkpoint or ".", "eval_bfcl.json")
  cfg = cfg.copy_and_resolve_references()
  cfg.eval.max_steps_per_turn = f.max_steps_per_turn  # BFCL's 20 unless asked otherwise
  from coevolve_jax import compiling  # noqa: PLC0415 (imports no JAX)
  from coevolve_jax.checkpoint import CheckpointMismatchError  # noqa: PLC0415
  from coevolve_jax.errors import CorruptFileError  # noqa: PLC0415
  from coevolve_jax.models.hf import CheckpointFormatError  # noqa: PLC0415

  compiling.enable_cache(cfg.compile.cache_dir)  # one process: the user's cache by default
  try:
    run(cfg, f.checkpoint, f.categories, f.max_tasks, f.policy, output, f.max_new_tokens)
  except (FileNotFoundError, CheckpointFormatError, CheckpointMismatchError, CorruptFileError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


def _define_flags() -> None:
  from absl import flags  # noqa: PLC0415
  from ml_collections import config_flags  # noqa: PLC0415

  config_flags.DEFINE_config_file("config", None, "Config file (path[:variant]).", lock_config=True)
  flags.DEFINE_string("checkpoint", "", "orbax run checkpoint folder or Hugging Face folder")
  flags.DEFINE_list("categories", list(CATEGORIES), "BFCL multi-turn categories to run")
  flags.DEFINE_integer("max_tasks", 0, "first N entries per category (0 = all 200)", lower_bound=0)
  flags.DEFINE_enum(
    "policy",
    "model",
    ["model", "ground_truth"],
    "model: greedy decoding of the checkpoint; ground_truth: replay the "
    "ground-truth calls (harness check)",
  )
  flags.DEFINE_integer(
    "max_steps_per_turn",
    bfcl.MAX_STEPS_PER_TURN,
    "executed steps per user turn before an entry is force-terminated (BFCL's limit is 20; "
    "the in-loop evaluation uses the config's eval.max_steps_per_turn)",
  )
  flags.DEFINE_integer(
    "max_new_tokens",
    0,
    "tokens per reply (0 = config eval.max_new_tokens; "
    "the CPU preset's 64 cuts long ground-truth calls)",
  )
  flags.DEFINE_string("output", "", "JSON report path (default: <checkpoint>/eval_bfcl.json)")
  flags.mark_flags_as_required(["config"])


if __name__ == "__main__":
  from coevolve_jax import flag_errors

  _define_flags()
  flag_errors.run(main)
