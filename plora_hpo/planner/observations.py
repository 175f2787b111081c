"""Measured packs (observations) kept per (model, GPU) on disk, and the factors fitted from them.

Why: the analytic prior is only as good as its constants; the first iterations of every real pack
say how far off it is. Observations accumulate in one JSON file per (model, GPU) under the cache
directory, every new one refits the :class:`~plora_hpo.planner.calibration.Calibration` factors
stored next to them, and the next :func:`load_calibration` (called by
:func:`~plora_hpo.planner.plan.plan_packs`) starts calibrated.

Cache directory: ``$PLORA_HPO_CACHE/calibration`` when that variable is set, else
``~/.cache/plora_hpo/calibration``.

:func:`held_out_errors` checks that calibration generalises: fit on some measured packs (the
small, early ones), predict others (large, later ones) and report both the prior's and the
calibrated model's relative errors.

The fit is scipy's bounded least squares, imported when a fit runs: importing this module (as
:mod:`plora_hpo.planner` does, for the trainer and the GPU benchmarks) needs numpy alone.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from plora_hpo.adapter import AdapterConfig
from plora_hpo.errors import PloraError
from plora_hpo.planner.calibration import MEMORY_FACTORS, TIME_FACTORS, Calibration
from plora_hpo.planner.cost_model import CostModel, GpuSpec, Workload
from plora_hpo.planner.model_names import resolve_model
from plora_hpo.shapes import ModelShape

MAX_KEPT_OBSERVATIONS = 256
_RIDGE = 1e-4  # pull towards the prior, so few observations move only the factors they inform
_BOUNDS = (0.05, 20.0)
# engine knobs the cost model describes, under the names benchmark rows record them ("packing" is
# the trainer's row_layout, "packed_storage" its flat_storage); an observation with any other knob
# set differently (e.g. flat storage off, eager ops) measured something else: callers fit only
# ``Observation.modelled``
_MODELLED_KNOBS = {
    "micro_batch_tokens",
    "activation_checkpointing",
    "loss_chunk_tokens",
    "cast_adapters",
    "packing",
    "prefetch",
}


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
    micro_batch_tokens: int | None = None
    engine: str = "packed"
    knobs: dict = field(default_factory=dict)  # the engine settings of the run, as recorded
    steps_measured: int = 0  # training steps step_seconds was measured over (0: not said)

    @property
    def pack_key(self) -> tuple:
        """What was measured, less the measurement: two observations with the same key timed the
        same pack (the same adapters' ranks and batch sizes, in any order) under the same workload."""
        return (
            tuple(sorted(zip(self.ranks, self.batch_sizes))),
            self.seq_len,
            self.targets,
            self.degree,
            self.dtype_bytes,
            self.checkpointing,
            self.logits_chunk_tokens,
            self.micro_batch_tokens,
            self.engine,
            json.dumps(self.knobs, sort_keys=True),
        )

    @property
    def modelled(self) -> bool:
        """Whether the run used engine settings the cost model describes (the defaults, micro-batching,
        checkpointing, the loss chunk); e.g. a benchmark row with flat storage or prefetch off is not."""
        k = self.knobs
        return (
            set(k) <= _MODELLED_KNOBS
            and k.get("cast_adapters", True) is not False
            and k.get("prefetch", True) is not False
            and k.get("packing", "padded") == "padded"
        )

    def configs(self) -> list[AdapterConfig]:
        pairs = zip(self.ranks, self.batch_sizes)
        return [AdapterConfig(rank=r, alpha=r, learning_rate=1e-4, batch_size=b) for r, b in pairs]

    def workload(self, shape: ModelShape) -> Workload:
        return Workload(
            shape,
            self.seq_len,
            self.targets,
            self.dtype_bytes,
            self.checkpointing,
            self.logits_chunk_tokens,
            self.micro_batch_tokens,
            self.engine,
        )

    @classmethod
    def from_dict(cls, data: dict) -> Observation:
        """From a stored observation or a benchmark's ``observations`` entry (extra keys ignored;
        ``micro_batch_tokens`` taken from ``knobs`` when not given on its own)."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        for key in ("ranks", "batch_sizes", "targets"):
            values[key] = tuple(values[key])
        knobs = dict(values.get("knobs") or {})
        values["knobs"] = knobs
        if values.get("micro_batch_tokens") is None and knobs.get("micro_batch_tokens"):
            values["micro_batch_tokens"] = int(knobs["micro_batch_tokens"])
        return cls(**values)


def fit_calibration(observations: Sequence[Observation], shape: ModelShape, gpu: GpuSpec) -> Calibration:
    """Least-squares factors (relative errors, ridge towards 1.0) for time and memory separately.

    Observations of every degree refit the same factors, each through the terms of its degree;
    ``comm`` (tensor-parallel all-reduces) is fitted only when some observation has degree > 1
    and stays 1.0 otherwise."""
    time_rows, time_y, mem_rows, mem_y = [], [], [], []
    for obs in observations:
        model = CostModel(obs.workload(shape), gpu)
        configs = obs.configs()
        if obs.step_seconds:
            terms = model.step_terms(configs, obs.degree)
            time_rows.append([getattr(terms, name) for name in TIME_FACTORS])
            time_y.append(obs.step_seconds)
        if obs.peak_bytes:
            terms = model.memory_terms(configs, obs.degree)
            mem_rows.append((terms.fixed, terms.activations, terms.adapters))
            mem_y.append(obs.peak_bytes)

    def time_model(theta: np.ndarray, rows: np.ndarray) -> np.ndarray:
        host = theta[0] * rows[:, 0]
        device = rows[:, 1:] @ theta[1:]
        return np.maximum(host, device) if gpu.async_launch else host + device

    factors = dict.fromkeys(TIME_FACTORS + MEMORY_FACTORS, 1.0)
    if time_y:
        rows = np.array(time_rows)
        free = np.ones(len(TIME_FACTORS), dtype=bool)
        free[TIME_FACTORS.index("comm")] = bool(rows[:, TIME_FACTORS.index("comm")].any())
        fitted = _fit(time_model, rows, np.array(time_y), free)
        factors.update(zip(TIME_FACTORS, fitted))
    if mem_y:
        free = np.ones(len(MEMORY_FACTORS), dtype=bool)
        fitted = _fit(lambda t, r: r @ t, np.array(mem_rows), np.array(mem_y), free)
        factors.update(zip(MEMORY_FACTORS, fitted))
    return Calibration(**factors, observations=len(observations))


def _fit(model, rows: np.ndarray, measured: np.ndarray, free: np.ndarray) -> list[float]:
    """Bounded least squares on relative residuals plus a ridge towards 1, from the prior (all 1).

    Relative residuals weigh a 0.1 s pack like a 10 s one; the ridge keeps factors that no
    observation informs (e.g. the device factors when every pack is launch-bound) at 1.0. Factors
    not ``free`` (a term no observation has) stay exactly 1.0.
    scipy is imported here, not at module level: the trainer and the GPU benchmarks import this
    module (through :mod:`plora_hpo.planner`) for the cost model and the calibration files, and only
    refitting needs scipy.
    """
    from scipy.optimize import least_squares

    def full(theta: np.ndarray) -> np.ndarray:
        values = np.ones(len(free))
        values[free] = theta
        return values

    def residuals(theta: np.ndarray) -> np.ndarray:
        return np.concatenate([model(full(theta), rows) / measured - 1.0, np.sqrt(_RIDGE) * (theta - 1.0)])

    result = least_squares(residuals, np.ones(int(free.sum())), bounds=_BOUNDS, method="trf")
    return [float(v) for v in full(result.x)]


def held_out_errors(
    fit_on: Sequence[Observation], predict: Sequence[Observation], shape: ModelShape, gpu: GpuSpec
) -> dict:
    """Calibrate on ``fit_on``, predict ``predict``: how well calibration carries to other packs.

    Returns ``{"calibration": factors, "rows": [...], "memory_error_max", "step_error_max",
    "memory_prior_error_max", "step_prior_error_max"}``; each row has the pack (K, degree, ranks, batch
    sizes, seq_len, micro_batch_tokens, checkpointing), the measured values and the signed
    relative errors ``(pred - measured) / measured`` of the prior and of the calibrated model.
    """
    calibration = fit_calibration(fit_on, shape, gpu)
    rows = []
    for obs in predict:
        workload = obs.workload(shape)
        prior, calibrated = CostModel(workload, gpu), CostModel(workload, gpu, calibration)
        configs = obs.configs()
        row = {
            "K": len(configs),
            "degree": obs.degree,
            "ranks": list(obs.ranks),
            "batch_sizes": list(obs.batch_sizes),
            "seq_len": obs.seq_len,
            "micro_batch_tokens": obs.micro_batch_tokens,
            "checkpointing": obs.checkpointing,
            "peak_bytes": obs.peak_bytes,
            "step_seconds": obs.step_seconds,
        }
        if obs.peak_bytes:
            row["memory_prior_error"] = prior.peak_memory(configs, obs.degree) / obs.peak_bytes - 1
            row["memory_error"] = calibrated.peak_memory(configs, obs.degree) / obs.peak_bytes - 1
        if obs.step_seconds:
            row["step_prior_error"] = prior.step_seconds(configs, obs.degree) / obs.step_seconds - 1
            row["step_error"] = calibrated.step_seconds(configs, obs.degree) / obs.step_seconds - 1
        rows.append(row)

    def worst(key: str) -> float | None:
        values = [abs(r[key]) for r in rows if key in r]
        return max(values) if values else None

    return {
        "calibration": calibration.to_dict(),
        "fit_on": len(fit_on),
        "rows": rows,
        "memory_error_max": worst("memory_error"),
        "step_error_max": worst("step_error"),
        "memory_prior_error_max": worst("memory_prior_error"),
        "step_prior_error_max": worst("step_prior_error"),
    }


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
    micro_batch_tokens: int | None = None,
    steps_measured: int = 0,
    directory: Path | None = None,
) -> Calibration:
    """Store one measured pack, refit the (model, GPU) factors, persist and return them.

    The trainer calls this after a pack's first iterations (skip the first one or two: warm-up),
    and again when the pack's composition ends, over all of its steps. The store keeps one
    observation per pack (:attr:`Observation.pack_key`): a measurement over at least as many steps
    replaces the earlier one, so a pack's first few steps (slowed by a finishing neighbour's
    exports, allocator growth or a compile) stand only until its longer measurement arrives; a
    shorter one leaves the longer in place.

    Args:
        model: shape name or hub id (``qwen2.5-7b``, ``Qwen/Qwen2.5-7B-Instruct``).
        gpu: GPU kind name as ``torch.cuda.get_device_name()`` gives it (``"NVIDIA H200"``),
            ``"cpu"`` for CPU runs, or a :class:`GpuSpec` with non-default rates.
        configs: the adapters alive in the pack during the measured steps.
        seq_len, targets: as in the sweep.
        step_seconds: wall seconds of one packed step, typical of the measured ones (the sweep gives their
            median; None: not measured).
        peak_bytes: ``torch.cuda.max_memory_allocated()`` on one of the pack's GPUs (None: not measured).
        steps_measured: training steps ``step_seconds`` was measured over (0: not said).
        degree: GPUs the pack ran on.
        dtype_bytes, checkpointing, logits_chunk_tokens, micro_batch_tokens: as in :class:`Workload`.
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
    stored = [Observation.from_dict(o) for o in (_read(path).get("observations", []) if path.is_file() else [])]
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
        micro_batch_tokens=micro_batch_tokens,
        steps_measured=steps_measured,
    )
    same = [o for o in stored if o.pack_key == observation.pack_key]
    if any(o.steps_measured > steps_measured for o in same):
        observations = stored  # a longer measurement of this pack stands
    else:
        kept = [o for o in stored if o.pack_key != observation.pack_key]
        observations = [*kept[-(MAX_KEPT_OBSERVATIONS - 1) :], observation]
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
