#!/usr/bin/env bash
# The GPU suite and the benchmarks in one call on the device machine (docs/gpu.md).
#
#   run(command="bash scripts/gpu/run_suite.sh", carry=[".whl"], kind="nvidia-h200", timeout_s=600)
#
# Steps: install the carried wheels (.whl/) into $SITE, expose the repository as the `tidal` package
# (a symlink tree on PYTHONPATH reproduces pyproject's package-dir mapping: tidal.broker -> broker/, ...),
# run `pytest -m gpu tests/gpu`, then each benchmark that exists in benchmarks/, within a time budget.
# Everything lands in $OUT: suite.log (all output), junit.xml (pytest), results.json (environment,
# test outcomes, benchmark figures). Off the device, OUT defaults to out/gpu and PYTHON to python3.
#
# Settings (environment): STAGES ("tests bench"), TESTS (test paths, default tests/gpu; e.g.
# TESTS=tests/gpu/test_gpu_parallel.py runs that module alone), BENCHES (which benchmarks, default the
# first three of engine_throughput trainer_throughput weight_sync planner_memory), BUDGET_S (total seconds, 540),
# PYTEST_ARGS (extra pytest arguments, e.g. "-k engine"), ENGINE_BENCH_ARGS, TRAINER_BENCH_ARGS,
# WEIGHT_BENCH_ARGS, PLANNER_BENCH_ARGS, COLOCATED_BENCH_ARGS.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/out/gpu}
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}
PKG=${PKG:-/tmp/tidal-pkg}
WORK=${WORK:-/tmp/tidal-gpu}
STAGES=${STAGES:-tests bench}
TESTS=${TESTS:-tests/gpu}
BENCHES=${BENCHES:-engine_throughput trainer_throughput weight_sync}
BUDGET_S=${BUDGET_S:-540}
ENGINE_BENCH_ARGS=${ENGINE_BENCH_ARGS:---dtype bfloat16 --hidden 1024 --layers 16 --vocab 32768 --batch-sizes 1,64,256 --prompt-len 64 --new-tokens 128}
TRAINER_BENCH_ARGS=${TRAINER_BENCH_ARGS:-}
WEIGHT_BENCH_ARGS=${WEIGHT_BENCH_ARGS:-}
PLANNER_BENCH_ARGS=${PLANNER_BENCH_ARGS:-}
COLOCATED_BENCH_ARGS=${COLOCATED_BENCH_ARGS:-}
START=$SECONDS

mkdir -p "$OUT" "$WORK/bench"
rm -f "$WORK"/bench/*.json "$WORK"/*.status
exec > >(tee -a "$OUT/suite.log") 2>&1

# NVLink multicast stays off on these machines (KINDS.md); no output buffering in the logs
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TOKENIZERS_PARALLELISM=false

left() { echo $((BUDGET_S - (SECONDS - START))); }
stage() { echo; echo "=== $* (t=$((SECONDS - START))s, $(left)s left) ==="; }

stage "environment"
date -u
nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not available"
"$PY" -c 'import sys, torch, transformers; print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda, "| device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "| transformers", transformers.__version__)'

stage "install carried wheels into $SITE"
shopt -s nullglob
wheels=("$ROOT"/.whl/*.whl)
if ((${#wheels[@]})); then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}" \
        || { echo "wheel install failed"; exit 2; }
    echo "${#wheels[@]} wheels"
else
    echo "no .whl/ folder: name it in the run call's carry (docs/gpu.md lists the wheels)"
fi

stage "tidal as a package: symlink tree in $PKG"
rm -rf "$PKG" && mkdir -p "$PKG/tidal"
for entry in "$ROOT"/tidal/*; do ln -s "$entry" "$PKG/tidal/$(basename "$entry")"; done
for part in broker rollout trainer weights_sync; do ln -s "$ROOT/$part" "$PKG/tidal/$part"; done
export PYTHONPATH="$PKG:$SITE${PYTHONPATH:+:$PYTHONPATH}"
# the working directory holds the glue folder tidal/ alone; it must not shadow the tree (nor in children,
# e.g. `python -m tidal.cli serve`), so Python does not put it on sys.path
export PYTHONSAFEPATH=1
"$PY" -c 'import tidal.broker.types, tidal.rollout.embedded.scheduler, tidal.trainer.step, tidal.weights_sync.bucket, megatron.core, zmq, fastapi, uvicorn, pydantic; import tidal.broker as b; print("imports ok: tidal.broker from", b.__path__[0], "| megatron-core", megatron.core.__version__, "| pydantic", pydantic.__version__)' \
    || { echo "tidal or a carried dependency does not import"; exit 3; }

tests_rc=skipped
if [[ " $STAGES " == *" tests "* ]]; then
    stage "pytest -m gpu $TESTS"
    # shellcheck disable=SC2086  # TESTS and PYTEST_ARGS are lists of arguments
    timeout --kill-after=10 $(($(left) - 60 > 60 ? $(left) - 60 : 60)) \
        "$PY" -m pytest -m gpu $TESTS -v -rA --durations=15 -p no:cacheprovider \
        --junitxml "$OUT/junit.xml" ${PYTEST_ARGS:-}
    tests_rc=$?
fi

# run_bench NAME ARGS...: benchmarks/NAME.py with --device cuda (when it takes it) and --out (when it takes it)
run_bench() {
    local name=$1 script="benchmarks/$1.py"
    shift
    if [[ ! -f $script ]]; then
        echo "$script: not in this tree, skipped"
        echo "absent" >"$WORK/$name.status"
        return
    fi
    local budget=$(($(left) - 15))
    if ((budget < 30)); then
        echo "$script: skipped, ${budget}s of the budget left"
        echo "no-time" >"$WORK/$name.status"
        return
    fi
    local help args=()
    help=$("$PY" "$script" --help 2>&1)
    [[ $help == *"--device"* ]] && args+=(--device cuda)
    [[ $help == *"--out"* ]] && args+=(--out "$WORK/bench/$name.json")
    stage "$script ${args[*]} $* (limit ${budget}s)"
    timeout --kill-after=10 "$budget" "$PY" "$script" "${args[@]}" "$@"
    echo $? >"$WORK/$name.status"
}

if [[ " $STAGES " == *" bench "* ]]; then
    # shellcheck disable=SC2086  # the *_ARGS settings are lists of arguments
    [[ " $BENCHES " == *" engine_throughput "* ]] && run_bench engine_throughput $ENGINE_BENCH_ARGS
    # shellcheck disable=SC2086
    [[ " $BENCHES " == *" trainer_throughput "* ]] && run_bench trainer_throughput $TRAINER_BENCH_ARGS
    # shellcheck disable=SC2086
    [[ " $BENCHES " == *" weight_sync "* ]] && run_bench weight_sync $WEIGHT_BENCH_ARGS
    # shellcheck disable=SC2086
    [[ " $BENCHES " == *" planner_memory "* ]] && run_bench planner_memory $PLANNER_BENCH_ARGS
    # shellcheck disable=SC2086
    [[ " $BENCHES " == *" colocated_sync "* ]] && run_bench colocated_sync $COLOCATED_BENCH_ARGS
fi

stage "results.json"
"$PY" "$ROOT/scripts/gpu/collect_results.py" --out "$OUT/results.json" --junit "$OUT/junit.xml" \
    --bench-dir "$WORK/bench" --status-dir "$WORK" --tests-rc "$tests_rc" --seconds $((SECONDS - START))
echo "done in $((SECONDS - START))s; pytest exit: $tests_rc"
[[ $tests_rc == 0 || $tests_rc == skipped ]]
