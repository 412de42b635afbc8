"""Command lines around the training job, each run as `python -m coevolve_jax.cli.NAME`; they
hold only argument parsing, printing and `main`, their logic lives in library modules.

- `bench`: rollout and GRPO-step throughput on the local devices; `bench compare` tabulates
  records per chip and per dollar (library: `coevolve_jax.benchmark`).
- `plan_device_memory`: per-device memory of a model preset on a mesh, from shapes only
  (library: `coevolve_jax.memory_plan`).
- `backtest`: replay a config change over a run's logged rollouts (library:
  `coevolve_jax.backtest`); `gate`: train candidate changes as branches and promote one
  (library: `coevolve_jax.gate`).

Chip facts and prices are `coevolve_jax.accelerators`; what each worker of a multi-host launch
gets is `coevolve_jax.launching`. Benchmark-specific tools live with their suite: greedy BFCL
multi-turn evaluation of a checkpoint is `python -m envs.bfcl.evaluate`.

The training job (`coevolve_jax.main`) imports none of them; its start-up memory check calls
`coevolve_jax.memory_plan` directly.
"""

import sys
from typing import NoReturn


def fail(message: str) -> NoReturn:
  """Ends a command line with one error line on stderr and exit status 2 (no usage text: the
  message says what to change)."""
  print(f"error: {message}", file=sys.stderr)
  sys.exit(2)
