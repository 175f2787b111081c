# The device calls that wrote checkpoint-capture-register-h200.json, sweep-e2e-mrpc-800s-warmup-h200.json and
# sweep-e2e-mrpc-800s-seq-h200.json (2026-12-07; the tree of commit fab8e8c; benchmarks/results/quality-*.json and
# sweep-e2e-*.json set aside to keep the tree under the device's limit). Each ran from the repository root on one
# fresh H200 machine (asked for as nvidia-h200 with needs_h200 false, which takes an H100 or an H200), in this order.
# Seven calls before them failed to start a machine (721 s of the session's 1,800 s of device time). The scripts
# wrote checkpoint-capture-h200.json and <name>.json / <name>.png under $OUT; they are committed as
# checkpoint-capture-register-h200.json (beside the earlier checkpoint-capture-h200.json) and sweep-e2e-<name>.json /
# .png, byte for byte.
# 1 -> the allocator's GPU test (both cases failed: the test replaced PYTHONPATH, where the image's added packages
#      live; fixed in the next commit, not run again), checkpoint-capture-register-h200 (page-locking with
#      cudaHostAlloc against registered pages mapped by 8 or 16 threads), mrpc-800s-warmup-h200 (the machine's first
#      sweep, 50 steps); .whl and .device_data/mrpc (GLUE MRPC's train.tsv and dev.tsv) carried
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; python3 -m compileall -q -j 16 /tmp/site >/dev/null 2>&1; python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1; export HF_HUB_OFFLINE=1 MLFLOW_DISABLE_TELEMETRY=true PYTHONUNBUFFERED=1; G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]\+' | head -1 | tr A-Z a-z); python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_allocator.py 2>&1 | tail -3; python3 benchmarks/checkpoint_capture.py --ranks 8,128 --strategies one-buffer --allocator pinned_use_cuda_host_register:True,pinned_num_register_threads:8 --allocator pinned_use_cuda_host_register:True,pinned_num_register_threads:16 --out $OUT 2>&1 | tail -8; python3 benchmarks/sweep_e2e.py --steps 50 --engine-steps 0 --sequential 0 --colocated-k 0 --budget-s 300 --sweep-timeout-s 200 --data-dir .device_data --tokenizer .whl/tokenizer --name mrpc-800s-warmup-$G --out $OUT 2>&1 | tail -14
# 2 -> mrpc-800s-seq-h200 (warm: the sweep, 800 steps, then one sequential Optuna + PEFT + lm-eval trial); the same
#      carry
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 MLFLOW_DISABLE_TELEMETRY=true PYTHONUNBUFFERED=1; G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]\+' | head -1 | tr A-Z a-z); python3 benchmarks/sweep_e2e.py --steps 800 --engine-steps 0 --sequential 1 --colocated-k 0 --bytecode as-is --budget-s 585 --sweep-timeout-s 345 --data-dir .device_data --tokenizer .whl/tokenizer --name mrpc-800s-seq-$G --out $OUT 2>&1 | tail -22
# 3 -> (no file kept) one wave of four co-located PEFT processes against call 2's sweep (--sweep-from its JSON): the
#      session's device time ran out 263 s into the call, before the wave ended; the file it left holds no baseline
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 MLFLOW_DISABLE_TELEMETRY=true PYTHONUNBUFFERED=1; G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]\+' | head -1 | tr A-Z a-z); python3 benchmarks/sweep_e2e.py --steps 800 --engine-steps 0 --sequential 0 --colocated-k 4 --colocated-configs 4 --bytecode as-is --sweep-from .device_data/mrpc-800s-seq-h200.json --budget-s 262 --data-dir .device_data --tokenizer .whl/tokenizer --name mrpc-800s-colocated-$G --out $OUT 2>&1 | tail -12
