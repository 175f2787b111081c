"""Evaluation's attention switch is process-wide: workers' overlapping evaluations must not leave
cuDNN attention off for training (or on for one of them) when they finish in another order."""

from __future__ import annotations

import threading

import torch

from plora_hpo.evaluation.fast_paths import attention_backends

CUDA = torch.device("cuda")  # only the flag is touched: no GPU needed


def test_overlapping_evaluations_restore_cudnn_after_the_last_one():
    assert torch.backends.cuda.cudnn_sdp_enabled()
    first_inside, second_inside, first_left = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def first() -> None:
        with attention_backends(CUDA):
            first_inside.set()
            second_inside.wait(10)
        first_left.set()

    def second() -> None:
        first_inside.wait(10)
        with attention_backends(CUDA):
            second_inside.set()
            first_left.wait(10)
            seen["after the first left"] = torch.backends.cuda.cudnn_sdp_enabled()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen == {"after the first left": False}
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_cpu_leaves_the_switch_alone():
    with attention_backends(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled()
