#!/usr/bin/env bash
# The prepared accelerator check (issue 17): one command for a machine with a GPU or TPU and no
# internet, in stages, each with its own time limit and log, about 15 minutes in all.
#
#   bash benchmarks/accelerator_check.sh [OUT_DIR]        (from the repository root)
#
# OUT_DIR (default $OUT, else ./accelerator_check_out) receives at most 8 files:
#   summary.md   one row per stage: exit status, seconds, limit; the machine and the date
#   env.log      Python, JAX and device report (memory limit per device), GPU name
#   bench.log    `coevolve_jax.cli.bench` at the Qwen3-0.6B shape (random weights), and
#   bench.json   its record (compare it with `python -m coevolve_jax.cli.bench compare`)
#   decode.log   benchmarks/rollout_bench.py: our engine against transformers `generate`, and
#                a decode step at 640 filled entries against its memory bound (issue 17's 40%);
#                then benchmarks/attention_kernels.py: each attention kernel of the backend
#                (splash on TPU, cuDNN on GPU, the blocked XLA path) against the plain XLA
#                softmax, one layer's forward and backward at 4k and 16k tokens, and a decode
#                step's attention at batch 64 against its memory bound (the backend's decode
#                kernel: ragged on GPU, paged on TPU; stage "attention");
#                then benchmarks/decode_step.py: the engine's whole decode step at the
#                Qwen3-0.6B shape (random, bfloat16), 64 slots of a 4,096-entry cache, stacked
#                and unrolled caches, "auto" (the ragged decode kernel on a GPU, the paged
#                one on a TPU) against "xla"
#                (stage "engine_decode")
#   memory.log   benchmarks/mesh_memory.py: per-device memory of the job's largest prefill (64
#                slots x 2,048 tokens into a 4,096-entry cache) and a GRPO epoch at the Qwen3-0.6B
#                shape on all local devices, against the memory planner's figures
#   main.log     the CPU preset's main job, shrunk, with per-step compile counts and step times
#   tests.log    float32 parity with transformers (under model.matmul_precision "highest"), and
#                the attention kernels' tests (stage "kernels": on a GPU, cuDNN itself in
#                bfloat16 against the float32 softmax, forward and gradient)
#
# Dependencies: the machine's image is expected to hold JAX for its accelerator, Flax, optax,
# orbax, transformers, torch, tokenizers, safetensors and numpy. The project's other pure-Python
# dependencies travel as wheels in $WHEELS (default .whl beside this repository's root), made on
# a connected machine with benchmarks/fetch_accelerator_wheels.sh; they are installed into a
# temporary folder on PYTHONPATH, nothing is installed system-wide. Stage limits (seconds) can be
# changed with the variables below; LIMIT_SCALE multiplies them all (e.g. 0.5 for a dry run).
# STAGES (default all: "env bench decode attention engine_decode memory main tests kernels") runs
# a subset, in
# the order above, for a machine lent for less than the whole check.
set -u
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-accelerator_check_out}}
WHEELS=${WHEELS:-.whl}
PY=${PYTHON:-python3}
SCALE=${LIMIT_SCALE:-1}
mkdir -p "$OUT_DIR"
summary="$OUT_DIR/summary.md"
STAGES=${STAGES:-env bench decode attention engine_decode memory main tests kernels}
limit() { awk -v s="$1" -v k="$SCALE" 'BEGIN { v = int(s * k); print (v < 5 ? 5 : v) }'; }

site=$(mktemp -d)/site
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    "$WHEELS"/*.whl >"$OUT_DIR/env.log" 2>&1 || echo "warning: wheel install failed" >>"$OUT_DIR/env.log"
fi
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false

{
  echo "# Accelerator check"
  echo
  echo "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo
  echo "| stage | exit status | seconds | limit (s) |"
  echo "| --- | --- | --- | --- |"
} >"$summary"

# stage NAME LIMIT_S COMMAND...: runs COMMAND under `timeout`, output appended to NAME.log (or
# to $STAGE_LOG.log: the device tool brings back at most 8 files).
stage() {
  local name=$1 lim log
  case " $STAGES " in *" $name "*) ;; *) return 0 ;; esac
  lim=$(limit "$2")
  log="$OUT_DIR/${STAGE_LOG:-$name}.log"
  shift 2
  local start=$SECONDS
  echo "== $name (limit ${lim} s): $*" >>"$log"
  timeout --kill-after=10 "$lim" "$@" >>"$log" 2>&1
  local rc=$?
  local note=$rc
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then note="$rc (timed out)"; fi
  echo "| $name | $note | $((SECONDS - start)) | $lim |" >>"$summary"
  echo "$name: exit $note after $((SECONDS - start)) s"
}

stage env "${ENV_S:-20}" bash -c "uname -a; nproc; free -g 2>/dev/null | head -2;
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv; $PY benchmarks/env_report.py"

stage bench "${BENCH_S:-140}" "$PY" -m coevolve_jax.cli.bench --config=configs/bfcl.py \
  --config.model.preset=qwen3_0_6b --out="$OUT_DIR/bench.json"

stage decode "${DECODE_S:-90}" "$PY" benchmarks/rollout_bench.py --peers=transformers \
  --dtype=bfloat16 --bound=0 --batches=64 --prompt_len=512 --new_tokens=128 --layers=28 \
  --hidden=1024 --head_dim=128 --tied=1 --kv_lengths=640 --repeats=2 --decode_steps=1,8

STAGE_LOG=decode stage attention "${ATTENTION_S:-90}" "$PY" benchmarks/attention_kernels.py \
  --seqs=4096,16384 --decode_batch=64 --decode_len=4096

STAGE_LOG=decode stage engine_decode "${ENGINE_DECODE_S:-150}" "$PY" benchmarks/decode_step.py \
  --preset=qwen3_0_6b --dtype=bfloat16 --slots=64 --cache_len=4096 --lengths=4096,ragged \
  --repeats=5

stage memory "${MEMORY_S:-240}" "$PY" benchmarks/mesh_memory.py --config=configs/bfcl.py \
  --config.model.preset=qwen3_0_6b --cache_len=4096 --prompt_len=2048 --train_rows=8 \
  --train_seq=2048

run_dir=$(mktemp -d)/run
stage main "${MAIN_S:-120}" bash -c "
  $PY -m coevolve_jax.main --config=configs/bfcl.py:cpu --workdir=$run_dir \
    --config.train.steps=4 --config.eval.max_tasks=2 --config.warmstart.steps=40 \
  && $PY - <<EOF
import json
for line in open('$run_dir/metrics.jsonl'):
  row = json.loads(line)
  if 'compile/count' in row:
    keep = ('step', 'compile/count', 'compile/seconds', 'timing/rollout', 'timing/train',
            'reward/mean')
    programs = {k[len('compile/program/'):]: v for k, v in row.items()
                if k.startswith('compile/program/')}
    print({k: row.get(k) for k in keep}, programs)
EOF"

stage tests "${TESTS_S:-100}" "$PY" -m pytest -q -x -p no:cacheprovider tests/test_qwen_parity.py

STAGE_LOG=tests stage kernels "${KERNELS_S:-90}" "$PY" -m pytest -q -p no:cacheprovider \
  tests/test_attention_kernels.py -k "cudnn or ragged or paged"

echo >>"$summary"
echo "Logs: one file per stage beside this one. Machine: see env.log." >>"$summary"
cat "$summary"
