#!/usr/bin/env bash
# The GPU checks in one prepared run, for a session that is lent a GPU (one H100/H200 with
# torch + CUDA already installed, no network). It needs no install: fsdp2 is pure Python and
# runs from this checkout. It writes its logs, the JSON and the markdown report under $OUT
# (the device tool's output folder) or benchmarks/results/gpu:
#
#   1. the CUDA cases of tests/test_device.py (NCCL world size 1, and the fake process group
#      with CUDA tensors): parity with torch and the non-sharded model, CPU offload, no memory
#      kept across steps; the optimizer fast path with CUDA's foreach and fused kernels and
#      capturable=True, bitwise against a plain replay and the DTensor path;
#   2. optimizer.step() (AdamW for-loop and foreach) and clip_grad_norm_ on CUDA tensors,
#      8-rank fake process group: fsdp2's fast path, the DTensor path, torch's fully_shard
#      and plain shards (benchmarks/optimizer.py --device cuda), the issue-26 ratios; early,
#      as it is short;
#   3. the GPU step-time and memory target: benchmarks/compare.py --device cuda --config gpu-1b
#      (a ~0.94B-parameter Llama, bf16, one 2048-token sequence per step), fsdp2 against
#      torch's fully_shard in one run, then the report;
#   4. one schedule trace of gpu-1b (fsdp2.trace_schedule, timing events on the CUDA
#      streams): its summary in gpu_trace.log and the JSON, the step's PNG trace_ws1.png,
#      and the tracing cost against untraced fsdp2 in the same rounds;
#   5. the divergence checks on and off (benchmarks/divergence.py) on gpu-1b with CUDA
#      tensors on an 8-rank fake process group: fsdp2's CUDA path with the fingerprints'
#      readbacks and the wait before the optimizer step, without communication.
#
# Each part has its own time limit, so the whole run ends within about 10 minutes; a part
# that fails does not stop the next one. Usage (device tool): bash benchmarks/gpu_session.sh
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-benchmarks/results/gpu}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python=${PYTHON:-python3}

{
    date -u
    git log -1 --format='commit %h %s' 2>/dev/null || echo "commit: unknown (not a git checkout)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    "$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
"device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)'
} 2>&1 | tee "$out/environment.txt"

status=0
echo "== CUDA tests (tests/test_device.py -m gpu)"
timeout 240 "$python" -m pytest -m gpu -q -p no:cacheprovider tests/test_device.py 2>&1 |
    tee "$out/gpu_tests.log" || status=1

echo "== optimizer step and clipping: CUDA tensors, 8-rank fake process group"
timeout 150 "$python" benchmarks/optimizer.py --device cuda --world-size 8 --repeats 10 \
    --warmup 3 --json "$out/gpu-optimizer.json" 2>&1 | tee "$out/gpu_optimizer.log" || status=1
echo "== benchmark: gpu-1b on one GPU, fsdp2 vs torch"
timeout 420 "$python" benchmarks/compare.py --device cuda --config gpu-1b --steps 10 \
    --warmup 3 --ttfs-repeats 2 --json "$out/gpu-1b.json" 2>&1 | tee "$out/gpu_bench.log" ||
    status=1
if [ -f "$out/gpu-1b.json" ]; then
    "$python" -m benchmarks.report --json "$out/gpu-1b.json" --out "$out/gpu-1b.md" || status=1
fi
echo "== schedule trace: gpu-1b on one GPU, fsdp2 traced and untraced"
timeout 150 "$python" benchmarks/compare.py --device cuda --config gpu-1b --impls fsdp2 --trace \
    --steps 4 --warmup 2 --ttfs-repeats 0 --no-memory --json "$out/gpu-1b-trace.json" 2>&1 |
    tee "$out/gpu_trace.log" || status=1
echo "== divergence checks: gpu-1b, CUDA tensors on an 8-rank fake process group, on/off"
timeout 150 "$python" benchmarks/divergence.py --device cuda --config gpu-1b --fake-world-size 8 \
    --rounds 6 --warmup 2 --inside-steps 2 --json "$out/gpu-1b-divergence.json" 2>&1 |
    tee "$out/gpu_divergence.log" || status=1
exit "$status"
