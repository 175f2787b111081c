# The device calls that wrote sweep-e2e-mrpc-800s-warmup-h100.json, sweep-e2e-mrpc-800s-seq-h100.json,
# sweep-e2e-mrpc-800s-colocated-h100.json and sweep-e2e-mrpc-800s-expandable-h100.json (2026-12-07; the tree of commit
# b61205f; benchmarks/results/quality-*.json and sweep-e2e-*.json set aside to keep the tree under the device's limit).
# Each ran from the repository root on one fresh H100 machine (asked for as nvidia-h200 with needs_h200 false, which
# takes an H100 or an H200), in this order. Two calls before them failed to start a machine. The script wrote
# <name>.json and <name>.png under $OUT; they are committed as sweep-e2e-<name>.json and .png, byte for byte.
# 1 -> mrpc-800s-warmup-h100 (the machine's first sweep, 50 steps: it leaves the bytecode and the Triton kernels
#      that the later calls' sweeps find); .whl and .device_data/mrpc (GLUE MRPC's train.tsv and dev.tsv) carried
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; python3 -m compileall -q -j 16 /tmp/site >/dev/null 2>&1; python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1; export HF_HUB_OFFLINE=1 MLFLOW_DISABLE_TELEMETRY=true PYTHONUNBUFFERED=1; G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]\+' | head -1 | tr A-Z a-z); python3 benchmarks/sweep_e2e.py --steps 50 --engine-steps 0 --sequential 0 --colocated-k 0 --budget-s 300 --sweep-timeout-s 200 --data-dir .device_data --tokenizer .whl/tokenizer --name mrpc-800s-warmup-$G --out $OUT 2>&1 | tail -22
# 2 -> mrpc-800s-seq-h100 (warm: the sweep, 800 steps, then one sequential Optuna + PEFT + lm-eval trial); the same
#      carry
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 MLFLOW_DISABLE_TELEMETRY=true PYTHONUNBUFFERED=1; G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]\+' | head -1 | tr A-Z a-z); python3 benchmarks/sweep_e2e.py --steps 800 --engine-steps 0 --sequential 1 --colocated-k 0 --bytecode as-is --budget-s 585 --sweep-timeout-s 345 --data-dir .device_data --tokenizer .whl/tokenizer --name mrpc-800s-seq-$G --out $OUT 2>&1 | tail -22
# 3 -> mrpc-800s-colocated-h100 (warm: one wave of four co-located PEFT processes against call 2's sweep, whose JSON,
#      as the device returned it, was copied to .device_data/ first); .whl and .device_data carried
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 MLFLOW_DISABLE_TELEMETRY=true PYTHONUNBUFFERED=1; G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]\+' | head -1 | tr A-Z a-z); python3 benchmarks/sweep_e2e.py --steps 800 --engine-steps 0 --sequential 0 --colocated-k 4 --colocated-configs 4 --bytecode as-is --sweep-from .device_data/mrpc-800s-seq-h100.json --budget-s 330 --data-dir .device_data --tokenizer .whl/tokenizer --name mrpc-800s-colocated-$G --out $OUT 2>&1 | tail -12
# 4 -> mrpc-800s-expandable-h100 (warm: the same sweep as call 2 with torch's caching allocator set to expandable
#      segments through the environment, which the JSON's command does not show; no baseline); .whl and
#      .device_data/mrpc carried
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 MLFLOW_DISABLE_TELEMETRY=true PYTHONUNBUFFERED=1; G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]\+' | head -1 | tr A-Z a-z); python3 benchmarks/sweep_e2e.py --steps 800 --engine-steps 0 --sequential 0 --colocated-k 0 --bytecode as-is --budget-s 400 --sweep-timeout-s 380 --data-dir .device_data --tokenizer .whl/tokenizer --name mrpc-800s-expandable-$G --out $OUT 2>&1 | tail -12
