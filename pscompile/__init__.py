"""pscompile: train PyTorch models that do not fit in accelerator memory (PatrickStar's chunks).

The architecture is described in docs/design.md of the repository.
"""

from pscompile.api import compile, min_device_memory
from pscompile.saving import consolidate, load, save
from pscompile.config import AdamW, Config, ParamGroup
from pscompile.resolved import ResolvedConfig, resolve
from pscompile.dims import Dim
from pscompile.errors import BudgetError, ScheduleError
from pscompile.hooks.states import TensorState
from pscompile.kinds import Activations, Backend, Collectives, Mode, Policy
from pscompile.memory.layout import ChunkLayout, build_layout, search_chunk_size
from pscompile.memory.tiers import Tier
from pscompile.planner import Hardware, PlanReport, plan
from pscompile.stats import StepStats

__all__ = ["compile", "min_device_memory", "save", "load", "consolidate", "Config", "ResolvedConfig", "resolve", "Dim", "AdamW", "ParamGroup", "StepStats", "BudgetError", "ScheduleError", "ChunkLayout",
           "build_layout", "search_chunk_size", "TensorState", "Tier", "plan", "Hardware", "PlanReport",
           "Mode", "Backend", "Policy", "Activations", "Collectives"]
__version__ = "0.1.0"

from pscompile.runtime.notices import install_default_handler as _install_default_handler

_install_default_handler()      # warnings and long-step notices reach a user who configured no logging
