# The device calls that wrote sweep-e2e-mrpc-800-warmup-h100.json and sweep-e2e-mrpc-800-colocated-warm-h100.json
# (2026-12-07; the tree of commit 3e6c612; benchmarks/results/quality-*.json and sweep-e2e-*.json set aside to keep the
# tree under the device's limit). Each ran from the repository root with .whl and .device_data/mrpc (GLUE MRPC's
# train.tsv and dev.tsv only) carried, on one fresh H100 machine (asked for as nvidia-h200 with needs_h200 false, which
# takes an H100 or an H200), in this order. Eight calls for an H100 or an H200 before them failed to start a machine.
# 1 -> sweep-e2e-mrpc-800-warmup-h100.json (the machine's first sweep, 50 steps: it leaves the bytecode and the Triton
#      kernels that the second call's sweep finds)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; python3 -m compileall -q -j 16 /tmp/site >/dev/null 2>&1; python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1; export HF_HUB_OFFLINE=1 MLFLOW_DISABLE_TELEMETRY=true PYTHONUNBUFFERED=1; G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]\+' | head -1 | tr A-Z a-z); python3 benchmarks/sweep_e2e.py --steps 50 --engine-steps 0 --sequential 0 --colocated-k 0 --budget-s 300 --sweep-timeout-s 200 --data-dir .device_data --tokenizer .whl/tokenizer --name sweep-e2e-mrpc-800-warmup-$G --out $OUT 2>&1 | tail -22
# 2 -> sweep-e2e-mrpc-800-colocated-warm-h100.json (warm). The call reached the device's 600-s limit while the four
#      co-located PEFT processes were still running (started after 365.9 s of the script): it was killed (rc 124) and
#      returned the JSON saved after the sweep, without a co-located row.
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 MLFLOW_DISABLE_TELEMETRY=true PYTHONUNBUFFERED=1; G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]\+' | head -1 | tr A-Z a-z); python3 benchmarks/sweep_e2e.py --steps 800 --engine-steps 0 --sequential 0 --colocated-k 4 --colocated-configs 4 --bytecode as-is --budget-s 585 --sweep-timeout-s 340 --data-dir .device_data --tokenizer .whl/tokenizer --name sweep-e2e-mrpc-800-colocated-warm-$G --out $OUT 2>&1 | tail -22
