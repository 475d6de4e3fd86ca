#!/usr/bin/env bash
# The GPU smoke test: the one script to run when a machine with GPUs is lent.
#
#   bench/gpu_smoke.sh [OUT]        (OUT defaults to reports/gpu-smoke)
#
# 1. prints nvidia-smi and what torch sees (versions, every device), and counts the GPUs through torch;
# 2. for every power of two N up to the GPU count, the catalogue under torchrun with N processes
#    (python -m torch.distributed.run --standalone --nproc-per-node N -m harness launch --backend nccl)
#    into OUT/launch-wsN;
# 3. the catalogue once on the harness's own rank pools (pytest cases/ --backend nccl, world sizes
#    auto: the same powers of two) into OUT/pools;
# 4. the launches merged into OUT/launches (python -m harness merge), and the pool matrix diffed
#    against them (python -m harness diff) into OUT/launch-vs-pools.txt: a cell that passes under
#    torchrun and not on the pools is a regression.
# A failing step does not stop the next ones; the script exits 1 if any failed, naming them.
#
# Environment: CASE_TIMEOUT  seconds one cell may take (--case-timeout; the harness's default if unset)
#              WRAPPERS      --wrappers for every step (default: every wrapper at every variant it
#                            applies to; on GPUs accelerate chooses FSDP and DeepSpeed by itself)
#              PYTHON        the interpreter with CUDA torch and the harness installed (default: python)
# Exit status: 0 every step passed, 1 some step failed, 2 nothing ran (no torch, or no GPU).
# The catalogue takes about ten seconds a world size on a CPU; a 1-GPU box finishes in a few minutes.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT="${1:-reports/gpu-smoke}"
PYTHON="${PYTHON:-python}"
timeout_args=()
WRAPPERS="${WRAPPERS:-ddp,fsdp2,fsdp1,deepspeed-z1,deepspeed-z2,deepspeed-z3}"
if [ -n "${CASE_TIMEOUT:-}" ]; then
    timeout_args=(--case-timeout "$CASE_TIMEOUT")
fi

echo "== devices"
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi || echo "(nvidia-smi exited $?)"
else
    echo "nvidia-smi: not found"
fi
# torch's view on stderr, the GPU count alone on stdout
if ! gpus="$("$PYTHON" - <<'EOF'
import sys
import torch

out = sys.stderr
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}", file=out)
count = torch.cuda.device_count() if torch.cuda.is_available() else 0
if count:
    print(f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}", file=out)
for index in range(count):
    props = torch.cuda.get_device_properties(index)
    print(f"cuda:{index} {props.name}, {props.total_memory / 2**30:.0f} GiB, "
          f"compute capability {props.major}.{props.minor}", file=out)
print(count)
EOF
)"; then
    echo "gpu_smoke: $PYTHON cannot import torch (install the machine's CUDA build of torch, then pip install -e .)" >&2
    exit 2
fi
if [ "$gpus" -lt 1 ]; then
    echo "gpu_smoke: no GPU found (torch.cuda.device_count() is 0 for $PYTHON): nothing to smoke-test" >&2
    exit 2
fi
echo "$gpus GPU(s); reports under $OUT"
mkdir -p "$OUT"

failed=()
launches=()
world_size=1
while [ "$world_size" -le "$gpus" ]; do
    dir="$OUT/launch-ws$world_size"
    rm -rf "$dir"  # no stale matrix from an earlier run may stand in for this one
    echo "== torchrun: $world_size process(es), nccl -> $dir"
    rc=0
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$world_size" \
        -m harness launch --backend nccl --report-dir "$dir" --wrappers "$WRAPPERS" \
        ${timeout_args[@]+"${timeout_args[@]}"} || rc=$?
    if [ "$rc" -ne 0 ]; then
        failed+=("torchrun launch at world size $world_size (exit $rc)")
    fi
    if [ -f "$dir/matrix.json" ]; then
        launches+=("$dir/matrix.json")
    fi
    world_size=$((world_size * 2))
done

echo "== rank pools: pytest cases/ --backend nccl -> $OUT/pools"
rm -rf "$OUT/pools"
rc=0
"$PYTHON" -m pytest cases/ -p no:cacheprovider --backend nccl --report-dir "$OUT/pools" --wrappers "$WRAPPERS" \
    ${timeout_args[@]+"${timeout_args[@]}"} || rc=$?
if [ "$rc" -ne 0 ]; then
    failed+=("pytest on the rank pools (exit $rc)")
fi

echo "== merge the launches -> $OUT/launches"
rm -rf "$OUT/launches" "$OUT/launch-vs-pools.txt"
if [ "${#launches[@]}" -eq 0 ]; then
    failed+=("merge (no launch wrote a matrix)")
else
    rc=0
    "$PYTHON" -m harness merge "${launches[@]}" --out "$OUT/launches" || rc=$?
    if [ "$rc" -ne 0 ]; then
        failed+=("merge of the launches (exit $rc)")
    fi
fi

echo "== diff: the launches (base) against the rank pools"
if [ -f "$OUT/launches/matrix.json" ] && [ -f "$OUT/pools/matrix.json" ]; then
    rc=0
    "$PYTHON" -m harness diff "$OUT/launches/matrix.json" "$OUT/pools/matrix.json" \
        --output "$OUT/launch-vs-pools.txt" || rc=$?
    if [ "$rc" -ne 0 ]; then
        failed+=("diff of the pools against the launches (exit $rc)")
    fi
else
    failed+=("diff (a matrix to compare is missing)")
fi

echo "== reports"
for report in "$OUT"/launch-ws*/matrix.md "$OUT/pools/matrix.md" "$OUT/launches/matrix.md" \
    "$OUT/launch-vs-pools.txt"; do
    if [ -f "$report" ]; then
        echo "  $report"
    fi
done
if [ "${#failed[@]}" -gt 0 ]; then
    echo "gpu_smoke: ${#failed[@]} step(s) failed:" >&2
    printf '  %s\n' "${failed[@]}" >&2
    exit 1
fi
echo "gpu_smoke: every step passed on $gpus GPU(s)"
