"""Peak host memory while loading a Hugging Face checkpoint, against the checkpoint's size.

    .venv/bin/python benchmarks/load_memory.py [--layers 12] [--keep DIR]

Writes a random Qwen3 checkpoint of about 1.4 GB (float32; hidden 1024, 12 layers, full vocabulary,
tied head), then loads it in fresh processes and samples /proc/self/status every 2 ms:
  ours fp32          `from_pretrained(folder)`: tensor by tensor into device arrays
  ours bf16          `from_pretrained(folder, dtype=bfloat16)`: the result is half the file
  naive reference    `safetensors.numpy.load_file` (the whole state dict on the host) and then
                     the same conversion: what loading without streaming costs
  transformers       `AutoModelForCausalLM.from_pretrained(folder)` (torch), for comparison
Reported: peak growth of anonymous resident memory (RssAnon: the process's own memory; file pages
that safetensors memory-maps are page cache, shown separately as peak RSS) over the baseline after
imports, divided by the checkpoint size. On CPU the loaded model itself lives in host memory, so
ours can at best reach about 1.0x (fp32) or 0.5x (bf16) plus the largest single tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MODES = ("ours_fp32", "ours_bf16", "naive_reference", "transformers")


def _status_kb(field: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1])
  return 0


def _child(mode: str, folder: str) -> None:
  """Runs in a fresh process: imports, then loads `folder` while sampling memory."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import safetensors.numpy

  from coevolve_jax.models import Qwen, from_pretrained
  from coevolve_jax.models.hf import config_from_hf
  from coevolve_jax.models.params import hf_to_path

  if mode == "transformers":
    import torch  # noqa: F401
    import transformers
  jax.numpy.zeros(1).block_until_ready()  # initialise the backend before the baseline
  base_anon, base_rss = _status_kb("RssAnon"), _status_kb("VmRSS")
  peak = {"anon": base_anon, "rss": base_rss}
  stop = threading.Event()

  def sample():
    while not stop.is_set():
      peak["anon"] = max(peak["anon"], _status_kb("RssAnon"))
      peak["rss"] = max(peak["rss"], _status_kb("VmRSS"))
      time.sleep(0.002)

  thread = threading.Thread(target=sample, daemon=True)
  thread.start()
  start = time.perf_counter()
  if mode == "ours_fp32":
    model = from_pretrained(folder)
  elif mode == "ours_bf16":
    model = from_pretrained(folder, dtype=jnp.bfloat16)
  elif mode == "naive_reference":
    from flax import nnx

    tensors = safetensors.numpy.load_file(os.path.join(folder, "model.safetensors"))
    cfg = config_from_hf(json.load(open(os.path.join(folder, "config.json"))))
    model = Qwen(cfg, rngs=nnx.Rngs(0), stacked=False)  # per-layer modules: HF's own paths
    for name, array in tensors.items():
      path, _, fn = hf_to_path(name)
      obj = model
      for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
      obj[...] = jnp.asarray(fn(array, cfg))
  else:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype="float32")
  seconds = time.perf_counter() - start
  stop.set()
  thread.join()
  del model
  print(
    json.dumps(
      {
        "mode": mode,
        "seconds": seconds,
        "peak_anon_growth_mb": (peak["anon"] - base_anon) / 1024,
        "peak_rss_growth_mb": (peak["rss"] - base_rss) / 1024,
        "numpy": np.__version__,
      }
    )
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--layers", type=int, default=12)
  parser.add_argument("--keep", default="", help="reuse / keep the checkpoint in this folder")
  parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    _child(*args.child)
    return
  folder = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="load_memory_"))
  if not (folder / "config.json").exists():
    code = (
      "from flax import nnx; from coevolve_jax.models import Qwen, QwenConfig, "
      "save_pretrained; cfg = QwenConfig(vocab_size=151936, hidden_size=1024, "
      f"intermediate_size=3072, num_hidden_layers={args.layers}, num_attention_heads=16, "
      "num_key_value_heads=8, head_dim=128, tie_word_embeddings=True); "
      f"save_pretrained(Qwen(cfg, rngs=nnx.Rngs(0)), {str(folder)!r})"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
  size_mb = sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 2**20
  rows = []
  for mode in MODES:
    out = subprocess.run(
      [sys.executable, __file__, "--child", mode, str(folder)],
      check=True,
      capture_output=True,
      text=True,
    ).stdout
    rows.append(json.loads(out.strip().splitlines()[-1]))
  embed_mb = 151936 * 1024 * 4 / 2**20
  print(
    f"machine: {platform.machine()}, {os.cpu_count()} CPUs; checkpoint {folder} "
    f"{size_mb:.0f} MiB float32 (largest tensor: embedding {embed_mb:.0f} MiB)"
  )
  print()
  print(
    f"| {'loader':16} | {'seconds':>7} | {'peak anon MiB':>13} | {'x checkpoint':>12} |"
    f" {'peak RSS MiB':>12} |"
  )
  print(f"|{'-' * 18}|{'-' * 9}|{'-' * 15}|{'-' * 14}|{'-' * 14}|")
  for r in rows:
    print(
      f"| {r['mode']:16} | {r['seconds']:7.1f} | {r['peak_anon_growth_mb']:13.0f} |"
      f" {r['peak_anon_growth_mb'] / size_mb:11.2f}x | {r['peak_rss_growth_mb']:12.0f} |"
    )
  if not args.keep:
    for p in folder.iterdir():
      p.unlink()
    folder.rmdir()


if __name__ == "__main__":
  main()
