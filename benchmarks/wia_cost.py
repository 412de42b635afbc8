"""Role-Agent's World-In-Agent on the CPU preset: what the warm-start teaches, and what it costs
(issue 43 items 6-7).

Three arms per seed, each one GRPO step of the CPU preset (`configs/bfcl.py:cpu`: D0 of 12
programmatic tasks, 120 warm-start steps, 4 groups of 4 episodes; feedback rounds off) run
through `python -m coevolve_jax.main`, so every arm takes the product's path:

  off        WIA off (the reference for the costs);
  true       WIA on, the warm-start's demonstrations predict each call's real observation
             (`role_agent.wia.demos = "true"`);
  shuffled   WIA on, the control: the demonstrations predict another demonstration's
             observation (`"shuffled"`): the same format and lengths, no information.

Every arm has the same reply limit (`--max_new_tokens`, default 256: a prediction of up to
`role_agent.wia.char_cap` = 600 characters does not fit the preset's 64) and the same update
buckets. From step 1's row of metrics.jsonl (the rollouts of the warm-started policy, sampled at
the preset's temperature): the share of replies with a prediction, the mean similarity of the
predictions to the real observations ("words"), decode tokens per model reply, rollout seconds,
the engine's decode steps and seconds (and milliseconds per step), WIA's host seconds (scoring,
step advantages, figures) and mean reward. Ratios: similarity true / shuffled, tokens per reply,
rollout time, decode steps and time per decode step with WIA (true) / off.

Host time of scoring and retrieval at scale (no model): `wia.metrics` plus the role_agent
estimator over `--episodes` synthetic episodes of 20 replies with 600-character observations,
and AIW's `observe` (template analyser) for a step of 64 failed groups against a full library of
512 failures.

    nice -n 10 .venv/bin/python benchmarks/wia_cost.py [--seeds 0,1] [--workdir runs/wia_cost]

Arms resume (a finished arm is read back from its workdir); ~6-8 minutes an arm on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
sys.path.insert(0, ROOT)
from common import machine, markdown_table  # noqa: E402

ARMS = {
  "off": {},
  "true": {"role_agent.wia.enabled": True, "role_agent.wia.demos": "true"},
  "shuffled": {"role_agent.wia.enabled": True, "role_agent.wia.demos": "shuffled"},
}


def arm_overrides(arm: str, seed: int, max_new_tokens: int) -> dict[str, object]:
  """The config fields an arm sets over `configs/bfcl.py:cpu`."""
  return {
    "seed": seed,
    "train.steps": 1,
    "feedback.enabled": False,
    "eval.pool_after": False,
    "episode.max_new_tokens": max_new_tokens,
    "eval.max_new_tokens": max_new_tokens,
    # the update's targets per row: up to max_model_steps (6) replies of max_new_tokens
    "train.target_buckets": (512, 6 * max_new_tokens),
    **ARMS[arm],
  }


def run_arm(arm: str, seed: int, workdir: str, max_new_tokens: int = 256) -> dict[str, float]:
  """Runs (or resumes) one arm in its own process; returns its step-1 metrics row.

  Raises:
    RuntimeError: the run failed (its log's tail in the message).
  """
  flags = []
  for key, value in arm_overrides(arm, seed, max_new_tokens).items():
    flags.append(f"--config.{key}={value}")
  cmd = [
    sys.executable,
    "-m",
    "coevolve_jax.main",
    "--config=configs/bfcl.py:cpu",
    f"--workdir={workdir}",
    *flags,
  ]
  done = _step_row(workdir)
  if done is None:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    done = _step_row(workdir)
    if proc.returncode != 0 or done is None:
      raise RuntimeError(f"arm {arm} seed {seed} failed:\n{proc.stderr[-3000:]}")
  return done


def _ms_per_decode_step(row: dict[str, float]) -> float:
  """The engine's milliseconds per decode step (every slot advances one token; `Engine.pop_work`'s
  figures; NaN in a row written before they were logged). Per step, not per decoded token: a step
  costs the same with one slot active as with all, so per token it also counts the slots left
  idle by the step's last long episodes."""
  steps = row.get("engine/decode_steps", 0.0)
  return 1e3 * row["engine/decode_seconds"] / steps if steps else float("nan")


def _step_row(workdir: str) -> dict[str, float] | None:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  found = [r for r in rows if r.get("step") == 1 and "reward/mean" in r]
  return found[-1] if found else None


def host_costs(episodes: int) -> list[list[str]]:
  """Host seconds of WIA's scoring and AIW's retrieval at scale (module docstring)."""
  import numpy as np  # noqa: PLC0415

  from coevolve_jax import advantages, grpo, wia  # noqa: PLC0415
  from coevolve_jax.feedback.aiw import AIWConfig, AIWSampler  # noqa: PLC0415
  from coevolve_jax.types import Reply, Task, Trajectory  # noqa: PLC0415

  rng = np.random.default_rng(0)
  words = [f"w{i}" for i in range(300)]

  def text(n: int) -> str:
    return json.dumps({"result": " ".join(rng.choice(words, n // 5))})[:600]

  trajs = []
  for i in range(episodes):
    t = Trajectory(task_id=f"t{i // 8}", group_id=i // 8, reward=float(i % 3 == 0))
    t.replies = [
      Reply(j + 1, j + 2, calls=[f"f{j}(x={i % 4})"], observation=text(600), prediction=text(600))
      for j in range(20)
    ]
    t.token_ids, t.loss_mask = [0] * 21, [0] + [1] * 20
    trajs.append(t)
  cfg = wia.WIAConfig()
  rewards = np.array([t.reward for t in trajs], np.float32)
  groups = np.array([t.group_id for t in trajs])
  keep = np.ones(len(trajs), bool)
  start = time.perf_counter()
  wia.metrics(trajs, cfg, 0.5, keep.tolist())
  inputs = advantages.AdvantageInputs(trajs, rewards, groups, keep, grpo.GRPOConfig(), cfg)
  advantages.estimate("role_agent", inputs)
  scoring = time.perf_counter() - start

  tasks = [Task(f"t{i}", "bfcl", ["q"], [[f"f{i % 7}(x=1)", f"g{i % 5}(y=2)"]]) for i in range(64)]
  sampler = AIWSampler(AIWConfig())
  for k in range(8):  # fill the library: 8 steps of 64 failures
    failed = []
    for i, task in enumerate(tasks):
      tr = Trajectory(task_id=task.task_id, group_id=i, reward=0.0)
      tr.calls = [[f"f{(i + k) % 7}(x=1)", f"h{(i * k) % 9}(z=3)"]]
      tr.observations = [["ok", "error: no"]]
      failed.append(tr)
    start = time.perf_counter()
    sampler.observe(
      [Task(f"{t.task_id}-{k}", "bfcl", ["q"], t.ground_truth) for t in tasks], failed
    )
    retrieval = time.perf_counter() - start
  return [
    ["WIA scoring + step advantages", f"{episodes} episodes x 20 replies", f"{scoring:.3f}"],
    ["AIW observe (template)", "64 failures vs 512 in the library", f"{retrieval:.3f}"],
  ]


def teacher_forced(arm: str, seed: int, workdir: str, max_new_tokens: int = 256) -> dict:
  """The arm's policy (its newest checkpoint: after the warm-start and one GRPO step) given each
  of its own demonstrations' true prefix up to a call's reply: its greedy reply's prediction
  against the observation that call really returned (`wia.similarity`, "words"; 0 where the
  reply predicts nothing). The arm's workdir is copied first, so it is left as it was.

  Returns:
    {"replies": calls scored, "predicted": share with a prediction, "similarity": mean}.
  """
  import shutil  # noqa: PLC0415
  import tempfile  # noqa: PLC0415

  import numpy as np  # noqa: PLC0415

  sys.path.insert(0, os.path.join(ROOT, "scripts"))
  import ablations  # noqa: PLC0415

  from coevolve_jax import qevolve, wia  # noqa: PLC0415
  from coevolve_jax.loop import CoEvolveRun  # noqa: PLC0415
  from coevolve_jax.rollout.generate import generate  # noqa: PLC0415
  from coevolve_jax.rollout.sampling import SamplingParams  # noqa: PLC0415

  overrides = dict(arm_overrides(arm, seed, max_new_tokens))
  cfg = ablations.load_config("coevolve", seed, overrides)
  with tempfile.TemporaryDirectory() as tmp:
    copy = os.path.join(tmp, "run")
    shutil.copytree(workdir, copy, ignore=shutil.ignore_patterns("run.lock*"))
    run = CoEvolveRun(cfg, copy)
    run._session_start, run._closing = 0.0, []  # noqa: SLF001 (outside `fit`'s session)
    run._start()  # noqa: SLF001 (restores the newest checkpoint)
    seen: list[str] = []
    mode = cfg.role_agent.wia.demos
    if mode == "shuffled":  # the control needs every observation first (as the loop's warm-start)
      for i, t in enumerate(run.pool.tasks):
        run.suite.demonstration(t, run.parts.chat, f"tf{i}", seen.append)
    base = wia.demo_predictor(mode, cfg.role_agent.wia.char_cap, seen, cfg.seed)
    chat = run.parts.chat
    prompts, truths = [], []
    for i, t in enumerate(run.pool.tasks):
      real: list[str] = []
      demo = run.suite.demonstration(
        t, chat, f"tf{i}", lambda obs, real=real: real.append(obs) or base(obs)
      )
      k = 0
      for j, end in qevolve.sampled_spans(demo):  # replies with a prediction, in order with `real`
        if "<predict_next>" in chat.decode(demo.token_ids[j:end]) and k < len(real):
          prompts.append(demo.token_ids[:j])
          truths.append(real[k])
          k += 1
    done = generate(
      run.trainer.model(),
      prompts,
      SamplingParams(0.0),
      max_new_tokens=max_new_tokens,
      stop_ids=[chat.im_end_id],
    )
    scores, predicted = [], 0
    for completion, truth in zip(done, truths):
      _, prediction = wia.split_prediction(chat.decode(list(completion.token_ids)))
      predicted += prediction is not None
      cap = cfg.role_agent.wia.char_cap
      scores.append(0.0 if prediction is None else wia.similarity(prediction, truth, "words", cap))
    run.ckpt.close()
  return {
    "replies": len(scores),
    "predicted": predicted / max(1, len(scores)),
    "similarity": float(np.mean(scores)) if scores else 0.0,
  }


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--seeds", default="0,1")
  p.add_argument("--workdir", default=os.path.join(ROOT, "runs", "wia_cost"))
  p.add_argument("--max_new_tokens", type=int, default=256)
  p.add_argument("--episodes", type=int, default=512)
  p.add_argument("--teacher_forced", action="store_true", help="only the teacher-forced table")
  args = p.parse_args()
  seeds = [int(s) for s in args.seeds.split(",")]
  if args.teacher_forced:
    rows = [["arm", "seed", "calls", "predicted", "similarity"]]
    for seed in seeds:
      for arm in ("true", "shuffled"):
        wd = os.path.join(args.workdir, f"{arm}-s{seed}")
        run_arm(arm, seed, wd, args.max_new_tokens)
        r = teacher_forced(arm, seed, wd, args.max_new_tokens)
        rows.append([arm, str(seed), str(r["replies"]), f"{r['predicted']:.2f}",
                     f"{r['similarity']:.3f}"])  # fmt: skip
    print(markdown_table(rows))
    print(machine())
    return
  rows = [["arm", "seed", "predicted", "similarity", "tokens / reply", "rollout s", "decode steps",
           "decode s", "ms / decode step", "WIA host s", "reward"]]  # fmt: skip
  got: dict[tuple[str, int], dict[str, float]] = {}
  for seed in seeds:
    for arm in ARMS:
      r = run_arm(arm, seed, os.path.join(args.workdir, f"{arm}-s{seed}"), args.max_new_tokens)
      got[arm, seed] = r
      rows.append(
        [
          arm,
          str(seed),
          f"{r.get('wia/prediction_share', 0.0):.2f}",
          f"{r['wia/similarity']:.3f}" if "wia/similarity" in r else "-",
          f"{r['rollout/tokens_generated'] / max(1, r['rollout/model_steps']):.1f}",
          f"{r.get('timing/rollout', float('nan')):.1f}",
          f"{r.get('engine/decode_steps', float('nan')):.0f}",
          f"{r.get('engine/decode_seconds', float('nan')):.1f}",
          f"{_ms_per_decode_step(r):.1f}",
          f"{r['timing/wia']:.4f}" if "timing/wia" in r else "-",
          f"{r['reward/mean']:.3f}",
        ]
      )
  print(markdown_table(rows))

  def ratio(num: str, den: str, fn) -> str:
    vals = [fn(got[num, s]) / fn(got[den, s]) for s in seeds if fn(got[den, s])]
    return f"{statistics.fmean(vals):.2f}" if vals else "-"

  print()
  summary = [
    ["ratio (mean over seeds)", "value"],
    [
      "similarity, true / shuffled",
      ratio("true", "shuffled", lambda r: r.get("wia/similarity", 0)),
    ],
    [
      "decode tokens per reply, WIA / off",
      ratio("true", "off", lambda r: r["rollout/tokens_generated"] / r["rollout/model_steps"]),
    ],
    ["rollout seconds, WIA / off", ratio("true", "off", lambda r: r["timing/rollout"])],
    [
      "decode steps, WIA / off",
      ratio("true", "off", lambda r: r.get("engine/decode_steps", float("nan"))),
    ],
    ["ms per decode step, WIA / off", ratio("true", "off", _ms_per_decode_step)],
  ]
  print(markdown_table(summary))
  print()
  print(markdown_table([["host work", "size", "seconds"], *host_costs(args.episodes)]))
  print(machine())


if __name__ == "__main__":
  main()
