"""An adapter's training state, taken out of a pack and put back into one, bit for bit.

Used for crash-safe checkpoints (on disk, every N steps), for moving adapters out of a pack
that ran out of memory (in host memory), and for resuming after either. The state is what
training reads: LoRA weights, the adapter's AdamW state, its optimizer step count, its data
stream position (the order is seeded, so the position is all the randomness there is) and its
loss curve so far.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from plora_hpo.adapter import AdapterConfig
from plora_hpo.engine.host_copy import host_copies, queue_host_copies
from plora_hpo.engine.trainer import AdapterJob, PackedTrainer


@dataclass
class AdapterState:
    """Everything an adapter needs to continue training exactly where it stopped (host tensors)."""

    config: AdapterConfig
    steps_done: int
    weights: dict[str, torch.Tensor]
    optimizer_state: list[dict[str, torch.Tensor]]  # one per parameter, in parameters_of order
    stream_position: tuple[int, int]
    curve: list[tuple[int, float, float]] = field(default_factory=list)  # (step, loss, lr)
    copied: list[torch.cuda.Event] = field(default_factory=list, compare=False, repr=False)
    """Until these complete, the device is still copying into the host tensors (:func:`capture`)."""

    def wait_copied(self) -> None:
        """Wait until the host tensors hold the captured values (before reading them)."""
        for event in self.copied:
            event.synchronize()
        self.copied = []

    def to_dict(self) -> dict:
        self.wait_copied()
        return {
            "config": self.config.as_params(),
            "steps_done": self.steps_done,
            "weights": self.weights,
            "optimizer_state": self.optimizer_state,
            "stream_position": list(self.stream_position),
            "curve": [list(row) for row in self.curve],
        }

    @classmethod
    def from_dict(cls, data: dict) -> AdapterState:
        return cls(
            config=AdapterConfig(**data["config"]),
            steps_done=int(data["steps_done"]),
            weights=data["weights"],
            optimizer_state=data["optimizer_state"],
            stream_position=tuple(data["stream_position"]),
            curve=[(int(s), float(loss), float(lr)) for s, loss, lr in data["curve"]],
        )


def _group_params(trainer: PackedTrainer, adapter_id: str) -> list[torch.nn.Parameter]:
    assert trainer.optimizer is not None
    [group] = [g for g in trainer.optimizer.param_groups if g["adapter_id"] == adapter_id]
    return list(group["params"])


def _converted(
    states: list[dict[str, torch.Tensor]],
    count: int,
    convert: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]],
) -> list[dict[str, torch.Tensor]]:
    """Optimizer states of one adapter's flat parameters in another layout of ``count`` chunks:
    ``convert`` maps each moment (one tensor per chunk); the step count is the same for all."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(count)]
    for key in sorted({k for state in states for k in state}):
        values = [state[key] for state in states]
        converted = convert(values) if values[0].dim() == 2 else [values[0]] * count
        for state, value in zip(out, converted):
            state[key] = value
    return out


def capture_bytes_bound(trainer: PackedTrainer, adapter_id: str) -> int:
    """At most the host bytes :func:`capture` would copy for the adapter now: its weights and
    AdamW moments on this rank, times the tensor-parallel degree (a gathered tensor is whole, and
    no rank holds less than its share of it). Read off this rank's tensors: no copy, no collective."""
    params = _group_params(trainer, adapter_id)
    assert trainer.optimizer is not None
    tensors = [*params, *(v for p in params for v in trainer.optimizer.state.get(p, {}).values())]
    parallel = trainer.packed.parallel
    return sum(t.numel() * t.element_size() for t in tensors) * (1 if parallel is None else parallel.degree)


def capture(trainer: PackedTrainer, adapter_id: str, curve: list[tuple[int, float, float]]) -> AdapterState:
    """Copy an active adapter's state to host memory (between steps).

    On a GPU the copies are queued beside the next step, not waited for: the state's tensors
    hold the captured values once :meth:`AdapterState.wait_copied` returns (:meth:`~AdapterState.to_dict`
    and :func:`restore` wait), and the trainer's next update waits on the device until they are
    copied. Under tensor parallelism the weights and AdamW moments are gathered whole, in an
    unsplit pack's layout (a collective that every rank calls), so the state resumes at any
    degree; that capture is waited for."""
    params = _group_params(trainer, adapter_id)
    assert trainer.optimizer is not None
    packed = trainer.packed
    states = [dict(trainer.optimizer.state.get(p, {})) for p in params]
    if packed.parallel is not None:
        states = _converted(states, len(packed.whole_chunk_widths), packed.whole_rows)
    tensors = {(None, k): v for k, v in packed.state_dict_of(adapter_id).items()} | {
        (i, k): v for i, state in enumerate(states) for k, v in state.items()
    }
    events: list[torch.cuda.Event] = []
    if packed.parallel is None:
        # one page-locked allocation per dtype; a checkpoint file holds the buffer once
        copied, events = queue_host_copies(tensors, shared=True)
        trainer.update_after(events)
    else:
        copied = host_copies(tensors, shared=True)
    weights: dict[str, torch.Tensor] = {}
    optimizer_state: list[dict[str, torch.Tensor]] = [{} for _ in states]
    for (index, key), value in copied.items():
        (weights if index is None else optimizer_state[index])[key] = value
    return AdapterState(
        config=trainer.jobs[adapter_id].config,
        steps_done=trainer.steps_done[adapter_id],
        weights=weights,
        optimizer_state=optimizer_state,
        stream_position=trainer.stream_position(adapter_id),
        curve=list(curve),
        copied=events,
    )


def restore(trainer: PackedTrainer, job: AdapterJob, state: AdapterState) -> None:
    """Add ``job`` to the pack with ``state``'s weights, AdamW state, step count and data position."""
    if state.config != job.config:
        raise ValueError(
            f"{job.adapter_id}: the saved state belongs to {state.config.label()}, not {job.config.label()}"
        )
    if not 0 <= state.steps_done <= job.total_steps:
        raise ValueError(f"{job.adapter_id}: saved at step {state.steps_done} of a {job.total_steps}-step budget")
    state.wait_copied()
    trainer.add_job(job)
    trainer.packed.load_state_dict_of(job.adapter_id, state.weights)
    params = _group_params(trainer, job.adapter_id)
    packed, saved_states = trainer.packed, state.optimizer_state
    expected = len(params) if packed.parallel is None else len(packed.whole_chunk_widths)
    if len(saved_states) != expected:
        raise ValueError(f"{job.adapter_id}: saved optimizer state has {len(saved_states)} tensors, not {expected}")
    if packed.parallel is not None:  # whole moments: this rank keeps its part
        saved_states = _converted(saved_states, len(params), packed.local_rows)
    assert trainer.optimizer is not None
    on_device_step = bool(trainer.optimizer.defaults.get("fused") or trainer.optimizer.defaults.get("capturable"))
    for p, saved in zip(params, saved_states):
        if saved:
            # copies (AdamW updates its state in place: the saved state must stay as saved); "step"
            # lives on the host unless AdamW is fused or capturable, as AdamW would have made it
            trainer.optimizer.state[p] = {
                k: v.to(p.device if k != "step" or on_device_step else "cpu", copy=True) for k, v in saved.items()
            }
    trainer.steps_done[job.adapter_id] = state.steps_done
    trainer.streams[job.adapter_id].seek(*state.stream_position)


def stream_positions(trainer: PackedTrainer) -> dict[str, tuple[int, int]]:
    """Where every active adapter's data stream stands (taken before a step, to undo it)."""
    return {a: trainer.stream_position(a) for a in trainer.active}


def abort_step(trainer: PackedTrainer, positions: dict[str, tuple[int, int]]) -> None:
    """Undo a step that raised before its update (out of memory): rewind data, drop gradients."""
    trainer.discard_prefetched()
    for adapter_id, (epoch, cursor) in positions.items():
        if adapter_id in trainer.streams:
            trainer.streams[adapter_id].seek(epoch, cursor)
    trainer.zero_grads()
