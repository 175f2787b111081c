# The device calls that wrote sweep-e2e-mrpc-900-gc-h200.json, sweep-e2e-mrpc-900-gc-warm-h200.json and
# sweep-e2e-mrpc-900-gc-warm2-h200.json (2026-12-06; the tree of commit f2971cd, its result files aside), in this order on
# one H200 machine, right after the call in gpu-tests-h200.cmd (which installed the carried wheels under /tmp/site
# and ran the GPU tests, whose small model compiled its own Triton kernels). Each ran from the repository root with
# .whl and .device_data/mrpc carried. The second and third found what the first left on the machine: the bytecode
# it wrote, Triton's compiled kernels for the 1.5B shape.
# 1
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 MLFLOW_DISABLE_TELEMETRY=true PYTHONUNBUFFERED=1; python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 benchmarks/sweep_e2e.py --steps 900 --engine-steps 0 --sequential 0 --colocated-k 0 --budget-s 560 --sweep-timeout-s 500 --data-dir .device_data --tokenizer .whl/tokenizer --name sweep-e2e-mrpc-900-gc-h200 --out $OUT 2>&1 | tail -30
# 2
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 MLFLOW_DISABLE_TELEMETRY=true PYTHONUNBUFFERED=1; python3 benchmarks/sweep_e2e.py --bytecode as-is --steps 900 --engine-steps 0 --sequential 0 --colocated-k 0 --budget-s 400 --sweep-timeout-s 380 --data-dir .device_data --tokenizer .whl/tokenizer --name sweep-e2e-mrpc-900-gc-warm-h200 --out $OUT 2>&1 | tail -22
# 3
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 MLFLOW_DISABLE_TELEMETRY=true PYTHONUNBUFFERED=1; python3 benchmarks/sweep_e2e.py --bytecode as-is --steps 900 --engine-steps 0 --sequential 0 --colocated-k 0 --budget-s 380 --sweep-timeout-s 370 --data-dir .device_data --tokenizer .whl/tokenizer --name sweep-e2e-mrpc-900-gc-warm2-h200 --out $OUT 2>&1 | tail -22
