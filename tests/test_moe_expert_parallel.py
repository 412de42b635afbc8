"""Expert parallelism for Qwen3-MoE (issue 15, item 6): on 8 host devices with an `expert` axis of
4, each device holds a quarter of the experts, the MoE block computes only its own experts' token
copies inside `jax.shard_map` (`SparseMoE._forward_expert_parallel`), and logits, the KV-cached
`decode_routed`, routing replay and the loss gradient equal the single-device model's.

The device count of a JAX process is fixed at start-up, so the checks run in one child process
(`_child`, started by `run_child`) that checks several meshes in turn.
"""

import contextlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from host_devices import run_child

from coevolve_jax.models import Qwen
from coevolve_jax.models import sharding as shd
from coevolve_jax.models import qwen
from coevolve_jax.models.qwen import KVCache, SparseMoE

import kit

CFG = kit.tiny_config(
  vocab_size=80,
  hidden_size=32,
  intermediate_size=48,
  num_hidden_layers=1,
  head_dim=8,
  rope_theta=1e4,
  num_experts=12,  # 3 per device on expert=4, not divisible by 8; no other dimension is 12
  num_experts_per_tok=2,
  moe_intermediate_size=16,
  norm_topk_prob=True,
)
B, T = 8, 6  # the loss reads T + 1 tokens, the forward and decode T


def test_expert_parallel_block_equals_one_device():
  run_child(__file__, "ep", timeout=300)


@pytest.mark.slow
def test_expert_parallel_block_equals_one_device_on_more_meshes():
  run_child(__file__, "ep_more", timeout=300)


def test_ragged_all_to_all_matches_its_definition():
  run_child(__file__, "ragged", timeout=120)


def _placed(model: Qwen, mesh) -> Qwen:
  """A copy of `model` with every parameter in its logical sharding on `mesh` (as `build`)."""
  graphdef, state = nnx.split(model)

  def place(var):
    value = var.get_value()
    sharding = shd.param_sharding(mesh, var.get_metadata()["out_sharding"], value.shape)
    return var.replace(jax.device_put(value, sharding))

  state = jax.tree.map(place, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.merge(graphdef, state)


def _results(model, mesh, ids, mask, routing, full=True):
  """{part: result} of `model` on `mesh` (one device for None), in one jitted function: "logits"
  of the forward over ids[:, :-1]; unless not `full`, "decode", the hidden states and routing of
  a KV-cached prefill of ids[:, :-1], and "grad", the next-token loss over ids and its gradient,
  with `routing` replayed, through `jax.checkpoint`. Also returns the compiled HLO."""
  graphdef, state = nnx.split(model)
  params, rest = nnx.split_state(state, nnx.Param, ...)

  def run(params, rest, ids, mask):
    model = nnx.merge(graphdef, params, rest)
    logits = model(ids[:, :-1], attention_mask=mask[:, :-1])
    if not full:
      return {"logits": logits}
    cache = KVCache.zeros(CFG, B, T)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    hidden, _, used = model.decode_routed(ids[:, :-1], pos, cache, jnp.zeros(B, jnp.int32))

    @jax.checkpoint
    def loss(params):
      model = nnx.merge(graphdef, params, rest)
      hidden = model.hidden_states(ids[:, :-1], None, mask[:, :-1], routing_btlk=routing)
      logp = jax.nn.log_softmax(model.logits(hidden), axis=-1)
      return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))

    return {"logits": logits, "decode": (hidden, used), "grad": jax.value_and_grad(loss)(params)}

  if mesh is not None:
    batch = shd.named_sharding(mesh, ("batch", None))
    ids, mask = jax.device_put(ids, batch), jax.device_put(mask, batch)
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    compiled = jax.jit(run).lower(params, rest, ids, mask).compile()
    return compiled(params, rest, ids, mask), compiled.as_text()


def _close(got, want, what):
  for part in got:
    for x, y in zip(jax.tree.leaves(got[part]), jax.tree.leaves(want[part])):
      np.testing.assert_allclose(
        np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5, err_msg=f"{what}: {part}"
      )


_COLLECTIVE = re.compile(
  r"= \(?([^=]*?) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)\("
)


def _not_expert_parallel(hlo: str) -> list[str]:
  """Collectives in `hlo` that an expert-parallel MoE block does not need: an all-gather of a
  whole expert kernel ([E, ...]), or any collective of token-copy activations of the whole batch
  ([B T k, n] rows, n > 1: what the XLA partitioner moves when it spreads one sort of all the
  batch's copies over the devices). Gradients of the routing weights ([B T k] values) may move."""
  copies = B * T * CFG.num_experts_per_tok
  bad = []
  for line in hlo.splitlines():
    m = _COLLECTIVE.search(line)
    if not m:
      continue
    shapes = [[int(d) for d in s.split(",") if d] for s in re.findall(r"\[([\d,]*)\]", m[1])]
    if any(s[:1] == [CFG.num_experts] and len(s) == 3 for s in shapes) or any(
      len(s) == 2 and s[0] == copies and s[1] > 1 for s in shapes
    ):
      bad.append(line.strip()[:160])
  return bad


def _rows_gathered(hlo: str) -> list[str]:
  """All-gathers in `hlo` of token rows ([b, T, D] activations): what the gather dispatch does
  and the all-to-all dispatch must not."""
  bad = []
  for line in hlo.splitlines():
    m = _COLLECTIVE.search(line)
    if m and m[2] == "all-gather" and re.search(rf"\[\d+,{T},{CFG.hidden_size}\]", m[1]):
      bad.append(line.strip()[:160])
  return bad


def _ragged_child():
  """`qwen.ragged_all_to_all` (here: its all_to_all equivalent) against a numpy reading of
  `jax.lax.ragged_all_to_all`'s definition, on an axis of 8 devices with random ragged chunks."""
  n, c, width, m = 8, 36, 3, 40
  rng = np.random.default_rng(2)
  sizes = rng.integers(0, 5, (n, n))  # sizes[i, j]: rows device i sends to device j
  sizes[3] = 0  # a device that sends nothing
  sizes[:, 5] = 0  # and one that receives nothing
  operand = rng.normal(size=(n, c, width)).astype(np.float32)
  output = rng.normal(size=(n, m, width)).astype(np.float32)
  input_offsets = np.zeros((n, n), np.int32)
  output_offsets = np.zeros((n, n), np.int32)
  for i in range(n):
    # gaps between the chunks at both ends, and receivers filled from a shifted start
    input_offsets[i] = np.concatenate([[0], np.cumsum(sizes[i])[:-1]]) + (i % 2)
  for j in range(n):
    output_offsets[:, j] = np.concatenate([[0], np.cumsum(sizes[:, j])[:-1]]) + 2 * (j % 3)
  want = output.copy()
  for i in range(n):
    for j in range(n):
      rows = operand[i, input_offsets[i, j] : input_offsets[i, j] + sizes[i, j]]
      want[j, output_offsets[i, j] : output_offsets[i, j] + sizes[i, j]] = rows
  mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))

  def body(operand, output, io, ss, oo, rs):
    return qwen.ragged_all_to_all(operand[0], output[0], io[0], ss[0], oo[0], rs[0], axis_name="x")[
      None
    ]

  run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  got = run(
    operand, output, input_offsets, sizes.astype(np.int32), output_offsets, sizes.T.astype(np.int32)
  )
  np.testing.assert_array_equal(np.asarray(got), want)
  print("ragged OK")


def _child(more: bool):
  """The expert-parallel checks; `more`: on the meshes and rules that `make test` leaves to the
  slow run (data x expert and tensor x expert with the gather dispatch, rows whole over the
  expert group, the all-to-all dispatch on tensor x expert) instead of the others."""
  assert jax.device_count() == 8, jax.devices()
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, T + 1)), jnp.int32)
  mask = np.ones((B, T + 1), np.int32)
  mask[1, :2] = 0
  mask = jnp.asarray(mask)
  routing = rng.integers(0, CFG.num_experts, (B, T, len(CFG.moe_layers), 2))
  routing[0, :3] = -1  # some tokens not recorded: the router chooses
  routing = jnp.asarray(routing, jnp.int16)
  model = nnx.jit(lambda: Qwen(CFG, rngs=nnx.Rngs(1)))()  # one compile, not one per parameter
  single, _ = _results(model, None, ids, mask, routing)
  free = np.asarray(single["decode"][1])  # the router's own choice: the replayed record differs
  assert np.mean(free[2:] != np.asarray(routing)[2:]) > 0.5

  meshes = (
    [{"data": 2, "expert": 4}, {"tensor": 2, "expert": 4}] if more else [{"fsdp": 2, "expert": 4}]
  )
  for axes in meshes:
    mesh = shd.make_mesh(axes)
    placed = _placed(model, mesh)
    for g, (first, _) in enumerate(placed.block_spans):
      if not CFG.is_moe_layer(first):
        continue
      for name in ("gate_proj", "up_proj", "down_proj"):  # stacked: [L_g, E, ...]
        kernel = getattr(placed.blocks[g].mlp.experts, name).get_value()
        shapes = {s.data.shape[1] for s in kernel.addressable_shards}
        assert shapes == {CFG.num_experts // 4}, (axes, name, shapes)
    got, hlo = _results(placed, mesh, ids, mask, routing)
    _close(got, single, str(axes))
    assert "all-reduce" in hlo and not _not_expert_parallel(hlo), (axes, _not_expert_parallel(hlo))
    print("ep", axes, "ok", flush=True)

  if not more:
    # The HLO check can fail: the XLA partitioner, given the single-device dispatch on the same
    # mesh, sorts the whole batch's token copies on every device and all-reduces them.
    mesh = shd.make_mesh({"fsdp": 2, "expert": 4})
    plan = SparseMoE._expert_parallel_plan
    SparseMoE._expert_parallel_plan = lambda self, mesh, shape: None
    try:
      got, hlo = _results(_placed(model, mesh), mesh, ids, mask, routing, full=False)
    finally:
      SparseMoE._expert_parallel_plan = plan
    _close(got, single, "partitioner")
    assert _not_expert_parallel(hlo), "the partitioner path passed the expert-parallel HLO check"
  else:
    # The rules split the rows over `expert` too (the gather dispatch above all-gathers them in
    # the block and reduce-scatters the sums back). With rows whole on every device of an expert
    # group (a table without `expert` in "batch"), nothing is gathered: partial sums are psum'd.
    rules = dict(shd.LOGICAL_RULES)
    shd.LOGICAL_RULES["batch"] = ("data", "fsdp")
    try:
      mesh = shd.make_mesh({"data": 2, "expert": 4})
      got, hlo = _results(_placed(model, mesh), mesh, ids, mask, routing)
    finally:
      shd.LOGICAL_RULES.update(rules)
    _close(got, single, "rows whole over expert")
    assert "reduce-scatter" not in hlo and not _not_expert_parallel(hlo), _not_expert_parallel(hlo)
    print("ep rows whole over expert ok", flush=True)

  # The all-to-all dispatch (`_ep_all_to_all`): each device's copies sent to their experts'
  # devices and back. XLA:CPU has no ragged_all_to_all, so `qwen.ragged_all_to_all` runs its
  # all_to_all equivalent here (checked against the op's documented semantics in
  # test_ragged_all_to_all_matches_its_definition); no rows are gathered.
  # (fsdp x expert differs from data x expert only in the kernels' FSDP gather, checked above.)
  a2a = nnx.jit(lambda: Qwen(CFG, rngs=nnx.Rngs(1), expert_dispatch="all_to_all"))()
  for axes in [{"tensor": 2, "expert": 4}] if more else [{"data": 2, "expert": 4}]:
    mesh = shd.make_mesh(axes)
    got, hlo = _results(_placed(a2a, mesh), mesh, ids, mask, routing)
    _close(got, single, f"all_to_all {axes}")
    assert "all-to-all" in hlo and not _rows_gathered(hlo), (axes, _rows_gathered(hlo))
    assert not _not_expert_parallel(hlo), (axes, _not_expert_parallel(hlo))
    print("ep all_to_all", axes, "ok", flush=True)
  if more:
    print("ep_more OK")
    return

  # On TPU and GPU the native op: the same program lowers with jax.lax.ragged_all_to_all (XLA:CPU
  # cannot compile it, so only the lowering is checked).
  native = qwen.native_ragged_all_to_all
  qwen.native_ragged_all_to_all = lambda backend=None: True
  try:
    mesh = shd.make_mesh({"fsdp": 2, "expert": 4})
    placed = _placed(a2a, mesh)
    graphdef, state = nnx.split(placed)
    params, rest = nnx.split_state(state, nnx.Param, ...)

    def loss(params, ids):
      model = nnx.merge(graphdef, params, rest)
      return jnp.mean(model(ids) ** 2)

    with jax.set_mesh(mesh):
      text = jax.jit(jax.grad(loss)).lower(params, ids[:, :-1]).as_text()
  finally:
    qwen.native_ragged_all_to_all = native
  # forward: copies, their experts, results back; backward: the transposes of the two float ones
  assert text.count("ragged_all_to_all") >= 5, text.count("ragged_all_to_all")
  print("ep native lowering ok", flush=True)

  # Two MoE blocks as the body of a jax.lax.scan over layers, rematerialised: same loss, same
  # input gradient as a Python loop over them on one device.
  blocks = [SparseMoE(CFG, rngs=nnx.Rngs(i), dtype=jnp.float32) for i in (3, 4)]
  graphdef = nnx.graphdef(blocks[0])
  x = jnp.asarray(rng.normal(size=(B, T, CFG.hidden_size)), jnp.float32)

  def layer(x, state):
    return x + nnx.merge(graphdef, state)(x), None

  def scanned(states, x):
    return jnp.sum(jax.lax.scan(jax.checkpoint(layer), x, states)[0] ** 2)

  def looped(states, x):
    for state in states:
      x = layer(x, state)[0]
    return jnp.sum(x**2)

  want = jax.jit(jax.value_and_grad(looped, argnums=1))([nnx.state(m) for m in blocks], x)
  mesh = shd.make_mesh({"fsdp": 2, "expert": 4})
  states = [nnx.state(_placed(m, mesh)) for m in blocks]
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *states)
  with jax.set_mesh(mesh):
    got = jax.jit(jax.value_and_grad(scanned, argnums=1))(stacked, x)
  _close({"scan": got}, {"scan": want}, "scan over layers")

  # An expert axis that does not divide E: experts stay replicated, the single-device dispatch.
  mesh = shd.make_mesh({"expert": 8})
  placed = _placed(model, mesh)
  assert placed.blocks[0].mlp.experts.gate_proj.get_value().sharding.spec[1] is None
  got, _ = _results(placed, mesh, ids, mask, routing, full=False)
  _close(got, single, "E=12 on expert=8")
  print("ep OK")


if __name__ == "__main__":
  if sys.argv[1:] in (["ep"], ["ep_more"]):
    _child(more=sys.argv[1] == "ep_more")
  if sys.argv[1:] == ["ragged"]:
    _ragged_child()
