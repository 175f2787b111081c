"""PLoRA's packing planner: which configs train together, on which GPUs, and when.

Importable without torch; needs numpy (and highspy or gurobipy to solve ILPs; the cost model
needs numpy alone, fitting calibration factors also scipy).

- :func:`plan_packs` — configs → a whole predicted :class:`Schedule` (what ``plora-hpo plan`` prints).
- :class:`JobPlanner` — the same planner online: ``next_packs`` / ``finished`` / ``add_configs``.
- :class:`CostModel`, :class:`GpuSpec`, :class:`Workload` — memory and step-time predictions.
- :func:`record_observation` — the trainer's calibration hook after a pack's first steps.
"""

from plora_hpo.planner.baselines import Baselines
from plora_hpo.planner.calibration import Calibration
from plora_hpo.planner.cost_model import CostModel, GpuSpec, Workload
from plora_hpo.planner.model_names import resolve_model, shape_name_for_model, shape_name_for_shape
from plora_hpo.planner.observations import cache_dir, load_calibration, record_observation
from plora_hpo.planner.plan import plan_packs, steps_for_epochs
from plora_hpo.planner.schedule import Schedule
from plora_hpo.planner.simulate import JobPlanner, PlannedPack, UnschedulableError, run_to_completion

__all__ = [
    "Baselines",
    "Calibration",
    "CostModel",
    "GpuSpec",
    "JobPlanner",
    "PlannedPack",
    "Schedule",
    "UnschedulableError",
    "Workload",
    "cache_dir",
    "load_calibration",
    "plan_packs",
    "record_observation",
    "resolve_model",
    "run_to_completion",
    "shape_name_for_model",
    "shape_name_for_shape",
    "steps_for_epochs",
]
