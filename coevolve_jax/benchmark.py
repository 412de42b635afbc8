"""Throughput benchmark of the rollout engine and the GRPO step, and a cross-machine comparison.

The library side of `python -m coevolve_jax.cli.bench` (flags, printing and files there):
building the workload, timing it, the JSON record, and the comparison of records.

`run_bench` runs on whatever backend JAX finds (CPU, GPU, TPU; all local devices) with the
config's model preset, dtype and mesh, random weights and random token ids (throughput does not
depend on the values), and returns a record (`format_record`: its table). It measures, as medians
over `repeats` after a compile run (the command line's flags in parentheses):
- rollout: prefill of `prompt_len` (`--prompt_len`) tokens into each of `engine.num_slots`
  slots, then `gen_len` (`--gen_len`) decode steps of all slots (`rollout.engine.Engine`);
- training: old and reference log-probs and one GRPO update (`trainer.PolicyTrainer`) on `rows`
  (`--train_rows`) sequences of `seq` (`--train_seq`) tokens, the second half of each sampled,
  and the weight sync after it (`PolicyTrainer.inference_params`: cast, and gather over fsdp with
  `engine.weights_layout=gathered`);
- memory: the bytes device 0 holds of each array the job allocates (master parameters, AdamW
  state, reference, rollout weights, KV cache), and the device's peak where it reports one.

Everything is built as the main job builds it (`loop.CoEvolveRun._setup`): one mesh from the
config's `mesh` group over all local devices, float32 master weights (`model.param_dtype`) and
`model.dtype` compute, the engine decoding the trainer's weights. Per-chip figures divide by the
mesh's devices.
- reference, in the same run: a dense `jnp.dot` of two N x N matrices in the model dtype, the
  device's attainable matmul rate, so utilisation is also reported where no vendor peak is known.

Model FLOPs (per token; Kaplan et al. 2020 "Scaling laws", section 2.1, and PaLM, Chowdhery et
al. 2022, appendix B, with causal attention counted over the keys actually attended):
  forward = 2 * N_layers_params + 4 * L * (heads * head_dim) * context  [+ 2 * D * V where a
  token's logits are computed]; backward = 2 * forward. N_layers_params excludes the embedding
  (a gather) and the output projection, which is counted where logits are computed: at sampled
  positions in training, at the last prompt token in prefill, at every decoded token.
MFU = model FLOP/s / (chips * vendor peak bf16 FLOP/s from coevolve_jax/accelerators.py);
"of matmul" uses the measured reference rate instead.

`compare` makes a markdown table (and `plot` a PNG) of tokens/s per chip and tokens per
dollar, with the on-demand prices of coevolve_jax/accelerators.py and their date.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from coevolve_jax import accelerators

if TYPE_CHECKING:
  from coevolve_jax.models.qwen import QwenConfig

SCHEMA = 1


def model_flops(cfg: QwenConfig, tokens: int, context: float, logits: int) -> float:
  """Forward model FLOPs for `tokens` tokens attending to `context` keys on average, with
  `logits` output projections. See the module docstring for the formula and its sources."""
  d, f, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
  nq, nk, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
  experts = cfg.num_experts
  if experts:  # Qwen3-MoE: router + the top-k experts each token uses
    f = cfg.moe_intermediate_size * cfg.num_experts_per_tok
  per_layer = d * (nq + 2 * nk) * h + nq * h * d + 3 * d * f + (d * experts)
  dense = 2 * L * per_layer * tokens
  attention = 4 * L * nq * h * context * tokens
  return float(dense + attention + 2 * d * cfg.vocab_size * logits)


def _median_time(fn, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _matmul_rate(n: int, dtype, repeats: int) -> float:
  a = jax.random.normal(jax.random.key(0), (n, n), dtype)
  b = jax.random.normal(jax.random.key(1), (n, n), dtype)
  dot = jax.jit(jnp.dot)
  dot(a, b).block_until_ready()
  return 2.0 * n**3 / _median_time(lambda: dot(a, b).block_until_ready(), repeats)


def _rollout(engine, model, cfg, prompt_len: int, gen_len: int, repeats: int) -> dict:
  from coevolve_jax.rollout.sampling import SamplingParams  # noqa: PLC0415

  slots = cfg.engine.num_slots
  sampling = SamplingParams(temperature=cfg.sampling.temperature)
  rng = np.random.default_rng(0)
  prompts = rng.integers(1, model.config.vocab_size, (slots, prompt_len)).tolist()
  active = np.ones((slots,), bool)
  times: dict[str, list[float]] = {"prefill": [], "decode": []}
  for rep in range(repeats + 1):  # the first pass compiles
    key = jax.random.key(rep)
    for s in range(slots):
      engine.reset_slot(s)
    start = time.perf_counter()
    for s in range(slots):
      engine.prefill(s, prompts[s], key, sampling)
    mid = time.perf_counter()
    # episode.decode_steps per device call, as the job's agent loop decodes (`decode_tokens`)
    k, keys, done = cfg.episode.decode_steps, jax.random.split(key, slots), 0
    while done < gen_len:
      counts = np.full((slots,), done, np.int32)
      limits = np.full((slots,), gen_len - done, np.int32)
      toks, _ = engine.generate_steps(active, keys, counts, limits, (), sampling, k)
      done += len(toks)
    end = time.perf_counter()
    if rep:
      times["prefill"].append(mid - start)
      times["decode"].append(end - mid)
  prefill_s, decode_s = statistics.median(times["prefill"]), statistics.median(times["decode"])
  mc = model.config
  flops = slots * model_flops(mc, prompt_len, (prompt_len + 1) / 2, 1) + slots * model_flops(
    mc, gen_len, prompt_len + (gen_len + 1) / 2, gen_len
  )
  return {
    "slots": slots,
    "devices": 1 if engine.mesh is None else engine.mesh.size,
    "prompt_len": prompt_len,
    "gen_len": gen_len,
    "prefill_s": prefill_s,
    "decode_s": decode_s,
    "prefill_tokens_per_s": slots * prompt_len / prefill_s,
    "decode_tokens_per_s": slots * gen_len / decode_s,
    "tokens_per_s": slots * (prompt_len + gen_len) / (prefill_s + decode_s),
    "model_flops_per_s": flops / (prefill_s + decode_s),
  }


def _training(trainer, model, cfg, rows: int, seq: int, repeats: int) -> dict:
  from coevolve_jax.trainer import make_batch  # noqa: PLC0415
  from coevolve_jax.types import Trajectory  # noqa: PLC0415

  rng = np.random.default_rng(0)
  trajs = []
  for i in range(rows):
    tr = Trajectory(task_id=f"bench{i}", group_id=i // max(1, cfg.rollout.group_size))
    ids = rng.integers(1, model.config.vocab_size, seq)
    tr.extend(ids[: seq // 2].tolist(), sampled=False)
    tr.extend(
      ids[seq // 2 :].tolist(), sampled=True, logprobs=(-rng.random(seq - seq // 2)).tolist()
    )
    trajs.append(tr)
  adv = rng.standard_normal(rows).astype(np.float32)
  batch = make_batch(trajs, adv)

  def logp(params=None):
    return jax.block_until_ready(trainer.logprobs(batch, params))

  old = logp()
  ref = logp(trainer.ref_params)
  trainer.grpo_update(batch, old, ref)  # compile
  old_s = _median_time(logp, repeats)
  ref_s = _median_time(lambda: logp(trainer.ref_params), repeats)
  update_s = _median_time(lambda: trainer.grpo_update(batch, old, ref), repeats)
  syncs = []
  for _ in range(repeats):  # one weight sync per update, as in the run
    trainer.grpo_update(batch, old, ref)
    trainer.inference_params()
    syncs.append(trainer.last_sync_s)
  targets = rows * (seq - seq // 2)
  fwd = model_flops(model.config, rows * seq, (seq + 1) / 2, targets)
  step_s = old_s + ref_s + update_s
  return {
    "rows": rows,
    "seq": seq,
    "old_logprobs_s": old_s,
    "ref_logprobs_s": ref_s,
    "update_s": update_s,
    "weight_sync_s": statistics.median(syncs),
    "tokens_per_s": rows * seq / step_s,
    "update_tokens_per_s": rows * seq / update_s,
    "model_flops_per_s": (2 * fwd + 3 * fwd) / step_s,
  }


def _device0_bytes(tree) -> int:
  """Bytes of `tree`'s arrays that the first device holds."""
  dev = jax.devices()[0]
  return sum(
    s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == dev
  )


def _build(cfg, prompt_len: int, gen_len: int):
  """The mesh, model, trainer (reference frozen) and engine, as the main job builds them."""
  from coevolve_jax import grpo, models  # noqa: PLC0415
  from coevolve_jax.models import sharding  # noqa: PLC0415
  from coevolve_jax.rollout.engine import Engine  # noqa: PLC0415
  from coevolve_jax.trainer import PolicyTrainer, make_optimizer  # noqa: PLC0415

  mesh = sharding.make_mesh(dict(cfg.mesh))
  # The preset at random (or model.checkpoint), float32 master weights on the mesh.
  models.apply_matmul_precision(cfg.model)
  model = models.build(cfg.model, seed=0, mesh=mesh, dtype=cfg.model.param_dtype)
  trainer = PolicyTrainer(
    model,
    make_optimizer(1e-6, 0.0, 1.0),
    grpo.GRPOConfig(),
    cfg.sampling.temperature,
    mesh=mesh,
    compute_dtype=cfg.model.dtype,
    inference_layout=cfg.engine.weights_layout,
    inference_stacked=cfg.engine.scan_layers,
  )
  trainer.freeze_reference()
  engine = Engine(
    model,
    cfg.engine.num_slots,
    prompt_len + gen_len + 1,
    jnp.dtype(cfg.model.dtype),
    record_routing=cfg.train.replay_routing,  # as the run's engine: MoE records routing
    mesh=mesh,
    weights=trainer.inference_params,
    scan_layers=cfg.engine.scan_layers,
  )
  return mesh, model, trainer, engine


def run_bench(
  cfg,
  *,
  prompt_len: int,
  gen_len: int,
  rows: int,
  seq: int,
  repeats: int,
  matmul_n: int,
  chip: str = "",
) -> dict:
  """Measures rollout and training throughput of `cfg`'s model on the local devices.

  Returns:
    The JSON-ready record (see the module docstring); rates in tokens/s and FLOP/s, times in s.
  Raises:
    ValueError: non-positive sizes, or an unknown `chip`.
  """
  if min(prompt_len, gen_len, rows, seq, repeats, matmul_n) < 1:
    raise ValueError(
      "prompt_len, gen_len, train_rows, train_seq, repeats and matmul_n must be >= 1"
    )

  dev = jax.devices()[0]
  chip = chip or accelerators.chip_for_device_kind(dev.device_kind) or ""
  facts = accelerators.chip(chip) if chip else None
  dtype = jnp.dtype(cfg.model.dtype)
  matmul = _matmul_rate(matmul_n, dtype, repeats)
  mesh, model, trainer, engine = _build(cfg, prompt_len, gen_len)
  memory = _allocated_bytes(trainer, engine)
  rollout = _rollout(engine, model, cfg, prompt_len, gen_len, repeats)
  train = _training(trainer, model, cfg, rows, seq, repeats)
  stats = dev.memory_stats() or {}
  memory["peak"] = stats.get("peak_bytes_in_use")  # None where the platform does not say (CPU)
  n = jax.device_count()
  train["devices"] = mesh.size
  for part in (rollout, train):
    _add_utilisation(part, facts, matmul)
  return {
    "schema": SCHEMA,
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "machine": _machine(dev, n, chip),
    "config": {
      "preset": cfg.model.preset,
      "dtype": str(dtype),
      "mesh": dict(mesh.shape),
      "param_dtype": cfg.model.param_dtype,
      "weights_layout": cfg.engine.weights_layout,
      "repeats": repeats,
    },
    "memory_bytes_per_device": memory,
    "reference": {
      "name": f"jnp.dot {matmul_n}x{matmul_n} {dtype} (one device)",
      "flops_per_s": matmul,
    },
    "rollout": rollout,
    "train": train,
    "step_breakdown_s": _step_breakdown(rollout, train),
  }


def _allocated_bytes(trainer, engine) -> dict:
  """Bytes device 0 holds of each array the job allocates: master parameters, AdamW state,
  reference, rollout weights (made by `inference_params`, as after each update) and KV cache."""
  return {
    "params": _device0_bytes(trainer.params),
    "optimizer": _device0_bytes(trainer.opt_state),
    "reference": _device0_bytes(trainer.ref_params),
    "rollout_weights": _device0_bytes(trainer.inference_params()),
    "kv_cache": _device0_bytes(engine.state.cache),
  }


def _add_utilisation(part: dict, facts: dict | None, matmul: float) -> None:
  """Adds to a rollout or training record its tokens/s per chip, its MFU against the chip's
  vendor peak (`facts`, None: unknown) and its share of the measured `matmul` rate."""
  used = part["devices"]
  part["tokens_per_s_per_chip"] = part["tokens_per_s"] / used
  part["mfu"] = (
    part["model_flops_per_s"] / (used * facts["peak_tflops_bf16"] * 1e12) if facts else None
  )
  # the reference matmul runs on one device
  part["of_matmul"] = part["model_flops_per_s"] / (used * matmul)


def _machine(dev, device_count: int, chip: str) -> dict:
  """The record's machine facts: backend, first device's kind, device and process counts, chip
  name, host platform, CPUs and load, Python and JAX versions."""
  return {
    "backend": jax.default_backend(),
    "device_kind": dev.device_kind,
    "device_count": device_count,
    "process_count": jax.process_count(),
    "chip": chip or None,
    "platform": platform.platform(),
    "cpu_count": os.cpu_count(),
    "load_avg_1m": os.getloadavg()[0],
    "python": platform.python_version(),
    "jax": jax.__version__,
  }


def _step_breakdown(rollout: dict, train: dict) -> dict:
  """Seconds of each part of one step (prefill, decode, old and reference log-probs, update,
  weight sync), from the rollout and training records."""
  return {
    "prefill": rollout["prefill_s"],
    "decode": rollout["decode_s"],
    "old_logprobs": train["old_logprobs_s"],
    "ref_logprobs": train["ref_logprobs_s"],
    "update": train["update_s"],
    "weight_sync": train["weight_sync_s"],
  }


def _fmt(x, spec=".3g"):
  return "n/a" if x is None else format(x, spec)


def format_record(rec: dict) -> str:
  """Markdown summary table of one benchmark record."""
  m, r, t = rec["machine"], rec["rollout"], rec["train"]
  rows = [
    ("device", f"{m['device_kind']} x {m['device_count']} ({m['backend']})"),
    ("model", f"{rec['config']['preset']} {rec['config']['dtype']}"),
    (
      "mesh (data, fsdp, tensor, expert)",
      ", ".join(str(v) for v in rec["config"].get("mesh", {}).values()),
    ),
    (
      "GiB per device (params, optimizer, reference, rollout weights, kv cache, peak)",
      ", ".join(
        _fmt(None if v is None else v / 2**30)
        for v in rec.get("memory_bytes_per_device", {}).values()
      ),
    ),
    (
      "rollout tokens/s (prefill / decode)",
      f"{_fmt(r['tokens_per_s'])} ({_fmt(r['prefill_tokens_per_s'])} / "
      f"{_fmt(r['decode_tokens_per_s'])})",
    ),
    ("training tokens/s (GRPO step incl. old + ref log-probs)", _fmt(t["tokens_per_s"])),
    ("MFU rollout / training (vendor peak)", f"{_fmt(r['mfu'])} / {_fmt(t['mfu'])}"),
    (
      f"of measured matmul ({rec['reference']['name']}: "
      f"{rec['reference']['flops_per_s'] / 1e9:.1f} GFLOP/s)",
      f"{_fmt(r['of_matmul'])} / {_fmt(t['of_matmul'])}",
    ),
    ("step breakdown s", ", ".join(f"{k} {v:.3f}" for k, v in rec["step_breakdown_s"].items())),
  ]
  return "\n".join(["| measure | value |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows])


def compare(records: Sequence[dict], labels: Sequence[str], prices) -> tuple[str, list[dict]]:
  """Markdown comparison of benchmark records per chip and per dollar.

  Returns:
    (markdown text, one row dict per record with the derived per-chip and per-dollar figures).
  Raises:
    ValueError: no records, or a record of another schema.
  """
  if not records:
    raise ValueError("compare needs at least one benchmark JSON file")
  rows = []
  for rec, label in zip(records, labels):
    if rec.get("schema") != SCHEMA:
      raise ValueError(f"{label}: not a benchmark record of schema {SCHEMA}")
    m = rec["machine"]
    chip = m.get("chip")
    price = prices.chip(chip)["usd_per_chip_hour"] if chip else None
    n = m["device_count"]
    row = {
      "label": label,
      "device": f"{m['device_kind']} x {n}",
      "preset": rec["config"]["preset"],
      "date": rec["date"][:10],
      "usd_per_chip_hour": price,
    }
    for part in ("rollout", "train"):
      per_chip = rec[part]["tokens_per_s"] / rec[part].get("devices", n)
      row[f"{part}_per_chip"] = per_chip
      row[f"{part}_per_usd"] = per_chip * 3600 / price if price else None
      row[f"{part}_mfu"] = rec[part]["mfu"]
      row[f"{part}_of_matmul"] = rec[part].get("of_matmul")
    rows.append(row)
  head = [
    "machine",
    "device",
    "model",
    "date",
    "$/chip-h",
    "rollout tok/s/chip",
    "train tok/s/chip",
    "rollout tok/$",
    "train tok/$",
    "MFU rollout",
    "MFU train",
    "train / matmul",
  ]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rows:
    cells = [
      r["label"],
      r["device"],
      r["preset"],
      r["date"],
      _fmt(r["usd_per_chip_hour"], ".2f"),
      _fmt(r["rollout_per_chip"]),
      _fmt(r["train_per_chip"]),
      _fmt(r["rollout_per_usd"]),
      _fmt(r["train_per_usd"]),
      _fmt(r["rollout_mfu"], ".2%"),
      _fmt(r["train_mfu"], ".2%"),
      _fmt(r["train_of_matmul"], ".1%"),
    ]
    lines.append("| " + " | ".join(cells) + " |")
  notes = [
    f"Prices: on-demand list prices per chip-hour as of {prices.PRICES_AS_OF} "
    "(coevolve_jax/accelerators.py); tok/$ = tokens per chip-second * 3600 / price. Per chip = "
    "over the chips the phase used (the rollout engine decodes on one device). "
    "train / matmul: training model FLOP/s over the dense matmul rate measured on the "
    "same device in the same run (the reference where no vendor peak is known)."
  ]
  if len({r["preset"] for r in rows}) > 1:
    notes.append("Warning: the records measure different models; compare like with like.")
  return "\n".join(lines + [""] + notes) + "\n", rows


def plot(rows: Sequence[dict], path: str) -> None:
  """Bar charts of tokens/s per chip and tokens per dollar, rollout and training, to `path`."""
  import matplotlib  # noqa: PLC0415

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  x = np.arange(len(rows))
  for ax, unit, title in (
    (axes[0], "per_chip", "tokens/s per chip"),
    (axes[1], "per_usd", "tokens per dollar"),
  ):
    ax.set_title(title)
    ax.set_xticks(x, [r["label"] for r in rows], rotation=20)
    if not any(r[f"{part}_{unit}"] for r in rows for part in ("rollout", "train")):
      ax.text(0.5, 0.5, "no prices for these machines", ha="center", transform=ax.transAxes)
      continue
    for k, part in enumerate(("rollout", "train")):
      vals = [r[f"{part}_{unit}"] or 0.0 for r in rows]
      ax.bar(x + (k - 0.5) * 0.4, vals, 0.4, label=part)
    ax.set_yscale("log")
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
