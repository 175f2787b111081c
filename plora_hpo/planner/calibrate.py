"""Fit calibration factors from measured packs and keep them per (model, GPU) on disk.

Why: the analytic prior is only as good as its constants; the first iterations of every real pack
say how far off it is. Observations accumulate in one JSON file per (model, GPU) under the cache
directory, every new one refits the factors, and the next :func:`load_calibration` (called by
:func:`~plora_hpo.planner.plan.plan_packs`) starts calibrated.

Cache directory: ``$PLORA_HPO_CACHE/calibration`` when that variable is set, else
``~/.cache/plora_hpo/calibration``.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

from plora_hpo.adapter import AdapterConfig
from plora_hpo.errors import PloraError
from plora_hpo.planner.calibration import MEMORY_FACTORS, TIME_FACTORS, Calibration
from plora_hpo.planner.cost_model import CostModel, GpuSpec, Workload
from plora_hpo.planner.model_names import resolve_model
from plora_hpo.shapes import ModelShape

MAX_KEPT_OBSERVATIONS = 256
_RIDGE = 1e-4  # pull towards the prior, so few observations move only the factors they inform
_BOUNDS = (0.05, 20.0)


@dataclass(frozen=True)
class Observation:
    """One measured pack: what ran (ranks, batch sizes, workload) and what it cost."""

    ranks: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    seq_len: int
    targets: tuple[str, ...]
    step_seconds: float | None
    peak_bytes: float | None
    degree: int = 1
    dtype_bytes: int = 2
    checkpointing: bool = False
    logits_chunk_tokens: int | None = 4096

    def configs(self) -> list[AdapterConfig]:
        pairs = zip(self.ranks, self.batch_sizes)
        return [AdapterConfig(rank=r, alpha=r, learning_rate=1e-4, batch_size=b) for r, b in pairs]

    def workload(self, shape: ModelShape) -> Workload:
        return Workload(
            shape, self.seq_len, self.targets, self.dtype_bytes, self.checkpointing, self.logits_chunk_tokens
        )

    @classmethod
    def from_dict(cls, data: dict) -> Observation:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        for key in ("ranks", "batch_sizes", "targets"):
            values[key] = tuple(values[key])
        return cls(**values)


def fit_calibration(observations: Sequence[Observation], shape: ModelShape, gpu: GpuSpec) -> Calibration:
    """Least-squares factors (relative errors, ridge towards 1.0) for time and memory separately."""
    time_rows, time_y, mem_rows, mem_y = [], [], [], []
    for obs in observations:
        model = CostModel(obs.workload(shape), gpu)
        configs = obs.configs()
        if obs.step_seconds:
            terms = model.step_terms(configs, obs.degree)
            time_rows.append((terms.launch, terms.fixed, terms.base, terms.lora, terms.comm))
            time_y.append(obs.step_seconds)
        if obs.peak_bytes:
            terms = model.memory_terms(configs, obs.degree)
            mem_rows.append((terms.fixed, terms.activations, terms.adapters))
            mem_y.append(obs.peak_bytes)

    def time_model(theta: np.ndarray, rows: np.ndarray) -> np.ndarray:
        host = theta[0] * rows[:, 0]
        device = rows[:, 1:4] @ theta[1:] + rows[:, 4]
        return np.maximum(host, device) if gpu.async_launch else host + device

    factors = dict.fromkeys(TIME_FACTORS + MEMORY_FACTORS, 1.0)
    if time_y:
        factors.update(zip(TIME_FACTORS, _fit(time_model, np.array(time_rows), np.array(time_y), 4)))
    if mem_y:
        factors.update(zip(MEMORY_FACTORS, _fit(lambda t, r: r @ t, np.array(mem_rows), np.array(mem_y), 3)))
    return Calibration(**factors, observations=len(observations))


def _fit(model, rows: np.ndarray, measured: np.ndarray, n: int) -> list[float]:
    def residuals(theta: np.ndarray) -> np.ndarray:
        return np.concatenate([model(theta, rows) / measured - 1.0, np.sqrt(_RIDGE) * (theta - 1.0)])

    result = least_squares(residuals, np.ones(n), bounds=_BOUNDS, x_scale=1.0, xtol=1e-12, ftol=1e-12)
    return [float(v) for v in result.x]


def cache_dir() -> Path:
    """Where calibrations live: ``$PLORA_HPO_CACHE/calibration`` or ``~/.cache/plora_hpo/calibration``."""
    root = os.environ.get("PLORA_HPO_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "plora_hpo"
    return base / "calibration"


def _slug(text: str) -> str:
    text = re.sub(r"^nvidia[\s_-]+", "", text.strip().lower())  # "NVIDIA H200" and "H200" share a file
    return re.sub(r"[^a-z0-9._]+", "-", text).strip("-")


def calibration_path(model: str, gpu_name: str, directory: Path | None = None) -> Path:
    """The JSON file of one (model, GPU); ``model`` may be a shape name or hub id."""
    shape_name, _ = resolve_model(model)
    return (directory or cache_dir()) / f"{_slug(shape_name)}--{_slug(gpu_name)}.json"


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise PloraError(f"{path}: unreadable calibration file ({err}); delete it to start from the prior") from None


def load_calibration(model: str, gpu_name: str, directory: Path | None = None) -> Calibration:
    """The stored calibration of (model, GPU), or the identity (pure prior) when none exists."""
    path = calibration_path(model, gpu_name, directory)
    if not path.is_file():
        return Calibration()
    return Calibration.from_dict(_read(path).get("calibration", {}))


def _gpu_for(gpu: GpuSpec | str) -> GpuSpec:
    """Rates for the fit; the memory size never enters it, so a placeholder of 1 GiB is fine."""
    if isinstance(gpu, GpuSpec):
        return gpu
    return GpuSpec.host(1.0) if gpu.strip().lower() == "cpu" else GpuSpec(gpu, 1.0)


def record_observation(
    model: str,
    gpu: GpuSpec | str,
    configs: Sequence[AdapterConfig],
    seq_len: int,
    targets: Sequence[str],
    step_seconds: float | None,
    peak_bytes: float | None,
    *,
    degree: int = 1,
    dtype_bytes: int = 2,
    checkpointing: bool = False,
    logits_chunk_tokens: int | None = 4096,
    directory: Path | None = None,
) -> Calibration:
    """Store one measured pack, refit the (model, GPU) factors, persist and return them.

    The trainer calls this after a pack's first iterations (skip the first one or two: warm-up).

    Args:
        model: shape name or hub id (``qwen2.5-7b``, ``Qwen/Qwen2.5-7B-Instruct``).
        gpu: GPU kind name as ``torch.cuda.get_device_name()`` gives it (``"NVIDIA H200"``),
            ``"cpu"`` for CPU runs, or a :class:`GpuSpec` with non-default rates.
        configs: the adapters alive in the pack during the measured steps.
        seq_len, targets: as in the sweep.
        step_seconds: mean wall seconds of one packed step (None: not measured).
        peak_bytes: ``torch.cuda.max_memory_allocated()`` on one of the pack's GPUs (None: not measured).
        degree: GPUs the pack ran on.
        dtype_bytes, checkpointing, logits_chunk_tokens: as in :class:`Workload`.
        directory: calibration directory (default :func:`cache_dir`).

    Returns:
        The refitted calibration, as the next :func:`load_calibration` will return it.
    """
    if step_seconds is not None and not step_seconds > 0:
        raise PloraError(f"step_seconds must be positive, got {step_seconds}")
    if peak_bytes is not None and not peak_bytes > 0:
        raise PloraError(f"peak_bytes must be positive, got {peak_bytes}")
    spec = _gpu_for(gpu)
    shape_name, shape = resolve_model(model)
    path = calibration_path(shape_name, spec.name, directory)
    stored = _read(path).get("observations", []) if path.is_file() else []
    observation = Observation(
        ranks=tuple(int(c.rank) for c in configs),
        batch_sizes=tuple(int(c.batch_size) for c in configs),
        seq_len=seq_len,
        targets=tuple(targets),
        step_seconds=step_seconds,
        peak_bytes=peak_bytes,
        degree=degree,
        dtype_bytes=dtype_bytes,
        checkpointing=checkpointing,
        logits_chunk_tokens=logits_chunk_tokens,
    )
    kept = [Observation.from_dict(o) for o in stored][-(MAX_KEPT_OBSERVATIONS - 1) :]
    observations = [*kept, observation]
    calibration = fit_calibration(observations, shape, spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "model": shape_name,
        "gpu": spec.name,
        "calibration": calibration.to_dict(),
        "observations": [asdict(o) for o in observations],
    }
    # a per-process temp name: sweeps (or test workers) may record the same (model, GPU) at once
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(path)
    return calibration
