"""``plan``: does a model train on a machine, how fast, with what settings, without the machine.

The same code path as ``compile`` with fake tensors: ``pipeline.plan_inputs`` captures the
iteration (the model may be on the meta device; nothing is allocated) and picks the layout as the
compiled engine would; ``pipeline.plan_at_budget`` chooses the activation policy (with the
machine's compute and link rates, not this one's) and builds and verifies the schedule of one GPU
(rank 0 of a ZeRO run over the node's GPUs). Then the host and disk tiers are checked as the
engine checks them, the cost model (``planner/cost.py``) estimates the iteration, and the
static-partition baseline is planned from the same capture.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import nn

from pscompile.config import Config
from pscompile.resolved import ResolvedConfig, resolve
from pscompile.errors import BudgetError
from pscompile.graph.pipeline import PlanRequest, choose_activations, plan_at_budget, plan_inputs
from pscompile.memory.rates import Rates
from pscompile.memory.model_bytes import GRAD_BYTES, STATE_BYTES, ModelBytes, owned_chunks, owned_elements
from pscompile.memory.disk_homes import disk_staging_bytes
from pscompile.memory.disk_states import STAGED_SETS
from pscompile.optim.placement import host_shortfall_chunks, host_state_chunks, update_overlaps_next_step
from pscompile.models.gpt import GPT, GPTConfig
from pscompile.planner.cost import Cost, estimate, graph_flops
from pscompile.planner.hardware import Hardware, hardware_preset
from pscompile.planner.lora import LoRA, add_lora
from pscompile.planner.report import Baseline, PlanReport
from pscompile.units import format_bytes
from pscompile.kinds import Activations, Collectives, FrozenFormat, MemKind

__all__ = ["plan", "gpt_on_meta", "token_batch", "BASELINE_HOST_BYTES_PER_PARAM"]

# ZeRO-Offload's host: compute-dtype gradients (2) + fp32 master, exp_avg, exp_avg_sq (12)
BASELINE_HOST_BYTES_PER_PARAM = 14


def gpt_on_meta(cfg: GPTConfig) -> GPT:
    """The GPT of ``cfg`` with its parameters on the meta device (no memory)."""
    with torch.device("meta"):
        return GPT(cfg)


def token_batch(batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of zeros: the planner reads only their shapes."""
    ids = torch.zeros(batch, seq, dtype=torch.long)
    return ids, ids


def _resolve(model: nn.Module | GPTConfig, batch: Any) -> tuple[nn.Module, Any, str, str]:
    if isinstance(model, GPTConfig):
        if not (isinstance(batch, tuple) and len(batch) == 2 and all(isinstance(x, int) for x in batch)):
            raise ValueError(f"batch={batch!r}: with a GPTConfig give the batch shape (batch, seq), e.g. (8, 1024)")
        if batch[1] > model.seq_len:
            raise ValueError(f"batch={batch!r}: seq {batch[1]} > the model's seq_len {model.seq_len}")
        name = f"GPT d{model.d_model} L{model.n_layer} h{model.n_head} vocab {model.vocab_size}"
        return gpt_on_meta(model), token_batch(*batch), name, f"{batch[0]} x {batch[1]}"
    if not isinstance(model, nn.Module):
        raise ValueError(f"model={type(model).__name__}: give an nn.Module (on the meta device is best) or a GPTConfig")
    shapes = [tuple(t.shape) for t in (batch if isinstance(batch, (tuple, list)) else [batch])
              if isinstance(t, torch.Tensor)]
    return model, batch, type(model).__name__, " ".join(str(s) for s in shapes)


def _config(config: Config | None, hw: Hardware) -> ResolvedConfig:
    base = config or Config(device="cpu", dtype=torch.float16)
    return resolve(replace(base, device="cpu", device_memory=hw.device_budget, host_memory=hw.host_budget,
                           link_bandwidth=None, process_group=None, disk_dir=None))


def plan(model: nn.Module | GPTConfig, batch: Any, *, hardware: Hardware | str = "yard",
         config: Config | None = None, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
         lora: LoRA | None = None) -> PlanReport:
    """Plan ``model`` on ``batch`` (per GPU) for ``hardware`` (a ``Hardware`` or a preset name of
    ``planner.hardware.HARDWARE``) as compiled mode would, with ``config``'s dtype, chunk size,
    activation policy, planner and collectives (its device, budgets and link are the hardware's).
    ``model``: an ``nn.Module`` (build it under ``torch.device("meta")``) with an example batch,
    or a ``GPTConfig`` with the batch shape ``(batch, seq)``. Never raises for a model that does
    not fit: the report says where it overflows. ``lora``: plan a LoRA run (``planner/lora.py``:
    the base frozen, adapters on the named projections); frozen parameters count at their
    compute-dtype bytes, or with ``Config(frozen_format="nf4")`` (QLoRA) the frozen linear weights
    at their NF4 bytes at home and over PCIe, dequantized on the GPU as each fetch lands.

    Long on purpose: it is the planner's one sequence (layout, host and disk tiers, schedule, cost,
    report) and reads top to bottom as the report does.
    """
    t0 = time.perf_counter()
    hw = hardware_preset(hardware) if isinstance(hardware, str) else hardware
    module, batch, name, batch_desc = _resolve(model, batch)
    if lora is not None:
        module, name = add_lora(module, lora), f"{name}, LoRA r={lora.rank} on {', '.join(lora.targets)}"
    cfg = _config(config, hw)
    if cfg.frozen_format == FrozenFormat.NF4:
        name = f"{name}, frozen linear weights in NF4"
    world = hw.gpus
    per_chunk = cfg.collectives == Collectives.PER_CHUNK and world > 1
    mb = ModelBytes.of(cfg.dtype)
    elsize = mb.param_bytes
    layout, analyzed = plan_inputs(module, batch, cfg, world=world, per_chunk=per_chunk, loss_fn=loss_fn)
    params = layout.total_numel
    slot = layout.chunk_size * elsize
    model_flops = graph_flops(analyzed.captured.gm)
    rates = Rates(hw.peak_flops * hw.efficiency, hw.pcie)

    # the host and disk tiers, as the engine places them (runtime/tiers.py)
    owned = owned_elements(layout.num_chunks, layout.chunk_size, world=world, per_chunk=per_chunk)
    home = layout.chunk_size // world if world > 1 and not per_chunk else layout.chunk_size
    mine = owned_chunks(layout.num_chunks, world=world, per_chunk=per_chunk)
    host_need = mb.host_bytes(layout, mine, home)       # (frozen chunks: their compute-dtype copy only)
    trained = sum(layout.state_extent(c) if home == layout.chunk_size else home
                  for c in mine if layout.kind(c).updated)      # elements the optimizer updates
    disk_budget = (hw.disk or 0) // world
    tier = _disk_tier(hw, home, owned, elsize, disk_budget, world=world, host_need=host_need)
    disk_bytes, overflow = tier.disk_bytes, tier.overflow
    host_room = max(0, hw.host_budget - host_need) if not tier.param_chunks else tier.host_room

    scheduled, steady, minimum = None, None, None
    variants: dict = {}
    request = PlanRequest.for_config(cfg, budget=hw.device_budget, world=world, per_chunk=per_chunk,
                                     host_room=host_room, device_states=not tier.param_chunks,
                                     device_homes=tier.device_homes, param_disk_chunks=tier.param_chunks)
    try:
        scheduled = plan_at_budget(analyzed, layout, request, rates=rates, variants=variants)
    except BudgetError as e:
        minimum = e.minimum
        overflow.insert(0, f"GPU memory: {' '.join(str(e).split())[:300]}")
    overlaps = update_overlaps_next_step(world=world, lock_free=cfg.lock_free, loss_scaled=cfg.dtype == torch.float16,
                                         disk_states=bool(disk_bytes))
    if scheduled is not None and overlaps:
        # the steady state, as the engine runs it from its third step: each step fetches the
        # next one's first chunks after their update, and starts with them
        first = replace(request, lookahead=True, plan_only=True)
        ahead = plan_at_budget(analyzed, layout, first, rates=rates, variants=variants).lookahead
        if ahead is not None and ahead.fetches:
            steady = plan_at_budget(analyzed, layout, replace(first, start=dict(ahead.fetches)), rates=rates,
                                    variants=variants)

    # the static partition, from the same capture (every activation segment recomputed)
    rec = choose_activations(analyzed, layout, policy=Activations.RECOMPUTE, budget=None, slot_bytes=slot)
    baseline = Baseline(device_bytes=params * elsize + max(rec.nonmodel),
                        host_bytes=layout.trainable_numel * BASELINE_HOST_BYTES_PER_PARAM,
                        device_budget=hw.device_budget, host_budget=hw.cpu_memory)

    common = dict(model=name, hardware=hw.describe(), params=params, gpus=world, batch=batch_desc,
                  dtype=str(cfg.dtype).replace("torch.", ""), device_budget=hw.device_budget,
                  host_budget=hw.host_budget, disk_budget=disk_budget, chunk_size=layout.chunk_size,
                  num_chunks=layout.num_chunks, utilisation=layout.utilisation,
                  baseline_fits=baseline.fits, baseline_detail=baseline.why_not(),
                  baseline_device_bytes=baseline.device_bytes, baseline_host_bytes=baseline.host_bytes,
                  min_device_memory=minimum)
    if scheduled is None:
        return PlanReport(fits=False, overflow="; ".join(overflow), device_model_bytes=0,
                          host_model_bytes=min(host_need, hw.host_budget), disk_model_bytes=disk_bytes,
                          disk_io_bytes=2 * disk_bytes, disk_s=0.0, param_disk_bytes=tier.param_bytes,
                          activations="", peak_device_bytes=0, h2d_bytes=0, d2h_bytes=0, offload_bytes=0,
                          allgather_bytes=0, reduce_scatter_bytes=0, compute_s=0.0, iteration_s=0.0,
                          optimizer_s=0.0, first_iteration_s=0.0, tflops_per_gpu=0.0,
                          plan_s=time.perf_counter() - t0, **common)
    p = scheduled.plan
    # (every state on disk when the parameters are: the engine moves none of them to the device)
    device_states = 0 if tier.param_chunks else sum(map(layout.state_extent, scheduled.os_device))
    if world > 1:                 # ZeRO: the shards homed on the GPU (states and a gradient buffer)
        device_states = tier.device_homes * home
    disk_io = tier.io_bytes(p.actions, layout.num_chunks)
    disk_s = disk_io * hw.gpus / hw.disk_bandwidth           # one disk a node
    # the update's disk I/O runs behind the host optimizer, the parameters' reads and writes
    # behind the forward and backward (each part takes at least its disk time)
    update_s = tier.update_io_bytes * hw.gpus / hw.disk_bandwidth
    nf4 = layout.quantized_chunks
    first = _behind_disk(estimate(scheduled, hw, model_flops=model_flops, host_params=trained - device_states,
                                  device_params=device_states, disk_s=update_s, dequantized=nf4), disk_s - update_s)
    cost = first if steady is None else _behind_disk(estimate(
        steady, hw, model_flops=model_flops, disk_s=update_s, host_params=trained - device_states,
        device_params=device_states, dequantized=nf4), disk_s - update_s)
    acts = scheduled.activations.describe() if scheduled.activations is not None else "activations kept"
    return PlanReport(fits=not overflow, overflow="; ".join(overflow),
                      device_model_bytes=p.num_slots * p.slot_bytes + device_states * (
                          STATE_BYTES + (GRAD_BYTES if world > 1 else 0)),
                      host_model_bytes=min(host_need, hw.host_budget) - device_states * STATE_BYTES,
                      disk_model_bytes=disk_bytes, disk_io_bytes=disk_io, disk_s=disk_s,
                      param_disk_bytes=tier.param_bytes,
                      activations=acts, peak_device_bytes=p.peak_device_bytes,
                      h2d_bytes=p.h2d_bytes, d2h_bytes=p.d2h_bytes, offload_bytes=scheduled.offload_bytes,
                      allgather_bytes=p.allgather_bytes, reduce_scatter_bytes=p.reduce_scatter_bytes,
                      compute_s=cost.compute_s, iteration_s=cost.iteration_s, optimizer_s=cost.optimizer_s,
                      first_iteration_s=first.iteration_s,
                      tflops_per_gpu=cost.tflops, plan_s=time.perf_counter() - t0, **common)


@dataclass(frozen=True)
class DiskTier:
    """What the engine's rule puts on one GPU's share of the disk (``runtime/tiers.py``)."""

    disk_bytes: int                 # optimizer states and compute-dtype chunks on disk
    overflow: list[str]             # what does not fit anywhere
    param_chunks: int = 0           # the last chunks whose compute-dtype homes are on disk too
    param_chunk_bytes: int = 0      # one such chunk's compute-dtype bytes
    state_bytes: int = 0            # optimizer states on disk
    host_room: int = 0              # host bytes besides the chunks and staging buffers
    device_homes: int = 0           # no disk: the first chunks (ZeRO: the GPU's first shards) homed on the GPU

    @property
    def param_bytes(self) -> int:
        return self.param_chunks * self.param_chunk_bytes

    def io_bytes(self, actions, num_chunks: int) -> int:
        """Disk bytes read and written per iteration, at most: the states once each way; a disk
        chunk's parameters read at each of its ``disk_read`` nodes (one ahead of each fetch), its
        gradients written at each writeback, and read twice and written once by the update (the
        norm, then the update that writes the new parameters). The staging cache's hits only lower
        it (``memory/disk_homes.py``)."""
        first = num_chunks - self.param_chunks
        moves = sum(1 for a in actions if a.kind == MemKind.DISK_READ
                    or (a.chunk >= first and a.kind == MemKind.WRITEBACK))
        return self.update_io_bytes + moves * self.param_chunk_bytes

    @property
    def update_io_bytes(self) -> int:
        """The part the optimizer step reads and writes (the rest: the forward's and backward's)."""
        return 2 * self.state_bytes + 3 * self.param_bytes


def _behind_disk(cost: Cost, disk_s: float) -> Cost:
    """``cost`` with its forward and backward taking at least ``disk_s`` (their disk reads and writes)."""
    return replace(cost, forward_backward_s=max(cost.forward_backward_s, disk_s))


def _disk_tier(hw: Hardware, home: int, owned: int, elsize: int, disk_budget: int, *, world: int = 1,
               host_need: int | None = None) -> DiskTier:
    """The engine's rule (``runtime/tiers.py``): without a disk, the first chunks the host cannot
    hold are homed on the GPU (``device_homes``). With one, the host keeps every compute-dtype
    chunk, the staging buffers and as many chunks' states as fit, the last chunks' states go to
    disk; and on one GPU, when the host cannot hold even the compute-dtype chunks, every state goes
    to disk and so do the last chunks' parameters (``HOME_BUFFERS`` compute-dtype chunks staged)."""
    mb_per = elsize + STATE_BYTES
    if (owned * mb_per if host_need is None else host_need) <= hw.host_budget:
        return DiskTier(0, [])
    chunks = -(-owned // home)
    if hw.disk is None:      # the chunks the host cannot hold live on the GPU (the plan says if it can)
        return DiskTier(0, [], device_homes=host_shortfall_chunks(num_chunks=chunks, chunk_bytes=home * mb_per,
                                                                   host_budget=hw.host_budget))
    on_host, room = host_state_chunks(num_chunks=chunks, chunk_size=home, param_bytes=elsize,
                                      staging_chunks=STAGED_SETS, host_budget=hw.host_budget)
    if room < 0 and world == 1:
        staging = disk_staging_bytes(home, elsize)
        params_on_host = min(chunks, max(0, hw.host_budget - staging) // (elsize * home))
        states = chunks * STATE_BYTES * home
        tier = DiskTier(states + (chunks - params_on_host) * elsize * home, [], chunks - params_on_host,
                        elsize * home, states, max(0, hw.host_budget - staging - params_on_host * elsize * home))
        if hw.disk is not None and hw.host_budget >= staging and tier.disk_bytes <= disk_budget:
            return tier
        why = (f"CPU memory: {format_bytes(hw.host_budget)} cannot hold the disk tier's staging buffers "
               f"({format_bytes(staging)})" if hw.host_budget < staging else
               f"CPU memory: the chunks need {format_bytes(owned * mb_per)} ({owned / 1e9:.2f}B elements x {mb_per} "
               f"bytes) > {format_bytes(hw.host_budget)}" + ("" if hw.disk is None else
                                                            f" and the disk's {format_bytes(disk_budget)}"))
        return dataclasses.replace(tier, overflow=[why])
    disk_bytes = (chunks - on_host) * STATE_BYTES * home
    if hw.disk is not None and room >= 0 and disk_bytes <= disk_budget:
        return DiskTier(disk_bytes, [], state_bytes=disk_bytes)
    why = (" (parameters on disk need one GPU: ZeRO ranks keep their compute-dtype shards on the host)"
           if room < 0 else "")
    return DiskTier(disk_bytes, [f"CPU memory: the chunks need {format_bytes(owned * mb_per)} per GPU ({owned / 1e9:.2f}B "
                                 f"elements x {mb_per} bytes) > its share {format_bytes(hw.host_budget)}"
                                 + f" and the disk's {format_bytes(disk_budget)}" + why],
                    state_bytes=disk_bytes)
