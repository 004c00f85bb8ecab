"""``resolve(config)``: a ``Config`` (plain data, as given) made into the record an engine runs by.

An engine resolves its ``Config`` once, when it is built (``pscompile.compile``,
``min_device_memory``, the engines, the planner and the graph pipeline's entry points all start
here), and keeps the ``ResolvedConfig`` as ``engine.config``. Resolving

- picks the device (``None``: CUDA where it is available), refuses CUDA on a machine without it,
  and names the device as its tensors do (``cpu``; ``cuda`` -> ``cuda:N``, the current one);
- calibrates a ``link_bandwidth`` preset ("v100", ...) on this machine (a matmul, measured once per
  resolution: to pin it for several engines, resolve once and pass the record, or give a rate);
- turns sizes into bytes, rates into bytes/s, choices into their enum members, a ``dynamic`` spec
  into ``DynamicShapes`` and ``disk_dir`` into a string.

``ResolvedConfig`` is a ``Config`` whose fields hold only those narrowed values, so it is accepted
wherever a ``Config`` is, and resolving it again returns it unchanged.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from pscompile.config import Config, is_link_preset
from pscompile.dims import DynamicShapes
from pscompile.kinds import Activations, Backend, Collectives, FrozenFormat, HostKernel, Mode, Policy
from pscompile.memory.rates import calibrated_link
from pscompile.units import parse_rate, parse_size

__all__ = ["ResolvedConfig", "canonical_device", "resolve"]


@dataclass(frozen=True)
class ResolvedConfig(Config):
    """A ``Config`` resolved for this machine: the fields below hold only the narrowed types."""

    device: str = "cpu"                         # as its tensors name it: "cpu" or "cuda:N"
    device_memory: int | None = None            # bytes
    host_memory: int | None = None              # bytes
    disk_dir: str | None = None
    mode: Mode = Mode.COMPILED
    backend: Backend = Backend.INDUCTOR
    planner: Policy = Policy.BELADY
    link_bandwidth: float | None = None         # bytes/s (a preset calibrated here)
    collectives: Collectives = Collectives.GROUP
    activations: Activations = Activations.AUTO
    optimizer_kernel: HostKernel = HostKernel.AUTO
    frozen_format: FrozenFormat = FrozenFormat.COMPUTE
    dynamic: bool | None | DynamicShapes = None

    def __post_init__(self):
        super().__post_init__()
        narrow = {"device": str, "device_memory": (int, type(None)), "host_memory": (int, type(None)),
                  "disk_dir": (str, type(None)), "mode": Mode, "backend": Backend, "planner": Policy,
                  "link_bandwidth": (float, type(None)), "collectives": Collectives,
                  "activations": Activations, "optimizer_kernel": HostKernel, "frozen_format": FrozenFormat,
                  "dynamic": (bool, type(None), DynamicShapes)}
        for name, kinds in narrow.items():
            if not isinstance(getattr(self, name), kinds):
                raise ValueError(f"ResolvedConfig.{name}={getattr(self, name)!r} is not resolved; change the Config "
                                 "(dataclasses.replace) and resolve it again: pscompile.resolve(config)")

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)


def canonical_device(dev: torch.device) -> torch.device:
    """The device as the tensors on it name theirs, so that ``t.device == engine.device`` holds for
    them: ``cpu`` without an index (CPU tensors carry none: ``cpu:0`` would compare unequal), and
    ``cuda`` with the current device's index (``cuda`` alone compares unequal to ``cuda:0``)."""
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def _device(config: Config) -> torch.device:
    if config.device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(config.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={config.device!r} but CUDA is not available on this machine; use device='cpu'")
    return dev


def _link(config: Config, dev: torch.device) -> float | None:
    if config.link_bandwidth is None:
        return None
    if is_link_preset(config.link_bandwidth):
        # an accelerator's compute-to-link ratio on this machine: measured here, once
        return calibrated_link(config.link_bandwidth.strip(), dev, config.dtype)
    return float(parse_rate(config.link_bandwidth, "link_bandwidth"))


def resolve(config: Config) -> ResolvedConfig:
    """``config`` resolved for this machine (returned as is when it already is)."""
    if isinstance(config, ResolvedConfig):
        return config
    if not isinstance(config, Config):
        raise ValueError(f"config must be pscompile.Config(...), got {type(config).__name__}")
    dev = _device(config)
    config.check_on_device(dev)
    size = {k: None if getattr(config, k) is None else parse_size(getattr(config, k), k)
            for k in ("device_memory", "host_memory")}
    dynamic = config.dynamic
    if dynamic is not None and dynamic is not False:
        dynamic = DynamicShapes.from_spec(dynamic)
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(Config)}
    fields.update(size, device=str(canonical_device(dev)), link_bandwidth=_link(config, dev), dynamic=dynamic,
                  disk_dir=None if config.disk_dir is None else os.fspath(config.disk_dir),
                  mode=Mode(config.mode), backend=Backend(config.backend), planner=Policy(config.planner),
                  collectives=Collectives(config.collectives), activations=Activations(config.activations),
                  optimizer_kernel=HostKernel(config.optimizer_kernel),
                  frozen_format=FrozenFormat(config.frozen_format))
    return ResolvedConfig(**fields)
