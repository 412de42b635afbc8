"""Command-line tools around the training job, each run as `python -m coevolve_jax.cli.NAME`.

- `bench`: rollout and GRPO-step throughput on the local devices; `bench compare` tabulates
  records per chip and per dollar.
- `plan_device_memory`: per-device memory of a model preset on a mesh, from shapes only.
- `evaluate`: greedy BFCL multi-turn evaluation of a checkpoint.
- `prices` (a table, not a command): chip facts, Vertex AI machine types and on-demand prices,
  with the date they were recorded.

The training job (`coevolve_jax.main`) imports only `plan_device_memory`, for its start-up
memory check.
"""
