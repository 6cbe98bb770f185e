#!/usr/bin/env bash
# Runs, on one GPU and within a time budget, every benchmark that issue 31's
# targets need, and writes all their tables under benchmarks/results/:
#
#   1. decoder_step.py, default variant (35.8M parameters), every row;
#   2. decoder_step.py --variant wide, JAX rows, then PyTorch rows, each in
#      its own process (the two frameworks' allocators do not share the
#      device's memory at this size);
#   3. ghost_step.py (the models of the "no slower than jax_privacy" target);
#   4. srg_step.py (the SRG difference step against the DP-SGD step).
#
# Usage (from anywhere; the environment must already have jax with CUDA,
# and optionally jax_privacy, torch and opacus; nothing is installed here):
#
#   bash benchmarks/run_gpu_suite.sh [BUDGET_SECONDS]      # default 1800
#   PYTHON=/path/to/bench-venv/bin/python bash benchmarks/run_gpu_suite.sh
#
# Each step gets at most what is left of the budget (and its own cap); a
# step that fails or runs out of time is reported and the next one runs.
# The script exits 0 when every step succeeded, 1 otherwise.
set -u

cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:${PYTHONPATH}}"
PY="${PYTHON:-python}"
BUDGET="${1:-1800}"
RESULTS=benchmarks/results
mkdir -p "${RESULTS}"

DEVICE="$("${PY}" -c 'import re, jax
print(re.sub(r"[^a-z0-9]+", "_", jax.devices()[0].device_kind.lower()).strip("_"))')" || {
  echo "jax does not start: ${DEVICE:-}" >&2; exit 1; }
echo "device ${DEVICE}; budget ${BUDGET} s; python ${PY}"
if [[ "${DEVICE}" == cpu ]]; then
  echo "warning: JAX sees no accelerator; these numbers will be CPU numbers" >&2
fi

START=${SECONDS}
FAILED=()

# step NAME CAP_SECONDS COMMAND...: runs COMMAND with the smaller of CAP and
# the budget left, its output teed to results/NAME_<device>.txt.
step() {
  local name="$1" cap="$2"
  shift 2
  local left=$(( BUDGET - (SECONDS - START) ))
  local limit=$(( cap < left ? cap : left ))
  local log="${RESULTS}/${name}_${DEVICE}.txt"
  if (( limit < 30 )); then
    echo "== ${name}: skipped, ${left} s of the budget left"
    FAILED+=("${name} (no time left)")
    return
  fi
  echo "== ${name}: $* (at most ${limit} s) -> ${log}"
  local begin=${SECONDS}
  timeout --kill-after=10 "${limit}" "$@" 2>&1 | tee "${log}"
  local status=${PIPESTATUS[0]}
  echo "== ${name}: exit ${status} after $(( SECONDS - begin )) s"
  if (( status != 0 )); then
    FAILED+=("${name} (exit ${status})")
  fi
}

JAX_ROWS='jax non-private,dpsgd ghost,dpsgd vmap,dpsgd auto,jax_privacy'
TORCH_ROWS='torch non-private,opacus ghost,opacus hooks'

step decoder_step 600 "${PY}" benchmarks/decoder_step.py \
  --output "${RESULTS}/decoder_step_${DEVICE}.md"
# Alone in its process, JAX may take more than its default 75% of the
# device: the per-example rows of the wide variant need it (XLA's CPU plan
# of `dpsgd vmap` is 71 GiB, `--compile_only`).
step decoder_step_wide_jax 600 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 \
  "${PY}" benchmarks/decoder_step.py \
  --variant wide --rows "${JAX_ROWS}" --rounds 5 --iters 5 \
  --output "${RESULTS}/decoder_step_wide_jax_${DEVICE}.md"
step decoder_step_wide_torch 450 "${PY}" benchmarks/decoder_step.py \
  --variant wide --rows "${TORCH_ROWS}" --rounds 5 --iters 5 \
  --output "${RESULTS}/decoder_step_wide_torch_${DEVICE}.md"
step ghost_step 450 "${PY}" benchmarks/ghost_step.py --rounds 7 --iters 10
step srg_step 300 "${PY}" benchmarks/srg_step.py

echo "== done in $(( SECONDS - START )) s; tables under ${RESULTS}/"
if (( ${#FAILED[@]} )); then
  printf '== failed: %s\n' "${FAILED[@]}"
  exit 1
fi
