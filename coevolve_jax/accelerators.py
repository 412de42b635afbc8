"""Accelerator facts and on-demand prices used by the command-line tools and the launchers.

Read by the device-memory planner (`cli.plan_device_memory`: HBM per chip), the benchmark
(`coevolve_jax.benchmark`: peak FLOP/s for MFU, prices for `compare`, the chip from JAX's device
kind) and the cloud launchers (`tpu/vertex.py`: Vertex AI machine types; `tpu/launch.py` names
the TPU software versions). Imported as `from coevolve_jax import accelerators`: it is package
data, so it works in any install, not only an editable one.

Prices are on-demand list prices in US dollars per chip-hour (per GPU for GPU machine types: the
machine's hourly price divided by its GPU count), us-central1, as recorded on `PRICES_AS_OF`
from the Cloud TPU and Compute Engine GPU pricing pages. They change, differ by region, and
exclude discounts (spot, committed use): check the pricing pages before relying on them, and edit
this file to change them.

Peak FLOP/s are the vendors' dense bf16 figures per chip (Cloud TPU system-architecture pages;
NVIDIA H100 / H200 SXM data sheets, without sparsity); model-FLOPs utilisation divides by them.
HBM is per chip, in GiB as the planner compares it (vendors quote GB; the difference is noted
where it matters: 16 GB v5e = 14.9 GiB).
"""

from __future__ import annotations

import copy

PRICES_AS_OF = "2026-11-30"

# name -> facts. `device_kinds`: what `jax.devices()[0].device_kind` reports for the chip.
# `vertex`: Vertex AI machine_type / accelerator_type for one host; `tpu_accelerator_type`:
# the gcloud `--accelerator-type` prefix (append the chip count, e.g. v5p-8 counts cores).
CHIPS: dict[str, dict] = {
  "v4": dict(
    kind="tpu",
    device_kinds=("TPU v4",),
    hbm_gib=32 * 1e9 / 2**30,
    peak_tflops_bf16=275.0,
    usd_per_chip_hour=3.22,
    tpu_accelerator_type="v4",
    runtime_version="tpu-ubuntu2204-base",
    vertex=dict(machine_type="ct4p-hightpu-4t", chips_per_host=4),
  ),
  "v5e": dict(
    kind="tpu",
    device_kinds=("TPU v5 lite", "TPU v5e"),
    hbm_gib=16 * 1e9 / 2**30,
    peak_tflops_bf16=197.0,
    usd_per_chip_hour=1.20,
    tpu_accelerator_type="v5litepod",
    runtime_version="v2-alpha-tpuv5-lite",
    vertex=dict(machine_type="ct5lp-hightpu-4t", chips_per_host=4),
  ),
  "v5p": dict(
    kind="tpu",
    device_kinds=("TPU v5", "TPU v5p"),
    hbm_gib=95 * 1e9 / 2**30,
    peak_tflops_bf16=459.0,
    usd_per_chip_hour=4.20,
    tpu_accelerator_type="v5p",
    runtime_version="v2-alpha-tpuv5",
    vertex=dict(machine_type="ct5p-hightpu-4t", chips_per_host=4),
  ),
  "v6e": dict(
    kind="tpu",
    device_kinds=("TPU v6 lite", "TPU v6e"),
    hbm_gib=32 * 1e9 / 2**30,
    peak_tflops_bf16=918.0,
    usd_per_chip_hour=2.70,
    tpu_accelerator_type="v6e",
    runtime_version="v2-alpha-tpuv6e",
    vertex=dict(machine_type="ct6e-standard-4t", chips_per_host=4),
  ),
  "h100": dict(
    kind="gpu",
    device_kinds=("NVIDIA H100 80GB HBM3", "NVIDIA H100"),
    hbm_gib=80 * 1e9 / 2**30,
    peak_tflops_bf16=989.0,
    usd_per_chip_hour=11.06,
    vertex=dict(
      machine_type="a3-highgpu-8g", accelerator_type="NVIDIA_H100_80GB", chips_per_host=8
    ),
  ),
  "h200": dict(
    kind="gpu",
    device_kinds=("NVIDIA H200", "NVIDIA H200 141GB HBM3e"),
    hbm_gib=141 * 1e9 / 2**30,
    peak_tflops_bf16=989.0,
    usd_per_chip_hour=10.60,
    vertex=dict(
      machine_type="a3-ultragpu-8g", accelerator_type="NVIDIA_H200_141GB", chips_per_host=8
    ),
  ),
  "a100": dict(
    kind="gpu",
    device_kinds=("NVIDIA A100-SXM4-80GB",),
    hbm_gib=80 * 1e9 / 2**30,
    peak_tflops_bf16=312.0,
    usd_per_chip_hour=5.07,
    vertex=dict(
      machine_type="a2-ultragpu-1g", accelerator_type="NVIDIA_A100_80GB", chips_per_host=1
    ),
  ),
}


def chip(name: str) -> dict:
  """A copy of the facts for chip `name` (e.g. "v5p", "h100").

  Raises:
    KeyError: an unknown chip, with the known names.
  """
  if name not in CHIPS:
    raise KeyError(f"unknown chip {name!r}; known: {sorted(CHIPS)}")
  return copy.deepcopy(CHIPS[name])


def chip_for_device_kind(device_kind: str) -> str | None:
  """The chip name whose `device_kinds` lists `device_kind`, or None (e.g. for "cpu")."""
  for name, facts in CHIPS.items():
    if device_kind in facts["device_kinds"]:
      return name
  return None
