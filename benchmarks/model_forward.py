"""Forward-pass throughput of our Qwen against Hugging Face transformers (torch) on the same config.

    .venv/bin/python benchmarks/model_forward.py [--repeats 5] [--batch 8] [--seq 512]

Config (issue 3): Qwen3 architecture, 8 layers, hidden 512, 8 query heads, 4 KV heads, head_dim 64,
MLP 1536, the full Qwen vocabulary (151,936), float32, batch 8 x 512 tokens, random weights shared
by both implementations (ours is loaded from the transformers checkpoint).

Rows:
  transformers      `model(input_ids, attention_mask=...)` under torch.no_grad: full logits.
  ours full logits  jitted `model(input_ids, attention_mask=...)`: the same [B, T, V] output.
  ours loss logits  the training case, through the trainer's own `token_logprobs`: hidden states
                    for all T positions, logits and target log-probs only at the completion
                    positions a policy-gradient loss needs (the last quarter, 128 of 512, as in a
                    128-token completion after the prompt).
Each row is timed `repeats` times after a warm-up, interleaved so machine load hits all rows alike;
the median counts. Tokens/s = batch * seq / seconds (every input token is processed in each row).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

from coevolve_jax.models import from_pretrained
from coevolve_jax.trainer import token_logprobs

CONFIG = dict(
  vocab_size=151936,
  hidden_size=512,
  intermediate_size=1536,
  num_hidden_layers=8,
  num_attention_heads=8,
  num_key_value_heads=4,
  head_dim=64,
  rope_theta=1e6,
  rms_norm_eps=1e-6,
  tie_word_embeddings=False,
  max_position_embeddings=4096,
)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=512)
  args = parser.parse_args()
  b, t = args.batch, args.seq
  completion = t // 4

  torch.manual_seed(0)
  hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**CONFIG)).eval()
  with tempfile.TemporaryDirectory() as tmp:
    hf.save_pretrained(tmp)
    ours = from_pretrained(tmp)
  graphdef, state = nnx.split(ours)

  @jax.jit
  def full_logits(state, ids, mask):
    return nnx.merge(graphdef, state)(ids, attention_mask=mask)

  @jax.jit
  def loss_logits(state, ids, target_pos):
    return token_logprobs(nnx.merge(graphdef, state), ids, target_pos)

  rng = np.random.default_rng(0)
  ids_np = rng.integers(0, CONFIG["vocab_size"], size=(b, t))
  mask_np = np.ones((b, t), np.int64)
  ids, mask = jnp.asarray(ids_np, jnp.int32), jnp.asarray(mask_np, jnp.int32)
  ids_pt, mask_pt = torch.tensor(ids_np), torch.tensor(mask_np)
  target_pos = jnp.broadcast_to(jnp.arange(t - completion, t, dtype=jnp.int32), (b, completion))

  def run_hf():
    with torch.no_grad():
      return hf(input_ids=ids_pt, attention_mask=mask_pt).logits

  rows = {
    "transformers (torch) full logits": run_hf,
    "ours full logits": lambda: full_logits(state, ids, mask).block_until_ready(),
    "ours loss logits (last 1/4)": lambda: loss_logits(state, ids, target_pos).block_until_ready(),
  }
  compile_s = {}
  for name, fn in rows.items():  # warm-up (and compile)
    start = time.perf_counter()
    fn()
    compile_s[name] = time.perf_counter() - start
  ref_logits = run_hf().numpy()
  got = np.asarray(full_logits(state, ids, mask))
  max_err = float(np.max(np.abs(got - ref_logits)))
  del ref_logits, got
  times: dict[str, list[float]] = {name: [] for name in rows}
  for _ in range(args.repeats):
    for name, fn in rows.items():
      start = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - start)

  ref = statistics.median(times["transformers (torch) full logits"])
  print(
    f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
    f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__} "
    f"({torch.get_num_threads()} threads), transformers {transformers.__version__}"
  )
  print(
    f"config: 8 layers, hidden 512, heads 8/4, head_dim 64, MLP 1536, vocab 151936, fp32; "
    f"batch {b} x {t} tokens; median of {args.repeats}; max |logit diff| vs transformers "
    f"{max_err:.1e}"
  )
  print()
  print(
    f"| {'implementation':34} | {'median s':>8} | {'tokens/s':>9} | {'vs transformers':>15} |"
    f" {'first call s':>12} |"
  )
  print(f"|{'-' * 36}|{'-' * 10}|{'-' * 11}|{'-' * 17}|{'-' * 14}|")
  for name, ts in times.items():
    med = statistics.median(ts)
    print(
      f"| {name:34} | {med:8.2f} | {b * t / med:9.1f} | {ref / med:14.2f}x |"
      f" {compile_s[name]:12.1f} |"
    )


if __name__ == "__main__":
  main()
