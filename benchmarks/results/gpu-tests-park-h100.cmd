# The device call that wrote gpu-tests-park-h100.txt (2026-12-07; the tree of commit 49ec385, nothing carried: these engine
# tests need only the image's torch, transformers and triton), run from the repository root on an H100 machine (kind
# nvidia-h100-x1). Before it, on the same machine: the same call at 1c1eeb0 failed the park test's new check that the swap
# happens while the capture's copies still wait, and a probe (not kept) showed those copies done 0.8 ms after the capture
# although a 2e9-cycle sleep was queued first: the tests held up the side stream of device "cuda", the copies ran on that
# of "cuda:0". 49ec385 keys the side streams by the device's index. An earlier call at 95b8a38, on another fresh H100,
# passed the same tests without that check, its hold-up on the unused stream.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; (nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch,triton,transformers,peft;print(torch.__version__,triton.__version__,transformers.__version__,peft.__version__)"; date -u; python3 -m pytest -m gpu tests/engine/test_adapter_state.py tests/engine/test_host_copy.py -v -p no:cacheprovider 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|Error|assert") 2>&1 | tee $OUT/gpu-tests-park.txt
