# The device calls that wrote sweep-e2e-mrpc-800r-warmup-h100.json/.png, sweep-e2e-mrpc-800r-seq-h100.json/.png,
# gpu-tests-removals-h100.txt and sweep-e2e-mrpc-800r-colocated-h100.json (2026-12-07), in this order, on one H100
# machine (asked for as nvidia-h200 with needs_h200 false, which takes an H100 or an H200), from the repository root,
# with benchmarks/results/quality-*.json and sweep-e2e-*.json set aside to keep the tree under the device's limit.
# Four calls before them failed to start a machine (451 s of the session's 1,800 s of device time). The scripts wrote
# <name>.json / <name>.png and gpu-tests.txt under $OUT; they are committed as sweep-e2e-<name>.json / .png and
# gpu-tests-removals-h100.txt, byte for byte.
# 1 -> mrpc-800r-warmup-h100 (the machine's first sweep, 50 steps), the tree of commit 5c21efd (its sweep_e2e still
#      took the data-loading thread for the training loop, so this file's start-up and load-data figures are mixed
#      up); .whl and .device_data/mrpc (GLUE MRPC's train.tsv and dev.tsv) carried
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; python3 -m compileall -q -j 16 /tmp/site >/dev/null 2>&1; python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1; export HF_HUB_OFFLINE=1 MLFLOW_DISABLE_TELEMETRY=true PYTHONUNBUFFERED=1; G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]\+' | head -1 | tr A-Z a-z); python3 benchmarks/sweep_e2e.py --steps 50 --engine-steps 0 --sequential 0 --colocated-k 0 --budget-s 300 --sweep-timeout-s 200 --data-dir .device_data --tokenizer .whl/tokenizer --name mrpc-800r-warmup-$G --out $OUT 2>&1 | tail -16
# 2 -> mrpc-800r-seq-h100 (warm: the sweep, 800 steps; the one sequential Optuna + PEFT + lm-eval trial after it did
#      not end within the call's budget), the tree of commit d1b2225 from here on; the same carry
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 MLFLOW_DISABLE_TELEMETRY=true PYTHONUNBUFFERED=1; G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]\+' | head -1 | tr A-Z a-z); python3 benchmarks/sweep_e2e.py --steps 800 --engine-steps 0 --sequential 1 --colocated-k 0 --bytecode as-is --budget-s 585 --sweep-timeout-s 345 --data-dir .device_data --tokenizer .whl/tokenizer --name mrpc-800r-seq-$G --out $OUT 2>&1 | tail -22
# 3 -> gpu-tests-removals-h100.txt (pytest -m gpu); the same carry
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 MLFLOW_DISABLE_TELEMETRY=true PYTHONUNBUFFERED=1 PLORA_HPO_TEST_DATA=$PWD/.device_data; (nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch,triton,transformers,peft;print(torch.__version__,triton.__version__,transformers.__version__,peft.__version__)"; date -u; timeout 280 python3 -m pytest -m gpu tests/gpu tests/engine -v -p no:cacheprovider 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|Error") 2>&1 | tee $OUT/gpu-tests.txt
# 4 -> mrpc-800r-colocated-h100 (one wave of four co-located PEFT processes against call 2's sweep, --sweep-from its
#      JSON); .device_data/mrpc-800r-seq-h100.json (call 2's file) carried too
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 MLFLOW_DISABLE_TELEMETRY=true PYTHONUNBUFFERED=1; G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]\+' | head -1 | tr A-Z a-z); python3 benchmarks/sweep_e2e.py --steps 800 --engine-steps 0 --sequential 0 --colocated-k 4 --colocated-configs 4 --bytecode as-is --sweep-from .device_data/mrpc-800r-seq-h100.json --budget-s 300 --data-dir .device_data --tokenizer .whl/tokenizer --name mrpc-800r-colocated-$G --out $OUT 2>&1 | tail -12
