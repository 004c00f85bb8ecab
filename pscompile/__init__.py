"""pscompile: train PyTorch models that do not fit in accelerator memory (PatrickStar's chunks)."""

from pscompile.api import compile
from pscompile.config import AdamW, Config
from pscompile.memory.layout import ChunkLayout, build_layout, search_chunk_size
from pscompile.hooks.states import TensorState
from pscompile.stats import StepStats
from pscompile.memory.tiers import Tier

__all__ = ["compile", "Config", "AdamW", "StepStats", "ChunkLayout", "build_layout",
           "search_chunk_size", "TensorState", "Tier"]
__version__ = "0.1.0"
