"""User-facing configuration: ``Config`` (memory, device, mode) and ``AdamW`` (the optimizer).

Both are frozen dataclasses that validate in ``__post_init__`` and raise ``ValueError`` naming
the field and the values that would work. Sizes accept bytes (int) or strings ("512MiB").

``Config`` is plain data: it holds what was given, measures nothing and asks no device. An engine
resolves it once, when it is built, into a ``ResolvedConfig`` (``pscompile/resolved.py``: the
current device, a link preset calibrated on this machine, sizes in bytes, choices as enum members),
the record ``engine.config`` holds.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch

from pscompile.dims import DynamicShapes
from pscompile.kinds import Activations, Backend, Collectives, FrozenFormat, HostKernel, Mode, Policy, StrEnum
from pscompile.units import parse_rate, parse_size

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# link_bandwidth's GPU presets: an accelerator's dense 16-bit matmul peak over its PCIe x16 link's
# rate, in FLOP per byte (``pscompile.memory.rates.calibrated_link`` makes one bytes/s here)
LINK_PRESETS: dict[str, tuple[str, float]] = {
    "v100": ("V100 PCIe: 112 TFLOP/s over PCIe 3.0 x16, 16 GB/s", 112e12 / 16e9),     # 7,000
    "a100": ("A100: 312 TFLOP/s over PCIe 4.0 x16, 32 GB/s", 312e12 / 32e9),          # 9,750
    "h100": ("H100 SXM: 989 TFLOP/s over PCIe 5.0 x16, 64 GB/s", 989e12 / 64e9),      # 15,453
}


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else total physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


ModeName = Literal["compiled", "hooks"]
BackendName = Literal["inductor", "eager"]
PolicyName = Literal["belady", "angel"]
ActivationsName = Literal["auto", "keep", "recompute", "offload"]
CollectivesName = Literal["group", "per_chunk"]
HostKernelName = Literal["auto", "native", "inductor", "eager"]
FrozenFormatName = Literal["compute", "nf4"]


def _choice(value, kind: type[StrEnum], field_name: str, what: str):
    """``value`` (a member of ``kind`` or its value) as the member; else a ValueError naming the field."""
    try:
        return kind(value)
    except ValueError:
        names = tuple(m.value for m in kind)
        raise ValueError(f"{field_name}={value!r} {what}; use one of {names}") from None


@dataclass(frozen=True)
class Config:
    """How pscompile places and moves model data (docs/design.md, "Public API")."""

    device: str | None = None          # compute device: "cuda", "cuda:1", "cpu"; None = cuda if available
    device_memory: int | str | None = None  # budget for everything on the compute device; None = see DESIGN
    host_memory: int | str | None = None    # budget for chunks in host RAM; None = 80% of available RAM
    # folder for the disk tier: the optimizer states host_memory cannot hold live in one file there
    # (created and unlinked at once: nothing is left behind, even by a crash); None = no disk tier
    disk_dir: str | None = None
    chunk_size: int | str = "auto"     # elements per chunk, or "auto" (least padding waste)
    dtype: torch.dtype = torch.bfloat16  # compute dtype; master weights and Adam states are fp32
    mode: Mode | ModeName = Mode.COMPILED  # "compiled" (FX + passes + torch.compile) | "hooks" (runtime hooks)
    backend: Backend | BackendName = Backend.INDUCTOR  # compiled mode only: "inductor" | "eager"
    # compiled mode only: how the residency planner picks victims and fetch times. "belady" fetches
    # on demand and evicts the chunk used farthest ahead (the fewest fetches); "angel" is ANGEL-PTM's
    # unified scheduler (Algorithm 1): every later chunk is fetched as soon as it fits, and a node
    # short of room takes the last move back. Both then start fetches as early as they fit
    planner: Policy | PolicyName = Policy.BELADY
    link_bandwidth: int | str | None = None  # CPU only: emulate a slow device<->host link, e.g. "50MB/s", or
    #   "v100" / "a100" / "h100": as slow, relative to this machine's measured matmul rate, as that GPU's PCIe link
    # CPU only: the race checker (docs/design.md, "The copy contract"): every copy between device and
    # host lands at the latest moment its contract allows -- its destination poisoned from the submit
    # to the wait, its source read only at the wait -- and a buffer freed or reused while a copy owns
    # it raises, naming the graph node. Slower (no copy overlaps compute); the environment variable
    # PSCOMPILE_STRICT_COPIES=1 switches it on for every engine of a process
    strict_copies: bool = False
    initial_loss_scale: float = 2.0**16      # float16 only: starting dynamic loss scale
    loss_scale_growth_interval: int = 2000   # float16 only: steps without overflow before doubling
    # ZeRO data parallelism by chunk: None shards over the default group when torch.distributed is
    # initialized with several ranks; a ProcessGroup shards over that group; False never shards
    process_group: Any = field(default=None, compare=False)
    # ZeRO collectives: "group" all-gathers a communication group of world_size chunks into one
    # slot and reduce-scatters it; "per_chunk" broadcasts each chunk from its owner and reduces its
    # gradients to it (PatrickStar's choice for 16+ ranks: the device holds one chunk, not a group)
    collectives: Collectives | CollectivesName = Collectives.GROUP
    # compiled mode: which saved activations leave the device between the forward and the backward.
    # "auto" takes the fewest segments off that let the schedule fit device_memory (none when it
    # fits as is), each the cheaper way for this machine: recomputed in the backward or offloaded to
    # the host and reloaded (host_memory permitting); "keep" keeps all; "recompute" recomputes every
    # segment it can; "offload" offloads every saved storage it can
    activations: Activations | ActivationsName = Activations.AUTO
    # a step whose gradients hold inf/NaN without loss scaling (float32, bfloat16) raises
    # FloatingPointError; True skips it instead (weights and optimizer states untouched, as with
    # float16's loss scaling)
    skip_nonfinite: bool = False
    # ANGEL-PTM's lock-free updating: the optimizer runs on the host in its own thread while the
    # next steps' forward and backward run; the parameters step t reads hold every update up to
    # t - 1 - staleness and none after (docs/design.md, "Lock-free updating"). False: synchronous
    lock_free: bool = False
    staleness: int = 1                 # lock_free only: steps an update may lag (>= 1)
    # the AdamW update of chunks whose optimizer states live on the host: "native" runs one C++ pass
    # per chunk (upcast, step and cast back fused; built in a second, once per machine), "inductor"
    # the same pass generated by Inductor (a few seconds once), "eager" torch._fused_adamw_; "auto"
    # the first of native, inductor that runs here, for chunks of 1M+ elements (docs/host-optimizer.md)
    optimizer_kernel: HostKernel | HostKernelName = HostKernel.AUTO
    # threads of the host update's kernel (None: torch.get_num_threads())
    optimizer_threads: int | None = None
    # compiled mode, one process: a chunk whose gradients are final on the host before the backward
    # ends is updated on a host thread while the backward goes on (ZeRO-Offload's overlap), out of
    # place until the step commits; bit-identical to False. Off by default: it takes spare host
    # memory, and it is measured on the CPU only (bf16 steps 0.75-0.94x there; docs/host-optimizer.md)
    overlap_update: bool = False
    # CUDA only: the host buffers copies go to and from (the chunk pools, gradient and activation
    # staging) are pinned, so a copy runs on its stream while the host runs on. False: pageable
    # (nothing to pin at start; the driver stages each copy, and a device -> host copy holds the
    # host until it lands). On by default until the lent GPU's A/B row decides (docs/gpu.md)
    pinned_host: bool = True
    # compiled mode: batches whose sizes change. None (torch.compile's automatic dynamic): from a
    # batch family's second distinct shape on, the sizes that differ are symbolic, and one capture
    # and one plan, made for the largest size seen, serve every size up to it (docs/dynamic-shapes.md).
    # False: every shape gets its own capture and plan. Sizes named up front, as torch.export's
    # dynamic_shapes: a pytree with the batch's structure whose leaves are None or {dim: pscompile.Dim}
    # (e.g. ({1: seq}, {1: seq})): ranged from the first batch, planned at each Dim's max (pscompile/dims.py)
    dynamic: bool | None | DynamicShapes | Any = None
    # how frozen weights (requires_grad=False) are kept on the host and moved: "compute" in the
    # compute dtype; "nf4" keeps the frozen weight of every nn.Linear in 4-bit NormalFloat,
    # bitsandbytes' blocks of 64 with a float32 absmax each (QLoRA's base), dequantized on the
    # device as its fetch lands (docs/hugging-face.md, "A 4-bit frozen base"); one process only. Weights
    # bitsandbytes loaded in 4 bits (Linear4bit, NF4) stay in NF4 whatever this says (runtime/bnb4bit.py)
    frozen_format: FrozenFormat | FrozenFormatName = FrozenFormat.COMPUTE

    def __post_init__(self):
        """Validation only: every field is checked as given, nothing is rewritten, measured or asked
        of a device (``resolve`` does that, when an engine is built)."""
        dev = self._check_device()
        self._check_sizes()
        self._check_choices()
        self._check_link(dev)
        self._check_copies_and_group(dev)
        self._check_training_flags()

    def _check_device(self) -> torch.device | None:
        """``device`` parsed (None: the engine takes CUDA where it is available)."""
        if self.device is None:
            return None
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device={self.device!r} is not a device; use 'cpu', 'cuda' or 'cuda:N'") from e
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r} is not supported; use 'cpu', 'cuda' or 'cuda:N'")
        return dev

    def _check_sizes(self) -> None:
        """The budgets, the disk folder, the chunk size and the dtype."""
        if self.device_memory is not None and parse_size(self.device_memory, "device_memory") == 0:
            raise ValueError("device_memory=0 leaves no room for anything; give a budget like '256MiB' or None")
        if self.host_memory is not None and parse_size(self.host_memory, "host_memory") == 0:
            raise ValueError("host_memory=0 leaves no room for the chunks' host copies; give a budget like "
                             "'8GiB', or None (80% of the available RAM)")
        if self.disk_dir is not None:
            if not isinstance(self.disk_dir, (str, os.PathLike)) or not os.path.isdir(self.disk_dir):
                raise ValueError(f"disk_dir={self.disk_dir!r} is not an existing folder; create it, or leave "
                                 "disk_dir=None for no disk tier")
        if self.chunk_size != "auto":
            if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size <= 0:
                raise ValueError(f"chunk_size={self.chunk_size!r} must be a positive number of elements or 'auto'")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; use torch.float16, torch.bfloat16 or torch.float32")

    def _check_choices(self) -> None:
        """The enum choices (a member or its value), and the pairs of them that do not go together."""
        mode = _choice(self.mode, Mode, "mode", "is not a mode")
        _choice(self.backend, Backend, "backend", "is not a backend")
        planner = _choice(self.planner, Policy, "planner", "is not a planner")
        if planner != Policy.BELADY and mode != Mode.COMPILED:
            raise ValueError(f"planner={str(planner)!r} plans compiled mode's graph; mode='hooks' evicts at run "
                             "time by farthest next use (planner='belady'); use mode='compiled'")
        _choice(self.collectives, Collectives, "collectives", "is not supported")
        activations = _choice(self.activations, Activations, "activations", "is not a policy")
        _choice(self.optimizer_kernel, HostKernel, "optimizer_kernel", "is not a kernel")
        _choice(self.frozen_format, FrozenFormat, "frozen_format", "is not a format pscompile keeps frozen weights in")
        t = self.optimizer_threads
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise ValueError(f"optimizer_threads={t!r} must be a positive int (threads of the host optimizer "
                             "update) or None (torch.get_num_threads())")
        if activations in (Activations.RECOMPUTE, Activations.OFFLOAD) and mode != Mode.COMPILED:
            raise ValueError(f"activations={str(activations)!r} is planned in compiled mode's graph; in mode='hooks' "
                             "wrap the model's blocks in torch.utils.checkpoint (or torch.autograd.graph."
                             "save_on_cpu) instead, or use mode='compiled'")

    def _check_link(self, dev: torch.device | None) -> None:
        """``link_bandwidth``: a rate, or the name of a GPU preset (calibrated when an engine is
        built); CPU only (``check_on_device`` again once the device is known)."""
        if self.link_bandwidth is None:
            return
        if not is_link_preset(self.link_bandwidth):
            try:
                parse_rate(self.link_bandwidth, "link_bandwidth")
            except ValueError as e:
                raise ValueError(f"{e}; or a GPU preset, one of {sorted(LINK_PRESETS)}") from None
        self.check_on_device(dev)

    def check_on_device(self, dev: torch.device | None) -> None:
        """The fields that hold on the CPU only, for the compute device ``dev`` (None: not known yet)."""
        if dev is None or dev.type == "cpu":
            return
        if self.link_bandwidth is not None:
            raise ValueError("link_bandwidth emulates a slow link on the CPU only; leave it None on CUDA")
        if self.strict_copies:
            raise ValueError("strict_copies is the CPU race checker; on CUDA the copy streams run the copies "
                             "(leave strict_copies=False, or check the schedule with device='cpu')")

    def _check_copies_and_group(self, dev: torch.device | None) -> None:
        """``strict_copies`` (CPU only) and ``process_group``."""
        if not isinstance(self.strict_copies, bool):
            raise ValueError(f"strict_copies={self.strict_copies!r} must be True or False")
        self.check_on_device(dev)
        if self.process_group is not None and self.process_group is not False:
            try:
                import torch.distributed as dist
                ok = dist.is_available() and isinstance(self.process_group, dist.ProcessGroup)
            except ImportError:
                ok = False
            if not ok:
                raise ValueError(f"process_group={self.process_group!r} must be None (the default group when "
                                 "torch.distributed is initialized), False (no sharding) or a "
                                 "torch.distributed.ProcessGroup")

    def _check_training_flags(self) -> None:
        """Non-finite skipping, lock-free updating and loss scaling."""
        if not isinstance(self.skip_nonfinite, bool):
            raise ValueError(f"skip_nonfinite={self.skip_nonfinite!r} must be True or False")
        if not isinstance(self.overlap_update, bool):
            raise ValueError(f"overlap_update={self.overlap_update!r} must be True or False")
        if self.dynamic is True:
            raise ValueError(f"dynamic={self.dynamic!r}: use None (the sizes that change become symbolic from their "
                             "second value, as torch.compile's automatic dynamic) or False (a plan per shape); "
                             "dynamic=True (every size symbolic from the first batch) is not supported; to name the sizes that "
                             "change up front, give a spec such as ({1: pscompile.Dim('seq', max=512)}, None)")
        if self.dynamic is not None and self.dynamic is not False:
            DynamicShapes.from_spec(self.dynamic)      # (checked; the engine holds the parsed spec)
        if not isinstance(self.pinned_host, bool):
            raise ValueError(f"pinned_host={self.pinned_host!r} must be True or False")
        if not isinstance(self.lock_free, bool):
            raise ValueError(f"lock_free={self.lock_free!r} must be True or False")
        if isinstance(self.staleness, bool) or not isinstance(self.staleness, int) or self.staleness < 1:
            raise ValueError(f"staleness={self.staleness!r} must be an int >= 1 (the steps an update may lag in "
                             "lock-free mode); lock_free=False is the synchronous step")
        if self.lock_free and self.dtype == torch.float16:
            raise ValueError("lock_free=True does not support dtype=torch.float16: a step that loss scaling skips "
                             "would have to be known before the updates queued behind it start; use "
                             "torch.bfloat16 or torch.float32, or lock_free=False")
        if not self.initial_loss_scale > 0:
            raise ValueError(f"initial_loss_scale={self.initial_loss_scale!r} must be > 0 (e.g. 65536.0)")
        if not (isinstance(self.loss_scale_growth_interval, int) and self.loss_scale_growth_interval > 0):
            raise ValueError(f"loss_scale_growth_interval={self.loss_scale_growth_interval!r} must be a positive int")


def is_link_preset(value) -> bool:
    """``value`` names one of ``LINK_PRESETS`` (any case, spaces around)."""
    return isinstance(value, str) and value.strip().lower() in LINK_PRESETS


_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")


@dataclass(frozen=True)
class ParamGroup:
    """One parameter group of ``AdamW(param_groups=...)``: the parameters it holds and the
    hyper-parameters it overrides (None: the ``AdamW`` value).

    ``params`` is a list of parameter names (as ``model.named_parameters()`` gives them; a tied
    parameter's other names work too) or a predicate ``f(name, param) -> bool``."""

    params: tuple[str, ...] | Callable[[str, torch.Tensor], bool]
    lr: float | None = None
    betas: tuple[float, float] | None = None
    eps: float | None = None
    weight_decay: float | None = None

    def overrides(self) -> dict:
        return {k: getattr(self, k) for k in _GROUP_KEYS if getattr(self, k) is not None}


def _param_group(i: int, group: Any) -> ParamGroup:
    where = f"param_groups[{i}]"
    if isinstance(group, ParamGroup):
        group = {"params": group.params, **group.overrides()}
    if not isinstance(group, dict):
        raise ValueError(f"{where} is a {type(group).__name__}; give a dict like torch.optim.AdamW's, e.g. "
                         "{'params': ['lm_head.bias'], 'weight_decay': 0.0}, or a pscompile.ParamGroup")
    unknown = sorted(set(group) - {"params", *_GROUP_KEYS})
    if unknown:
        raise ValueError(f"{where} has keys {unknown} pscompile's AdamW does not take per group; use 'params' "
                         f"and any of {list(_GROUP_KEYS)}")
    if "params" not in group:
        raise ValueError(f"{where} has no 'params': give a list of parameter names or a predicate "
                         "f(name, param) -> bool")
    params = group["params"]
    if isinstance(params, str):
        params = (params,)
    if not callable(params):
        if not isinstance(params, (list, tuple, set, frozenset)) or not all(isinstance(n, str) for n in params):
            raise ValueError(f"{where}['params'] must be parameter names (strings, as model.named_parameters() "
                             "gives them) or a predicate f(name, param) -> bool; pscompile places the parameters "
                             "itself, so it takes names rather than tensors")
        params = tuple(sorted(params)) if isinstance(params, (set, frozenset)) else tuple(params)
    # the overrides are validated like the AdamW fields they replace
    checked = AdamW(**{k: group[k] for k in _GROUP_KEYS if k in group})
    return ParamGroup(params, **{k: getattr(checked, k) for k in _GROUP_KEYS if k in group})


def _finite(x, least: float) -> bool:
    """``x`` is a real number (not a bool), finite and at least ``least``."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= least


@dataclass(frozen=True)
class AdamW:
    """AdamW hyper-parameters with exactly ``torch.optim.AdamW`` semantics (decoupled weight
    decay, bias correction), run chunk by chunk on fp32 master weights.

    ``param_groups`` gives some parameters their own learning rate, betas, eps or weight decay,
    in the form ``torch.optim.AdamW`` takes, with names (or a predicate) for parameters, e.g.
    ``[{"params": lambda name, p: p.ndim < 2, "weight_decay": 0.0}]`` for no decay on biases and
    norms. A parameter may be in one group only (as in torch.optim); the parameters no group names
    form a last group with the values above."""

    lr: float = 1e-3                    # learning rate
    betas: tuple[float, float] = (0.9, 0.999)  # exp_avg / exp_avg_sq decay rates
    eps: float = 1e-8                   # denominator term
    weight_decay: float = 0.01          # decoupled weight decay (torch.optim.AdamW default)
    max_grad_norm: float | None = None  # clip the global gradient 2-norm to this value; None = no clipping
    param_groups: tuple[ParamGroup, ...] = ()   # per-group overrides (dicts are converted)

    def __post_init__(self):
        groups = self.param_groups
        if isinstance(groups, dict) or not isinstance(groups, (list, tuple)):
            raise ValueError(f"param_groups={groups!r} must be a list of dicts, e.g. "
                             "[{'params': ['lm_head.bias'], 'weight_decay': 0.0}]")
        object.__setattr__(self, "param_groups", tuple(_param_group(i, g) for i, g in enumerate(groups)))
        if not _finite(self.lr, 0.0):
            raise ValueError(f"lr={self.lr!r} must be a finite number >= 0, e.g. 3e-4")
        if not (isinstance(self.betas, (tuple, list)) and len(self.betas) == 2
                and all(_finite(b, 0.0) and b < 1.0 for b in self.betas)):
            raise ValueError(f"betas={self.betas!r} must be two numbers in [0, 1), e.g. (0.9, 0.95)")
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))
        if not (_finite(self.eps, 0.0) and self.eps > 0):
            raise ValueError(f"eps={self.eps!r} must be a finite number > 0, e.g. 1e-8 (0 divides zero "
                             "gradients by zero)")
        if not _finite(self.weight_decay, 0.0):
            raise ValueError(f"weight_decay={self.weight_decay!r} must be a finite number >= 0, e.g. 0.1")
        if self.max_grad_norm is not None and not (_finite(self.max_grad_norm, 0.0) and self.max_grad_norm > 0):
            raise ValueError(f"max_grad_norm={self.max_grad_norm!r} must be a positive number or None")
