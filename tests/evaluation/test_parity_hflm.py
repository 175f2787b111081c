"""The evaluator's contract: every adapter scores what lm-eval's HF model + PEFT scores alone.

Real CoLA, MRPC and GSM8K rows (``PLORA_HPO_TEST_DATA``), the embedded SmolLM2 in fp32 on CPU,
three adapters of ranks 4/8/16 (one rsLoRA). The reference is lm-eval's own ``HFLM`` loading
the base model from disk with ``peft=<exported adapter>``, evaluated one adapter at a time.
"""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
from lm_eval.evaluator import evaluate
from lm_eval.models.huggingface import HFLM

from plora_hpo.evaluation import evaluate_adapters, evaluate_adapters_report
from plora_hpo.evaluation.runner import FEWSHOT_SEED, lm_eval_tasks
from plora_hpo.tasks import build_eval_tasks

from .conftest import ADAPTERS

pytestmark = pytest.mark.slow

LL_RTOL = 1e-5  # relative, on each request's summed log-probability (fp32, batched vs one row)


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=LL_RTOL, abs_tol=LL_RTOL)


def merged(*task_dicts: dict) -> dict:
    tasks = {}
    for d in task_dicts:
        tasks.update(d["tasks"])
    return {"tasks": tasks, "groups": {}, "group_map": {}}


def reference(pack, adapter_id: str, task_dict: dict, limit: int) -> dict:
    """lm-eval's HF model with PEFT, this adapter alone (batch size 1: no padding effects)."""
    lm = HFLM(
        pretrained=str(pack.base_dir),
        peft=str(pack.peft_dirs[adapter_id]),
        dtype="float32",
        device="cpu",
        batch_size=1,
    )
    for task in lm_eval_tasks(task_dict):
        task.set_fewshot_seed(seed=FEWSHOT_SEED)
    return evaluate(lm=lm, task_dict=task_dict, limit=limit, bootstrap_iters=0, log_samples=True)


def responses(results: dict, task: str) -> list:
    return [s["resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def numeric(results: dict, task: str) -> dict:
    entry = results["results"][task]
    return {k: v for k, v in entry.items() if isinstance(v, float) and k != "sample_len"}


@pytest.fixture(scope="module")
def choice_tasks(data_dir):
    return merged(build_eval_tasks("cola", data_dir=data_dir), build_eval_tasks("mrpc", data_dir=data_dir))


def test_multiple_choice_matches_hflm_with_peft(smol_pack, choice_tasks):
    limit = 8
    ours = evaluate_adapters_report(
        smol_pack.packed, smol_pack.tokenizer, list(ADAPTERS), choice_tasks, limit=limit, batch_size=8, log_samples=True
    )
    worst = 0.0  # largest relative difference seen
    for adapter_id in ADAPTERS:
        ref = reference(smol_pack, adapter_id, choice_tasks, limit)
        for task in ("cola", "mrpc"):
            got, want = responses(ours.results[adapter_id], task), responses(ref, task)
            assert len(got) == len(want) == limit
            for doc_got, doc_want in zip(got, want):
                for [(ll, greedy)], [(ll_ref, greedy_ref)] in zip(doc_got, doc_want):
                    worst = max(worst, abs(ll - ll_ref) / max(1.0, abs(ll_ref)))
                    assert greedy == greedy_ref
            assert numeric(ours.results[adapter_id], task) == numeric(ref, task)
        assert set(ours.metrics[adapter_id]) >= {"cola/mcc,none", "mrpc/acc,none", "mrpc/f1,none"}
    assert worst <= LL_RTOL, worst

    # The adapters really differ, so a row routed to the wrong adapter could not pass.
    firsts = {a: responses(ours.results[a], "mrpc")[0][0][0][0] for a in ADAPTERS}
    values = sorted(firsts.values())
    assert min(b - a for a, b in pairwise(values)) > 1e-3, firsts
    # Every request was computed once for all adapters: the two choices share one row.
    assert ours.stats.requests["loglikelihood"] == 4 * limit
    assert ours.stats.scoring.unique_inputs == 2 * limit


def test_gsm8k_generation_matches_hflm_with_peft(smol_pack, data_dir):
    limit, max_gen_toks = 3, 12
    task_dict = build_eval_tasks("gsm8k", data_dir=data_dir, num_fewshot=1)  # 1-shot keeps CPU time low
    for task in lm_eval_tasks(task_dict):
        task.config.generation_kwargs["max_gen_toks"] = max_gen_toks
    ours = evaluate_adapters_report(
        smol_pack.packed, smol_pack.tokenizer, list(ADAPTERS), task_dict, limit=limit, batch_size=4, log_samples=True
    )
    texts = {}
    for adapter_id in ADAPTERS:
        ref = reference(smol_pack, adapter_id, task_dict, limit)
        got, want = responses(ours.results[adapter_id], "gsm8k"), responses(ref, "gsm8k")
        assert got == want
        assert numeric(ours.results[adapter_id], "gsm8k") == numeric(ref, "gsm8k")
        texts[adapter_id] = got
    assert len({str(t) for t in texts.values()}) > 1, "adapters should generate different text"
    gen = ours.stats.generation
    assert gen.peak_rows == 4 and gen.admissions >= 2  # 9 sequences through 4 slots: rows joined later


def test_paging_adapters_through_a_small_budget_changes_nothing(smol_pack, data_dir):
    task_dict = merged(
        build_eval_tasks("mrpc", data_dir=data_dir), build_eval_tasks("gsm8k", data_dir=data_dir, num_fewshot=0)
    )
    for task in lm_eval_tasks(task_dict):
        if task.config.output_type == "generate_until":
            task.config.generation_kwargs["max_gen_toks"] = 6
    kwargs = dict(limit=2, batch_size=6, log_samples=True)
    free = evaluate_adapters_report(smol_pack.packed, smol_pack.tokenizer, list(ADAPTERS), task_dict, **kwargs)
    largest = max(sum(p.numel() * p.element_size() for p in smol_pack.packed.parameters_of(a)) for a in ADAPTERS)
    paged = evaluate_adapters_report(
        smol_pack.packed, smol_pack.tokenizer, list(ADAPTERS), task_dict, adapter_memory_budget=largest, **kwargs
    )
    assert paged.stats.paging.swaps_in >= len(ADAPTERS)  # one adapter on the "device" at a time
    assert free.stats.paging.swaps_in == 0
    for adapter_id in ADAPTERS:
        assert responses(paged.results[adapter_id], "gsm8k") == responses(free.results[adapter_id], "gsm8k")
        for [[(a, ga)], [(b, gb)]], [[(c, gc)], [(d, gd)]] in zip(
            responses(paged.results[adapter_id], "mrpc"), responses(free.results[adapter_id], "mrpc")
        ):
            assert close(a, c) and close(b, d)
            assert (ga, gb) == (gc, gd)
        assert paged.metrics[adapter_id] == free.metrics[adapter_id]
    # Paging leaves every adapter back in place, weights untouched.
    for adapter_id in ADAPTERS:
        assert all(p.numel() > 0 for p in smol_pack.packed.parameters_of(adapter_id))


def test_evaluate_adapters_returns_lm_eval_metric_keys(smol_pack, data_dir):
    task_dict = build_eval_tasks("cola", data_dir=data_dir)
    task = task_dict["tasks"]["cola"]
    builds = []
    original = task.build_all_requests
    task.build_all_requests = lambda *a, **k: builds.append(1) or original(*a, **k)
    try:
        scores = evaluate_adapters(smol_pack.packed, smol_pack.tokenizer, ["r8", "r4"], task_dict, limit=4)
    finally:
        del task.build_all_requests
    assert list(scores) == ["r8", "r4"]
    # the metric, its standard error (lm-eval's bootstrap is off) and each answer's share
    assert set(scores["r8"]) == {"mcc,none", "mcc_stderr,none", "pred_share_no,none", "pred_share_yes,none"}
    assert all(isinstance(v, float) for v in scores["r4"].values())
    assert scores["r4"]["pred_share_no,none"] + scores["r4"]["pred_share_yes,none"] == 1.0
    assert len(builds) == 1  # lm-eval built the requests once; the second adapter replayed them


def test_rolling_loglikelihood_matches_hflm_with_peft(smol_pack):
    from lm_eval.api.instance import Instance

    from plora_hpo.evaluation import MultiAdapterServer

    texts = [
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
        "The weights made the rope stretch over the pulley.",
    ]
    requests = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
    server = MultiAdapterServer(smol_pack.packed, smol_pack.tokenizer, list(ADAPTERS), max_length=16)
    for adapter_id in ADAPTERS:
        ours = server.view(adapter_id).loglikelihood_rolling(requests)
        lm = HFLM(
            pretrained=str(smol_pack.base_dir),
            peft=str(smol_pack.peft_dirs[adapter_id]),
            dtype="float32",
            device="cpu",
            batch_size=1,
            max_length=16,  # several disjoint windows per text
        )
        want = lm.loglikelihood_rolling(requests, disable_tqdm=True)
        assert all(close(a, b) for a, b in zip(ours, want)), (ours, want)
    assert server.stats.requests == {"loglikelihood_rolling": 2}  # computed once for all adapters
