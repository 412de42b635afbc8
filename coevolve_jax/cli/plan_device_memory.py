"""Per-device memory plan for a model preset on a mesh, from shapes only (nothing is allocated).

    python -m coevolve_jax.cli.plan_device_memory --preset=qwen3_4b --mesh=fsdp=8 --batch=64 \
        --seq_len=4096 --num_slots=64 --cache_len=32768 --chip=v5p

prints parameter, gradient, optimizer-state (AdamW m and v), reference-policy, rollout-weights,
activation and KV-cache memory per device, and whether the sum fits the chip's HBM.
`--devices=8,16,32,...` instead prints one row per slice size with `fsdp=-1` (all devices on the
fsdp axis).

How each figure is obtained (the job's own rules, so the figures are what it allocates):
- Parameters: `nnx.eval_shape` of the real `Qwen` module in the master dtype (`--param_dtype`,
  the run's `model.param_dtype`); each parameter carries its logical axes (`out_sharding`),
  mapped to mesh axes by `sharding.param_spec`, the function the job shards with: a mesh axis
  that does not divide a dimension leaves that dimension replicated over it.
- Optimizer state: `jax.eval_shape` of the trainer's own optax transformation (`make_optimizer`)
  on the abstract master parameters; each moment leaf is sharded like its parameter.
- Gradients: one master-dtype parameter copy. Reference policy: one copy in the compute dtype
  (`--dtype`, the run's `model.dtype`), sharded like the parameters.
- Rollout weights (`PolicyTrainer.inference_params`): one compute-dtype copy in the engine's
  layout (`--weights_layout`: "gathered" = `trainer.inference_rules`, the fsdp dimension
  replicated; "train" = the parameters' layout); none when neither a cast nor a layout change is
  needed (the engine then decodes the parameters themselves).
- Activations (`--activations=compiled`, the default): XLA's own `memory_analysis()` of the
  trainer's loss and gradient compiled for one device's share of a micro-batch, minus the same
  step at 16 tokens (`compiled_activation_bytes`). This counts the layer being recomputed and
  every transient; it costs two compiles (seconds for Qwen3-4B on an idle CPU). With tensor > 1
  it is scaled by the share of the residuals (below) that the tensor axis splits.
- Activations (`--activations=residuals`): the residuals that `jax.vjp` of the trainer's
  `token_logprobs` keeps for the backward pass, read with `jax.eval_shape` at batch 1 and 2.
  Residual leaves whose shape changes with the batch are activations (the rest are parameters,
  counted above); per device they scale with the sequences per device
  (batch / (data * fsdp * expert)) and are divided by the tensor axis when a dimension is a
  tensor-sharded one (heads, kv heads, MLP, vocab; the `act_*`/`mlp` rules). With
  `--remat=full` (the default, as in the full-scale configs) the decoder keeps only each layer's
  input; the layer being recomputed in the backward pass, like any transient buffer inside one
  op, is not counted: a lower bound.
- KV cache: `KVCache.zeros` shapes ([slots, K, H, cache_len] keys and [slots, K, cache_len, H]
  values per layer) in the compute dtype, slots over (data, fsdp, expert), kv heads over tensor
  where they divide, as the rollout engine allocates it (`sharding.param_spec` of its logical axes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from absl import app, flags

from coevolve_jax import accelerators, flag_errors
from coevolve_jax.memory_plan import (
  ACTIVATION_SOURCES,
  format_table,
  parse_mesh,
  plan,
  planned_attention,
)
from coevolve_jax.models.kernels import ATTENTION_KERNELS


def _define_flags() -> None:
  """Command-line flags (defined only when run as a script, so importing defines none)."""
  flags.DEFINE_string("preset", "qwen3_4b", "QwenConfig preset name.")
  flags.DEFINE_string("mesh", "fsdp=1", "Mesh axis sizes, e.g. 'fsdp=8,tensor=2'.")
  flags.DEFINE_list("devices", [], "Sweep slice sizes (fsdp = devices / other axes).")
  flags.DEFINE_integer("batch", 64, "Sequences per optimizer step (global).")
  flags.DEFINE_integer("seq_len", 4096, "Tokens per training sequence.")
  flags.DEFINE_integer("micro_batches", 1, "Gradient-accumulation slices per step.")
  flags.DEFINE_string("remat", "full", "Decoder-layer rematerialisation: none, full, save_dots.")
  flags.DEFINE_integer("num_slots", 64, "Concurrent rollout episodes (global).")
  flags.DEFINE_integer("cache_len", 32768, "KV-cache tokens per episode.")
  flags.DEFINE_string("dtype", "bfloat16", "Compute dtype: activations, reference, weights, cache.")
  flags.DEFINE_string("param_dtype", "float32", "Master parameter / gradient / optimizer dtype.")
  flags.DEFINE_string("weights_layout", "gathered", "Rollout weights layout: gathered or train.")
  flags.DEFINE_string(
    "chip", "", "Chip name of coevolve_jax/accelerators.py (for the fits column)."
  )
  flags.DEFINE_float("headroom", 0.9, "Share of HBM the plan may use.")
  flags.DEFINE_enum(
    "attention",
    "auto",
    list(ATTENTION_KERNELS),
    "Attention kernel (model.attention) whose activations are planned; 'auto' picks the one of "
    "--chip's kind (splash on TPU, cuDNN on GPU, planned as splash off a GPU), else this "
    "machine's.",
  )
  flags.DEFINE_enum(
    "activations",
    "compiled",
    list(ACTIVATION_SOURCES),
    "Activation figure: the compiled step's temporaries (compiles the step for this machine's "
    "backend; XLA:CPU computes bfloat16 in float32, so its figure is up to 2x an accelerator's) "
    "or the residuals the backward pass keeps (shapes only, no compile).",
  )


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  F = flags.FLAGS  # noqa: N806
  hbm = backend = None
  try:
    if F.chip:
      hbm, backend = accelerators.chip(F.chip)["hbm_gib"], accelerators.chip(F.chip)["kind"]
    base = parse_mesh(F.mesh)
    attention = planned_attention(F.attention, backend)
  except (ValueError, KeyError) as e:
    raise app.UsageError(e.args[0] if e.args else str(e)) from None
  meshes = [base]
  if F.devices:
    others = math.prod(v for k, v in base.items() if k != "fsdp")
    meshes = []
    for item in F.devices:
      n = int(item) if item.strip().isdigit() else 0
      if n < 1:
        raise app.UsageError(f"--devices: {item!r} is not a device count (an integer >= 1)")
      if n % others:
        raise app.UsageError(f"{n} devices do not divide by data*tensor*expert = {others}")
      meshes.append({**base, "fsdp": n // others})
  try:
    plans = [
      plan(
        F.preset,
        m,
        batch=F.batch,
        seq_len=F.seq_len,
        num_slots=F.num_slots,
        cache_len=F.cache_len,
        dtype=F.dtype,
        param_dtype=F.param_dtype,
        weights_layout=F.weights_layout,
        micro_batches=F.micro_batches,
        remat=F.remat,
        activations=F.activations,
        attention=attention,
      )
      for m in meshes
    ]
  except ValueError as e:  # an unknown preset, dtype, layout or remat policy
    raise app.UsageError(str(e)) from None
  print(
    f"{F.preset}: {plans[0].num_params / 1e9:.3f}B parameters, {F.param_dtype} master, "
    f"{F.dtype} compute, {F.weights_layout} rollout weights; "
    f"batch {F.batch} x {F.seq_len} tokens in {F.micro_batches} micro-batches, "
    f"{F.num_slots} slots x "
    f"{F.cache_len} cache tokens; {plans[0].activation_source} activations "
    f"({jax.default_backend()}, {attention} attention); GiB per device"
  )
  print(format_table(plans, hbm, F.headroom))


if __name__ == "__main__":
  _define_flags()
  flag_errors.run(main)
