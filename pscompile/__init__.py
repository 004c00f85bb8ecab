"""pscompile: train PyTorch models that do not fit in accelerator memory (PatrickStar's chunks)."""

from .api import compile
from .config import AdamW, Config
from .layout import ChunkLayout, build_layout, search_chunk_size
from .states import TensorState
from .stats import StepStats
from .tiers import Tier

__all__ = ["compile", "Config", "AdamW", "StepStats", "ChunkLayout", "build_layout",
           "search_chunk_size", "TensorState", "Tier"]
__version__ = "0.1.0"
