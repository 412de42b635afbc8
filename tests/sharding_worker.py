"""Runs in a subprocess with 8 host CPU devices (tests/test_model_sharding.py starts it).

For a dense Qwen3 and a Qwen3-MoE tiny model it loads one saved checkpoint onto several meshes,
checks every parameter's sharding against the logical rules, and compares the jitted forward pass
with the single-device result. Prints one JSON line per check; exits non-zero on any failure.
"""

import json
import os
import sys
import tempfile

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from coevolve_jax.models import Qwen, from_pretrained, save_pretrained  # noqa: E402
from coevolve_jax.models.sharding import make_mesh, named_sharding, param_sharding  # noqa: E402

import kit  # noqa: E402

DENSE = kit.tiny_config(vocab_size=320, intermediate_size=96, rope_theta=1e4)
MOE = kit.tiny_config(
  vocab_size=320,
  intermediate_size=96,
  rope_theta=1e4,
  num_experts=4,
  num_experts_per_tok=2,
  moe_intermediate_size=48,
  norm_topk_prob=True,
)

CASES = [  # (config name, mesh axes, expected specs of a few parameters on that mesh)
  (
    "dense",
    {"fsdp": 8},
    {
      "embed_tokens": P(None, "fsdp"),
      "layers.0.self_attn.q_proj": P("fsdp", None, None),
      "layers.0.mlp.down_proj": P(None, "fsdp"),
    },
  ),
  (
    "dense",
    {"fsdp": 2, "tensor": 4},
    {
      "embed_tokens": P("tensor", "fsdp"),
      "layers.0.self_attn.q_proj": P("fsdp", "tensor", None),
      "layers.0.self_attn.k_proj": P("fsdp", None, None),  # 2 kv heads do not split 4 ways
      "layers.0.self_attn.o_proj": P("tensor", None, "fsdp"),
      "layers.0.mlp.gate_proj": P("fsdp", "tensor"),
    },
  ),
  (
    "moe",
    {"fsdp": 2, "expert": 4},
    {
      "layers.0.mlp.gate": P("fsdp", None),
      "layers.0.mlp.experts.gate_proj": P("expert", "fsdp", None),
      "layers.1.mlp.experts.down_proj": P("expert", None, "fsdp"),
    },
  ),
  (
    "moe",
    {"data": 2, "tensor": 2, "expert": 2},
    {
      "layers.0.mlp.experts.up_proj": P("expert", None, "tensor"),
      "layers.0.self_attn.k_proj": P(None, "tensor", None),
    },
  ),
]


def _spec(sharding, ndim):
  """PartitionSpec padded to ndim, without mesh axes of size 1 (they split nothing)."""
  entries = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
  out = []
  for e in entries:
    names = () if e is None else (e,) if isinstance(e, str) else tuple(e)
    names = tuple(n for n in names if sharding.mesh.shape[n] > 1)
    out.append(None if not names else names[0] if len(names) == 1 else names)
  return P(*out)


def main() -> int:
  assert jax.device_count() == 8, jax.devices()
  tmp = tempfile.mkdtemp()
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(0, 320, size=(8, 12)), jnp.int32)
  mask = np.ones((8, 12), np.int32)
  mask[1, :5] = 0
  mask[6, 9:] = 0
  mask = jnp.asarray(mask)
  folders, reference = {}, {}
  for name, cfg in (("dense", DENSE), ("moe", MOE)):
    folders[name] = save_pretrained(Qwen(cfg, rngs=nnx.Rngs(3)), os.path.join(tmp, name))
    single = from_pretrained(folders[name])
    reference[name] = np.asarray(single(ids, attention_mask=mask))
  failures = 0
  for name, axes, expected in CASES:
    mesh = make_mesh(axes)
    model = from_pretrained(folders[name], mesh=mesh)
    mismatched = []
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
      key = ".".join(map(str, path))
      value = var.get_value()
      want = param_sharding(mesh, var.get_metadata()["out_sharding"], value.shape)
      got = _spec(value.sharding, value.ndim)
      if got != _spec(want, value.ndim):
        mismatched.append((key, str(got), str(want.spec)))
      if key in expected and got != _spec(NamedSharding(mesh, expected[key]), value.ndim):
        mismatched.append((key, str(got), str(expected[key])))
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, ids, mask, graphdef=graphdef):
      return nnx.merge(graphdef, state)(ids, attention_mask=mask)

    with jax.set_mesh(mesh):
      batch = named_sharding(mesh, ("batch", None))
      logits = forward(state, jax.device_put(ids, batch), jax.device_put(mask, batch))
    err = float(np.max(np.abs(np.asarray(logits) - reference[name])))
    ok = err <= 1e-5 and not mismatched
    failures += not ok
    print(
      json.dumps(
        {
          "model": name,
          "mesh": dict(mesh.shape),
          "max_abs_err": err,
          "sharding_mismatches": mismatched[:5],
          "ok": ok,
        }
      ),
      flush=True,
    )
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
