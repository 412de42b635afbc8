"""Policy-update throughput: our GRPO step against google-tunix's GRPO update, in one run.

    .venv/bin/python benchmarks/train_bench.py [--steps=3] [--peak_tflops=197]

One Qwen3-architecture model (8 layers, hidden 512, 8 query / 4 KV heads of 64, MLP 1536, the full
151,936-token vocabulary, untied head, float32, random weights) and one batch (8 sequences of 128
prompt + 128 completion tokens, random ids, advantages +-1, old and reference log-probs given).
Both contenders run the same update: forward, GRPO loss (clip 0.2 / 0.28, dual clip 3, k3 KL with
beta 1e-3, token-mean), backward, global-norm clipping and AdamW. The first call of each is timed
separately (its excess over a steady step is the compile time); then `--steps` steady steps.

Printed: training tokens/s (prompt + completion tokens per second of update wall time), seconds
per step, first-step compile seconds, model TFLOP/s and MFU with the formula below, the ratio of
ours to tunix, and the machine (CPU, cores, load average, versions, date). google-tunix conflicts
with our pins, so it runs in its own environment (`--tunix_python`, default
.venv-tunix/bin/python) as a subprocess of this script (`--worker=tunix`), on the same batch;
ours runs as a subprocess too (`--worker=ours`), one after the other, so neither holds memory
while the other runs.

Model FLOPs per update (Kaplan et al. 2020 "6N"; attention term of Chowdhery et al. 2022, PaLM,
appendix B), counting what the update needs, the same for both contenders:
    F = 3 * (B * T * (2 * N_layers + 4 * L * T * H * Dh) + B * C * 2 * D * V)
N_layers = matmul parameters of the decoder layers, L layers, T = prompt + completion tokens,
H * Dh = query width, C completion tokens per row (only they need vocabulary logits), D hidden,
V vocabulary; the factor 3 is forward plus backward (2x). Recomputation (rematerialisation) is
not counted. MFU = F / step seconds / peak FLOP/s of the chip (`--peak_tflops`); a CPU has no
meaningful peak here, so on CPU only the achieved model TFLOP/s is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
from common import machine, markdown_table

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VOCAB = 151936
TUNIX_REFERENCE = "tunix measured 65.7 tokens/s on this machine on 2026-11-29 (issue 5)"


def _shape(args) -> dict:
  heads = args.hidden // 64
  return dict(
    layers=args.layers,
    hidden=args.hidden,
    mlp=3 * args.hidden,
    heads=heads,
    kv_heads=max(1, heads // 2),
    head_dim=64,
    vocab=VOCAB,
  )


def _batch(args) -> dict[str, np.ndarray]:
  """The same random batch in both processes: [B, prompt], [B, completion], [B], [B, C]."""
  rng = np.random.default_rng(0)
  b, p, c = args.batch, args.prompt_len, args.completion_len
  return {
    "prompt": rng.integers(1, VOCAB, (b, p)).astype(np.int32),
    "completion": rng.integers(1, VOCAB, (b, c)).astype(np.int32),
    "advantages": np.where(np.arange(b) % 2 == 0, 1.0, -1.0).astype(np.float32),
    "logp_noise": rng.normal(0.0, 0.05, (b, c)).astype(np.float32),
  }


def model_flops(args) -> float:
  """Model FLOPs of one update (module docstring formula)."""
  s = _shape(args)
  d, q_width, kv_width = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
  n_layer = s["layers"] * (d * q_width * 2 + d * kv_width * 2 + 3 * d * s["mlp"])
  t = args.prompt_len + args.completion_len
  per_row = t * (2 * n_layer + 4 * s["layers"] * t * q_width) + args.completion_len * 2 * d * VOCAB
  return 3.0 * args.batch * per_row


def _timed(step, n: int) -> dict:
  start = time.perf_counter()
  step()
  first = time.perf_counter() - start
  times = []
  for _ in range(n):
    start = time.perf_counter()
    step()
    times.append(time.perf_counter() - start)
  steady = statistics.median(times)
  return {"first_s": first, "step_s": steady, "compile_s": max(0.0, first - steady), "steps": times}


# -------------------------------------------------------------------------------------- ours


def ours_worker(args) -> None:
  """Runs in our environment; prints one JSON line with the timings."""
  import jax  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  from coevolve_jax import grpo  # noqa: PLC0415
  from coevolve_jax.models import Qwen, QwenConfig  # noqa: PLC0415
  from coevolve_jax.trainer import PolicyTrainer, make_batch, make_optimizer  # noqa: PLC0415
  from coevolve_jax.types import Trajectory  # noqa: PLC0415

  s = _shape(args)
  cfg = QwenConfig(
    vocab_size=VOCAB,
    hidden_size=s["hidden"],
    intermediate_size=s["mlp"],
    num_hidden_layers=s["layers"],
    num_attention_heads=s["heads"],
    num_key_value_heads=s["kv_heads"],
    head_dim=s["head_dim"],
  )
  trainer = PolicyTrainer(
    Qwen(cfg, rngs=nnx.Rngs(0)), make_optimizer(1e-6, 0.01, 1.0), grpo.GRPOConfig(), 1.0
  )
  data = _batch(args)
  trajs = []
  for prompt, completion in zip(data["prompt"], data["completion"]):
    tr = Trajectory(task_id="t", group_id=0)
    tr.extend(prompt.tolist(), sampled=False)
    tr.extend(completion.tolist(), sampled=True, logprobs=[0.0] * len(completion))
    trajs.append(tr)
  batch = make_batch(
    trajs,
    data["advantages"],
    min_len=args.prompt_len + args.completion_len,
    min_targets=args.completion_len,
  )
  assert batch.tokens.shape == (args.batch, args.prompt_len + args.completion_len)
  assert batch.target_pos.shape == (args.batch, args.completion_len)
  trainer.freeze_reference()
  old = trainer.logprobs(batch)
  ref = old + jax.numpy.asarray(data["logp_noise"])

  def step():
    trainer.grpo_update(batch, old, ref)  # returns Python floats: the step has finished

  print(json.dumps(_timed(step, args.steps)))


# ------------------------------------------------------------------------------------- tunix


def tunix_worker(args) -> None:
  """Runs in the tunix environment; prints one JSON line with the timings."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import optax  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415
  from tunix.models.qwen3 import model as qwen3_model  # noqa: PLC0415
  from tunix.rl import algo_core  # noqa: PLC0415
  from tunix.rl import trainer as rl_trainer  # noqa: PLC0415
  from tunix.rl.grpo import grpo_learner  # noqa: PLC0415
  from tunix.sft import peft_trainer  # noqa: PLC0415

  s = _shape(args)
  cfg = qwen3_model.ModelConfig(
    num_layers=s["layers"],
    vocab_size=VOCAB,
    embed_dim=s["hidden"],
    hidden_dim=s["mlp"],
    num_heads=s["heads"],
    head_dim=s["head_dim"],
    num_kv_heads=s["kv_heads"],
    rope_theta=1_000_000,
    norm_eps=1e-6,
    use_tied_embedding=False,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
  )
  model = qwen3_model.Qwen3(cfg, rngs=nnx.Rngs(0))
  algo = grpo_learner.GRPOConfig(
    num_generations=2, beta=1e-3, epsilon=0.2, loss_agg_mode="token-mean", kl_loss_mode="low_var_kl"
  )
  algo.epsilon_high, algo.epsilon_c, algo.temperature = 0.28, 3.0, 1.0
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-6, weight_decay=0.01))
  trainer = rl_trainer.Trainer(
    model,
    tx,
    peft_trainer.TrainingConfig(eval_every_n_steps=10**9),
    custom_checkpoint_metadata_fn=dict,
  )
  trainer.with_loss_fn(
    lambda m, train_example, algo_config: algo_core.grpo_loss_fn(
      m, train_example, algo_config=algo_config, pad_id=0, eos_id=-1
    ),
    has_aux=True,
  )
  trainer.with_gen_model_input_fn(lambda x: {"train_example": x, "algo_config": algo})
  train_step, _ = trainer.jit_train_and_eval_step()

  data = _batch(args)
  b, c = data["completion"].shape
  old = jnp.full((b, c), -12.0, jnp.float32)  # log-probs are inputs; values do not change cost
  example = grpo_learner.TrainExample(
    prompt_ids=jnp.asarray(data["prompt"]),
    prompt_mask=jnp.ones_like(data["prompt"]),
    completion_ids=jnp.asarray(data["completion"]),
    completion_mask=jnp.ones((b, c), jnp.int32),
    advantages=jnp.asarray(data["advantages"]),
    ref_per_token_logps=old + jnp.asarray(data["logp_noise"]),
    old_per_token_logps=old,
  )

  def step():
    loss, _, _ = train_step(example)
    jax.block_until_ready(loss)

  print(json.dumps(_timed(step, args.steps)))


def run_worker(args, name: str, python: str) -> dict | None:
  """Runs one contender in its own process (so each has the machine's memory to itself)."""
  if not os.path.isabs(python):
    python = os.path.join(ROOT, python)
  if not os.path.exists(python):
    print(f"{name}: {python} not found; skipped", file=sys.stderr)
    return None
  cmd = [
    python,
    os.path.abspath(__file__),
    f"--worker={name}",
    f"--steps={args.steps}",
    f"--layers={args.layers}",
    f"--hidden={args.hidden}",
    f"--batch={args.batch}",
    f"--prompt_len={args.prompt_len}",
    f"--completion_len={args.completion_len}",
  ]
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if proc.returncode:
    sys.stderr.write(proc.stderr[-3000:])
    print(f"{name} worker failed (exit {proc.returncode}); skipped", file=sys.stderr)
    return None
  return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------- main


def report(args, ours: dict, tunix: dict | None) -> None:
  tokens = args.batch * (args.prompt_len + args.completion_len)
  flops = model_flops(args)
  rows = [["update", "tokens/s", "s / step", "first-step compile s", "model TFLOP/s", "MFU"]]
  for name, r in (("ours (coevolve_jax)", ours), ("google-tunix 0.1.7", tunix)):
    if r is None:
      rows.append([name, "-", "-", "-", "-", "-"])
      continue
    tflops = flops / r["step_s"] / 1e12
    mfu = f"{tflops / args.peak_tflops:.1%}" if args.peak_tflops else "n/a (CPU)"
    rows.append(
      [
        name,
        f"{tokens / r['step_s']:.1f}",
        f"{r['step_s']:.2f}",
        f"{r['compile_s']:.1f}",
        f"{tflops:.3f}",
        mfu,
      ]
    )
  print(markdown_table(rows))
  if tunix:
    print(
      f"\nratio ours / tunix (tokens/s): {tunix['step_s'] / ours['step_s']:.2f}x (target >= 1.3x)"
    )
    print(
      f"first-step compile: ours {ours['compile_s']:.1f} s (target <= 10 s), "
      f"tunix {tunix['compile_s']:.1f} s"
    )
  print(
    f"\nmodel: {_shape(args)}; batch {args.batch} x ({args.prompt_len} prompt + "
    f"{args.completion_len} completion) tokens, float32; model FLOPs per update "
    f"{flops / 1e12:.3f} TFLOP"
  )
  print("MFU = 3 * (B*T*(2*N_layers + 4*L*T*H*Dh) + B*C*2*D*V) / step_s / peak_FLOP/s")
  print(
    f"steady steps (s): ours {[round(x, 2) for x in ours['steps']]}"
    + (f", tunix {[round(x, 2) for x in tunix['steps']]}" if tunix else "")
  )
  print(f"reference: {TUNIX_REFERENCE}")
  print(f"machine: {machine()}")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=3, help="steady steps timed after the first")
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--hidden", type=int, default=512)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--prompt_len", type=int, default=128)
  p.add_argument("--completion_len", type=int, default=128)
  p.add_argument(
    "--peak_tflops",
    type=float,
    default=0.0,
    help="peak FLOP/s of the chip in TFLOP/s, for MFU (e.g. 197 for TPU v5e bf16)",
  )
  p.add_argument("--peers", default="tunix", help="'tunix' or '' (ours only)")
  p.add_argument("--tunix_python", default=".venv-tunix/bin/python")
  p.add_argument("--worker", default="", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.worker:
    {"ours": ours_worker, "tunix": tunix_worker}[args.worker](args)
    return
  ours = run_worker(args, "ours", sys.executable)
  if ours is None:
    sys.exit("our update failed")
  print(
    f"ours: {args.batch * (args.prompt_len + args.completion_len) / ours['step_s']:.1f} tokens/s",
    file=sys.stderr,
    flush=True,
  )
  tunix = run_worker(args, "tunix", args.tunix_python) if "tunix" in args.peers else None
  report(args, ours, tunix)


if __name__ == "__main__":
  main()
