"""One call from configs to a whole predicted schedule: what ``plora-hpo plan`` prints."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from plora_hpo.adapter import AdapterConfig
from plora_hpo.errors import PloraError
from plora_hpo.planner.baselines import compute_baselines
from plora_hpo.planner.calibration import Calibration
from plora_hpo.planner.cost_model import CostModel, GpuSpec, Workload
from plora_hpo.planner.model_names import resolve_model, shape_name_for_shape
from plora_hpo.planner.observations import load_calibration
from plora_hpo.planner.schedule import Schedule
from plora_hpo.planner.simulate import JobPlanner, PlannedPack, run_to_completion
from plora_hpo.shapes import TARGET_MODULES, ModelShape

# Planner policies (long_first, horizon_slack) simulated in full; the plan is the one with the
# smallest makespan: longest-first within a horizon (won or tied on every instance measured so
# far), longest-first alone, and pure throughput (the paper's DTM objective).
POLICIES = ((1.0, 1.0), (1.0, None), (0.0, None))


def steps_for_epochs(configs: Sequence[AdapterConfig], *, epochs: float, train_examples: int) -> list[int]:
    """Optimizer steps per config for an epoch budget: ⌈examples ÷ batch size⌉ × epochs."""
    if train_examples < 1 or not epochs > 0:
        raise PloraError(f"need ≥ 1 training example and epochs > 0, got {train_examples} and {epochs}")
    return [max(1, math.ceil(math.ceil(train_examples / c.batch_size) * epochs)) for c in configs]


def plan_packs(
    configs: Sequence[AdapterConfig],
    *,
    shape: ModelShape | str,
    seq_len: int,
    gpu: GpuSpec,
    num_gpus: int,
    steps: int | Sequence[int],
    targets: Sequence[str] = TARGET_MODULES,
    max_degree: int | None = None,
    max_pack_size: int | None = None,
    load_factor: float = 0.9,
    dtype_bytes: int = 2,
    checkpointing: bool = False,
    logits_chunk_tokens: int | None = 4096,
    solver: str = "auto",
    allow_unschedulable: bool = False,
    calibration: Calibration | None = None,
    fill: bool = False,
    rotate: bool = False,
) -> Schedule:
    """Plan which configs train together on which GPUs, and when (PLoRA's DTM + job planner).

    Args:
        configs: the trials to run; pack ``configs`` lists are indices into this sequence.
        shape: base model shape, or its name / hub id (``qwen2.5-7b``, ``Qwen/Qwen2.5-7B``).
        seq_len, targets, dtype_bytes, checkpointing, logits_chunk_tokens: see :class:`Workload`.
        gpu: the GPU kind (``GpuSpec.host()`` for CPU runs).
        num_gpus: GPUs in the pool.
        steps: optimizer steps per config (one number for all, or one per config); see
            :func:`steps_for_epochs` for epoch budgets.
        max_degree: most GPUs per pack (a sweep runs every pack at its ``pack.degree``).
        max_pack_size: most adapters per pack.
        load_factor: fraction C of each GPU's memory a pack may plan to use.
        solver: ``"auto"`` (gurobipy, HiGHS when gurobipy cannot), ``"gurobi"`` or ``"highs"``.
        allow_unschedulable: leave out configs that fit nowhere (listed in the result) instead
            of raising :class:`~plora_hpo.planner.simulate.UnschedulableError`.
        calibration: cost-model factors; default: the stored calibration of (model, GPU) if any.
        fill: plan the packs a sweep starts: configs DTM leaves for a later wave join a starting
            pack they fit in (:mod:`~plora_hpo.planner.fill`); False: the paper's DTM alone.
        rotate: the configs still waiting once every GPU has a pack take turns in the single-GPU
            packs starting then, as a sweep with ``pack.rotate`` keeps a full pack full; False:
            they wait for a GPU to free up.

    Returns:
        The schedule, with baselines, lower bound, solver and planning time.
    """
    started = time.perf_counter()
    if not configs:
        raise PloraError("nothing to plan: the search space yields no configs; add choices or pass --samples N")
    shape_name, model_shape = resolve_model(shape) if isinstance(shape, str) else (shape_name_for_shape(shape), shape)
    if calibration is None:
        calibration = load_calibration(shape_name, gpu.name) if shape_name else Calibration()
    workload = Workload(model_shape, seq_len, tuple(targets), dtype_bytes, checkpointing, logits_chunk_tokens)
    best: tuple[float, JobPlanner, list[PlannedPack]] | None = None
    for long_first, horizon_slack in POLICIES:  # keep the candidate schedule with the smallest makespan
        planner = JobPlanner(
            CostModel(workload, gpu, calibration),
            num_gpus=num_gpus,
            load_factor=load_factor,
            max_degree=max_degree,
            max_pack_size=max_pack_size,
            solver=solver,
            long_first=long_first,
            horizon_slack=horizon_slack,
            fill=fill,
            rotate=rotate,
        )
        planner.add_configs(configs, steps, skip_unschedulable=allow_unschedulable)
        if not planner.pending:
            raise PloraError(
                f"none of the {len(configs)} configs fits on {planner.max_degree} GPU(s) of "
                f"{gpu.memory_gib:g} GiB; use more or larger GPUs, smaller batches or activation checkpointing"
            )
        packs = run_to_completion(planner)
        makespan = max(p.end for p in packs)
        if best is None or makespan < best[0]:
            best = (makespan, planner, packs)
    makespan, planner, packs = best
    baselines = compute_baselines(planner)
    return Schedule(
        packs=packs,
        makespan=makespan,
        policy={"long_first": planner.long_first, "horizon_slack": planner.horizon_slack},
        baselines=baselines,
        solver="+".join(sorted(planner.search.solvers_used, reverse=True)),
        solver_note="; ".join(sorted(planner.search.solver_notes)),
        planning_seconds=time.perf_counter() - started,
        num_gpus=num_gpus,
        max_degree=planner.max_degree,
        memory_limit_bytes=planner.memory_limit,
        unschedulable=planner.unschedulable,
        calibrated_from=calibration.observations,
    )
