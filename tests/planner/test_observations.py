"""Calibration: fits recover known factors, persist per (model, GPU), and reach the planner."""

from __future__ import annotations

import functools
import itertools
import json

import pytest

from plora_hpo.errors import PloraError
from plora_hpo.planner.calibration import Calibration
from plora_hpo.planner.cost_model import CostModel, GpuSpec, Workload
from plora_hpo.planner.observations import (
    _BOUNDS,
    Observation,
    calibration_path,
    fit_calibration,
    held_out_errors,
    load_calibration,
    record_observation,
)
from plora_hpo.planner.plan import plan_packs
from plora_hpo.shapes import TARGET_MODULES, shape_by_name
from tests.planner._configs import config

SHAPE = shape_by_name("qwen2.5-1.5b")
GPU = GpuSpec("H200", 1.0)
TRUTH = Calibration(
    launch=1.2, fixed=1.1, base=1.3, lora=0.7, memory_fixed=1.05, memory_activations=1.2, memory_adapters=0.9
)


def synthetic_observations(truth: Calibration, degrees: tuple[int, ...] = (1,)) -> list[Observation]:
    """Packs from launch-bound to compute-bound, measured by the prior scaled with ``truth``.

    The packed engine's host time per forward is ~0.35 s at qwen2.5-1.5b, so packs of 16 are
    needed for several device-bound rows (what identifies the device factors)."""
    model = CostModel(Workload(SHAPE, 512), GPU, truth)
    observations = []
    for degree, rank, batch, k in itertools.product(degrees, (8, 64, 256), (1, 4, 16), (1, 4, 16)):
        configs = [config(rank, batch)] * k
        observations.append(
            Observation(
                ranks=(rank,) * k,
                batch_sizes=(batch,) * k,
                seq_len=512,
                targets=TARGET_MODULES,
                step_seconds=model.step_seconds(configs, degree),
                peak_bytes=model.peak_memory(configs, degree),
                degree=degree,
            )
        )
    return observations


def test_fit_recovers_known_factors():
    fitted = fit_calibration(synthetic_observations(TRUTH), SHAPE, GPU)
    for name, value in TRUTH.factors().items():
        assert getattr(fitted, name) == pytest.approx(value, rel=0.02), name
    assert fitted.observations == 27


def test_fit_recovers_factors_that_all_differ_from_the_prior():
    """Every factor off 1.0, some above and some below, the optimizer's included."""
    truth = Calibration(
        launch=0.8,
        fixed=1.5,
        base=0.6,
        lora=1.8,
        optimizer=1.4,
        memory_fixed=0.95,
        memory_activations=0.7,
        memory_adapters=1.6,
    )
    fitted = fit_calibration(synthetic_observations(truth), SHAPE, GPU)
    for name, value in truth.factors().items():
        assert getattr(fitted, name) == pytest.approx(value, rel=0.02), name


FACTORS = tuple(Calibration().factors())
LOW, HIGH = _BOUNDS


@pytest.mark.parametrize(
    ("truth", "pinned"),
    [
        (Calibration(**dict.fromkeys(FACTORS, 0.01)), dict.fromkeys(FACTORS, LOW)),
        (Calibration(**dict.fromkeys(FACTORS, 50.0)), dict.fromkeys(FACTORS, HIGH)),
        (
            Calibration(launch=40.0, base=0.01, memory_activations=0.01, memory_adapters=30.0),
            {"launch": HIGH, "memory_adapters": HIGH},
        ),
    ],
    ids=["all-below", "all-above", "mixed"],
)
def test_fit_stays_within_the_bounds(truth, pinned):
    """Packs measured far outside what the factors may express: the factors stop at the bounds.
    (Degree-2 packs too: only they inform ``comm``.)"""
    fitted = fit_calibration(synthetic_observations(truth, degrees=(1, 2)), SHAPE, GPU)
    for name, value in fitted.factors().items():
        assert LOW <= value <= HIGH, name
    for name, bound in pinned.items():
        assert getattr(fitted, name) == pytest.approx(bound), name


def test_fit_of_the_prior_is_the_identity():
    fitted = fit_calibration(synthetic_observations(Calibration()), SHAPE, GPU)
    for name, value in fitted.factors().items():
        assert value == pytest.approx(1.0, abs=1e-3), name


def test_record_persists_and_is_found_under_either_gpu_name(calibration_cache):
    assert load_calibration("qwen2.5-1.5b", "H200") == Calibration()
    for obs in synthetic_observations(TRUTH):
        result = record_observation(
            "Qwen/Qwen2.5-1.5B-Instruct",
            "NVIDIA H200",
            obs.configs(),
            512,
            TARGET_MODULES,
            obs.step_seconds,
            obs.peak_bytes,
        )
    path = calibration_path("qwen2.5-1.5b", "H200")
    assert path.parent == calibration_cache and path.is_file()
    stored = json.loads(path.read_text())
    assert stored["model"] == "qwen2.5-1.5b" and len(stored["observations"]) == 27
    loaded = load_calibration("qwen2.5-1.5b", "h200")
    assert loaded == result
    assert loaded.base == pytest.approx(1.3, rel=0.02)


def test_one_observation_moves_the_prediction_towards_it():
    configs = [config(16, 8)] * 2
    prior = CostModel(Workload(SHAPE, 512), GPU).step_seconds(configs)
    fitted = record_observation("qwen2.5-1.5b", "H200", configs, 512, TARGET_MODULES, 1.5 * prior, None)
    after = CostModel(Workload(SHAPE, 512), GPU, fitted).step_seconds(configs)
    assert after == pytest.approx(1.5 * prior, rel=0.05)
    assert fitted.memory_activations == 1.0  # no memory measured: memory stays at the prior


def test_planner_loads_the_stored_calibration():
    configs = [config(16, 4)] * 4
    before = plan_packs(configs, shape="qwen2.5-1.5b", seq_len=512, gpu=GpuSpec("H200", 80), num_gpus=1, steps=50)
    record_observation("qwen2.5-1.5b", "H200", configs, 512, TARGET_MODULES, 5.0, None)
    after = plan_packs(configs, shape="qwen2.5-1.5b", seq_len=512, gpu=GpuSpec("H200", 80), num_gpus=1, steps=50)
    assert before.calibrated_from == 0 and after.calibrated_from == 1
    assert after.makespan > before.makespan


def test_bad_inputs_and_files():
    with pytest.raises(PloraError, match="step_seconds must be positive"):
        record_observation("qwen2.5-1.5b", "H200", [config()], 512, TARGET_MODULES, 0.0, None)
    path = calibration_path("qwen2.5-1.5b", "H200")
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(PloraError, match="delete it"):
        load_calibration("qwen2.5-1.5b", "H200")


# a tensor-parallel truth: every time factor off 1.0, the all-reduces' (comm) included
TP_TRUTH = Calibration(
    launch=1.2,
    fixed=1.1,
    base=1.3,
    lora=0.7,
    optimizer=1.4,
    comm=2.5,
    memory_fixed=1.05,
    memory_activations=1.2,
    memory_adapters=0.9,
)


def held_out_degree_two(truth: Calibration) -> list[Observation]:
    """Mixed packs of degree 2, none of them among the fitted ones."""
    model = CostModel(Workload(SHAPE, 512), GPU, truth)
    packs = [[(32, 8), (128, 2), (16, 12)], [(16, 16)] * 6, [(8, 32), (64, 32)], [(256, 24)] * 3]
    observations = []
    for pack in packs:
        configs = [config(r, b) for r, b in pack]
        ranks, batches = zip(*pack)
        observations.append(
            Observation(
                ranks=ranks,
                batch_sizes=batches,
                seq_len=512,
                targets=TARGET_MODULES,
                step_seconds=model.step_seconds(configs, 2),
                peak_bytes=model.peak_memory(configs, 2),
                degree=2,
            )
        )
    return observations


def test_degree_one_packs_leave_the_comm_factor_alone():
    fitted = fit_calibration(synthetic_observations(TP_TRUTH), SHAPE, GPU)
    assert fitted.comm == 1.0
    assert fitted.base == pytest.approx(1.3, rel=0.02)


def test_degree_two_packs_refit_through_the_same_calibration():
    """Packs of degree 1 and 2 measured by a known truth: the calibrated model predicts other
    degree-2 packs' step time and peak memory within 2%, where the prior is off by more than 10%;
    degree-1 packs alone cannot tell the all-reduces' factor."""
    predict = held_out_degree_two(TP_TRUTH)
    result = held_out_errors(synthetic_observations(TP_TRUTH, degrees=(1, 2)), predict, SHAPE, GPU)
    assert result["calibration"]["comm"] == pytest.approx(2.5, rel=0.05)
    assert result["step_error_max"] < 0.02 < 0.1 < result["step_prior_error_max"]
    assert result["memory_error_max"] < 0.02 < 0.1 < result["memory_prior_error_max"]
    one_only = held_out_errors(synthetic_observations(TP_TRUTH), predict, SHAPE, GPU)
    assert one_only["step_error_max"] > 0.03  # the all-reduces' seconds stay at the prior's


def test_a_recorded_degree_two_pack_keeps_its_degree(calibration_cache):
    configs = [config(16, 16)] * 8  # device-bound at degree 2
    prior = CostModel(Workload(SHAPE, 512), GPU)
    terms = prior.step_terms(configs, 2)
    assert prior.device_seconds(terms) > prior.launch_seconds(terms)
    seconds = 1.5 * prior.step_seconds(configs, 2)
    fitted = record_observation("qwen2.5-1.5b", "H200", configs, 512, TARGET_MODULES, seconds, None, degree=2)
    stored = json.loads(calibration_path("qwen2.5-1.5b", "H200").read_text())
    assert [o["degree"] for o in stored["observations"]] == [2]
    assert Observation.from_dict(stored["observations"][0]).degree == 2
    assert fitted.comm > 1.0  # a degree-2 pack informs the all-reduces' factor
    after = CostModel(Workload(SHAPE, 512), GPU, fitted).step_seconds(configs, 2)
    assert after == pytest.approx(seconds, rel=0.05)


def test_the_store_keeps_one_observation_per_pack_the_longest_measured():
    pack = [config(16, 4), config(64, 8)]
    record = functools.partial(record_observation, "qwen2.5-1.5b", "H200", seq_len=512, targets=TARGET_MODULES)
    record(pack, step_seconds=0.5, peak_bytes=None, steps_measured=8)  # a pack's first steps
    record([config(8, 2)], step_seconds=0.2, peak_bytes=None, steps_measured=8)  # another pack
    record(list(reversed(pack)), step_seconds=0.3, peak_bytes=None, steps_measured=400)  # the same pack, all its steps
    record(pack, step_seconds=0.9, peak_bytes=None, steps_measured=8)  # a later sweep's first steps of it
    record(pack, step_seconds=0.4, peak_bytes=None, steps_measured=8, degree=2)  # split over 2 GPUs: another pack

    stored = json.loads(calibration_path("qwen2.5-1.5b", "H200").read_text())["observations"]
    got = sorted((o["ranks"], o["degree"], o["step_seconds"], o["steps_measured"]) for o in stored)
    assert got == [([8], 1, 0.2, 8), ([16, 64], 2, 0.4, 8), ([64, 16], 1, 0.3, 400)]
