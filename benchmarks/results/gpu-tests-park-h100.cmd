# The device call that wrote gpu-tests-park-h100.txt (2026-12-07; the tree of commit 95b8a38, nothing carried: these engine
# tests need only the image's torch, transformers and triton), run from the repository root on a fresh H100 machine (kind
# nvidia-h100-x1), started after the machine of sweep-e2e-mrpc-650-lead.cmd was given back. The file's fourth line is
# what `git log` printed there: the machine's copy of the repository metadata, not the tree that ran.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; (nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch,triton,transformers,peft;print(torch.__version__,triton.__version__,transformers.__version__,peft.__version__)"; date -u; git log --oneline -1 2>/dev/null; python3 -m pytest -m gpu tests/engine/test_adapter_state.py tests/engine/test_host_copy.py -v -p no:cacheprovider 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|Error|assert") 2>&1 | tee $OUT/gpu-tests-park.txt
