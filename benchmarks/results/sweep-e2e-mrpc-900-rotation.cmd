# The device calls behind sweep-e2e-mrpc-900-rotation-warm-h100.json, .log and .timeline.jsonl (2026-12-07; the tree of
# commit 7b1e280, with benchmarks/results/quality-*.json and sweep-e2e-*.json set aside to keep the tree under the
# device's limit). Each ran from the repository root with .whl and .device_data/mrpc (GLUE MRPC's train.tsv and dev.tsv
# only) carried, on one fresh H100 machine (kind nvidia-h100-x1), in this order. Two calls for an H100 and one for an H200
# before them failed to start.
# 1 -> warm-up, not kept: a 20-step sweep writes the bytecode and compiles Triton's kernels, so that the next sweep is warm
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; python3 -m compileall -q -j 16 /tmp/site >/dev/null 2>&1; python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1; export HF_HUB_OFFLINE=1 MLFLOW_DISABLE_TELEMETRY=true PYTHONUNBUFFERED=1; G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]\+' | head -1 | tr A-Z a-z); python3 benchmarks/sweep_e2e.py --steps 20 --engine-steps 0 --sequential 0 --colocated-k 0 --data-dir .device_data --tokenizer .whl/tokenizer --name warmup-$G --out $OUT 2>&1 | tail -22
# 2 -> sweep-e2e-mrpc-900-rotation-warm-h100.json; the sweep's own log and phase record ($OUT/sweep.log and
#      $OUT/sweep.timeline.jsonl) as sweep-e2e-mrpc-900-rotation-warm-h100.log and .timeline.jsonl. The sweep was still
#      running at --sweep-timeout-s (380 s) and was killed, 31 of 32 trials done: the JSON records only that (the
#      benchmark at this commit kept no timeline for a killed sweep); the phases are in the .timeline.jsonl
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 MLFLOW_DISABLE_TELEMETRY=true PYTHONUNBUFFERED=1; G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]\+' | head -1 | tr A-Z a-z); python3 benchmarks/sweep_e2e.py --steps 900 --engine-steps 0 --sequential 0 --colocated-k 4 --colocated-configs 4 --bytecode as-is --budget-s 585 --sweep-timeout-s 380 --data-dir .device_data --tokenizer .whl/tokenizer --name sweep-e2e-mrpc-900-rotation-warm-$G --out $OUT 2>&1 | tail -22
