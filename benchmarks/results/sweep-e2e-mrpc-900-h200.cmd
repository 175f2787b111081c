# The three device calls that wrote sweep-e2e-mrpc-900-h200.json, sweep-e2e-mrpc-900-processes-warm-h200.json and
# sweep-e2e-mrpc-900-threads-warm-h200.json (with their .png), 2026-12-06, in this order on one nvidia-h200 machine
# held warm between them (the tree of commit 1ba9496, its quality-*.json aside), run from the repository root with
# .whl and .device_data/mrpc carried. The second and third found what the first left on the machine: /tmp/site,
# the bytecode it wrote, Triton's compiled kernels. The first call's command also ended with an import-time profile
# of the model check (python3 -X importtime ...), written to importtime.txt, which is not kept.
# 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; python3 -m compileall -q -j 16 /tmp/site >/dev/null 2>&1; python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1; export HF_HUB_OFFLINE=1 MLFLOW_DISABLE_TELEMETRY=true PYTHONUNBUFFERED=1; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 benchmarks/sweep_e2e.py --tests --tests-timeout-s 120 --steps 900 --engine-steps 0 --sequential 0 --colocated-k 0 --budget-s 560 --sweep-timeout-s 500 --data-dir .device_data --tokenizer .whl/tokenizer --name sweep-e2e-mrpc-900-h200 --out $OUT 2>&1 | tail -60
# 2
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 MLFLOW_DISABLE_TELEMETRY=true PYTHONUNBUFFERED=1; python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1; python3 benchmarks/sweep_e2e.py --workers processes --steps 900 --engine-steps 0 --sequential 0 --colocated-k 0 --budget-s 450 --sweep-timeout-s 420 --data-dir .device_data --tokenizer .whl/tokenizer --name sweep-e2e-mrpc-900-processes-warm-h200 --out $OUT 2>&1 | tail -30
# 3
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 MLFLOW_DISABLE_TELEMETRY=true PYTHONUNBUFFERED=1; python3 benchmarks/sweep_e2e.py --bytecode as-is --steps 900 --engine-steps 0 --sequential 0 --colocated-k 0 --budget-s 400 --sweep-timeout-s 380 --data-dir .device_data --tokenizer .whl/tokenizer --name sweep-e2e-mrpc-900-threads-warm-h200 --out $OUT 2>&1 | tail -22
