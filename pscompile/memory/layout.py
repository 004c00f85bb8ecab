"""ChunkLayout: where every parameter lives inside fixed-size chunks.

Parameters are packed, in a given order (first use), into chunks of ``chunk_size`` elements.
A tensor that fits in a chunk never straddles two chunks (the rest of the chunk is padding); a
tensor larger than a chunk fills the current chunk and continues into the following ones
(ANGEL-PTM's pages), so the chunk size is not bounded by the largest tensor. The same layout is
used by the four chunk lists (compute-dtype params, fp32 master, exp_avg, exp_avg_sq), so a
parameter has the same chunk id and offset in each of them.

Frozen parameters (``requires_grad=False``: a LoRA run's base weights) are packed into chunks of
their own, in the same first-use order: two packing streams, the chunk ids handed out as either
stream opens a chunk. A frozen chunk holds its compute-dtype copy and nothing else; a trainable
chunk's optimizer states cover its **state extent**, the elements up to the end of its last
trainable piece (the last trainable chunk is often mostly padding: its states are not). Frozen
weights kept in NF4 (``Config(frozen_format="nf4")``) are a third stream, each tensor starting on a
block boundary (``NF4_ALIGN``): their chunks are ``FROZEN_NF4`` (``memory/chunk_kinds.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Mapping, Sequence

from pscompile.memory.chunk_kinds import FROZEN, FROZEN_NF4, TRAINABLE, ChunkKind

NF4_ALIGN = 64      # an NF4 tensor starts on a block boundary: its blocks are its own (``memory/nf4.py``)


@dataclass(frozen=True)
class Piece:
    """The part of one tensor that lies in one chunk."""

    chunk: int          # chunk id
    chunk_offset: int   # first element inside the chunk
    tensor_offset: int  # first element inside the flattened tensor
    numel: int


@dataclass(frozen=True)
class TensorEntry:
    """One parameter (tied parameters appear once) and its pieces."""

    fqn: str
    shape: tuple[int, ...]
    numel: int
    pieces: tuple[Piece, ...]
    trainable: bool = True                # False: requires_grad=False, in a frozen chunk
    quantized: bool = False               # frozen and kept in NF4 (``Config.frozen_format``)

    @property
    def chunks(self) -> tuple[int, ...]:
        return tuple(p.chunk for p in self.pieces)

    @property
    def kind(self) -> ChunkKind:
        """The kind of the chunks it lies in (``memory/chunk_kinds.py``)."""
        return TRAINABLE if self.trainable else FROZEN_NF4 if self.quantized else FROZEN

    @property
    def spans(self) -> bool:
        return len(self.pieces) > 1


@dataclass(frozen=True)
class ChunkLayout:
    """Frozen description: parameter fqn -> (chunk id, offset, numel, shape)."""

    chunk_size: int                       # elements per chunk
    entries: tuple[TensorEntry, ...]      # in packing (first-use) order
    num_chunks: int
    aliases: tuple[tuple[str, str], ...] = ()  # (tied fqn, canonical fqn) pairs

    @cached_property
    def _by_fqn(self) -> dict[str, TensorEntry]:
        table = {e.fqn: e for e in self.entries}
        for alias, canonical in self.aliases:
            table[alias] = table[canonical]
        return table

    @cached_property
    def _by_chunk(self) -> tuple[tuple[tuple[TensorEntry, Piece], ...], ...]:
        rows: list[list[tuple[TensorEntry, Piece]]] = [[] for _ in range(self.num_chunks)]
        for e in self.entries:
            for p in e.pieces:
                rows[p.chunk].append((e, p))
        return tuple(tuple(r) for r in rows)

    def entry(self, fqn: str) -> TensorEntry:
        try:
            return self._by_fqn[fqn]
        except KeyError:
            raise KeyError(f"{fqn!r} is not a parameter in this layout") from None

    def chunk_members(self, chunk: int) -> tuple[tuple[TensorEntry, Piece], ...]:
        """(entry, piece) pairs stored in ``chunk``, in offset order."""
        return self._by_chunk[chunk]

    def entry_at(self, chunk: int, offset: int) -> TensorEntry | None:
        """The tensor whose piece covers element ``offset`` of ``chunk`` (None = padding)."""
        for e, p in self._by_chunk[chunk]:
            if p.chunk_offset <= offset < p.chunk_offset + p.numel:
                return e
        return None

    @cached_property
    def _extents(self) -> tuple[int, ...]:
        ext = [0] * self.num_chunks
        for e in self.entries:
            if e.trainable:
                for p in e.pieces:
                    ext[p.chunk] = max(ext[p.chunk], p.chunk_offset + p.numel)
        return tuple(ext)

    def state_extent(self, chunk: int) -> int:
        """Elements of ``chunk`` that have optimizer states (a master, Adam's moments): up to the
        end of its last trainable piece; 0 for a frozen chunk."""
        return self._extents[chunk]

    @cached_property
    def _kinds(self) -> tuple[ChunkKind, ...]:
        return tuple(TRAINABLE if self._extents[c] else members[0][0].kind if members else FROZEN
                     for c, members in enumerate(self._by_chunk))

    def kind(self, chunk: int) -> ChunkKind:
        """``chunk``'s kind (``memory/chunk_kinds.py``): ``TRAINABLE`` when it holds trainable
        parameters, else ``FROZEN`` or (kept in NF4) ``FROZEN_NF4``: the kinds are packed apart."""
        return self._kinds[chunk]

    def is_frozen(self, chunk: int) -> bool:
        """``chunk`` holds frozen parameters only: its compute copy (or NF4 codes) is all it has."""
        return not self.kind(chunk).grad

    def homed_on(self, chunk: int, tier) -> bool:
        """Whether ``chunk``'s kind may have its home on ``tier`` (``memory.tiers.Tier``)."""
        return self.kind(chunk).homed_on(tier)

    @cached_property
    def frozen_chunks(self) -> frozenset[int]:
        return frozenset(c for c in range(self.num_chunks) if self.is_frozen(c))

    @cached_property
    def quantized_chunks(self) -> frozenset[int]:
        """The chunks kept in NF4 (``FROZEN_NF4``)."""
        return frozenset(c for c in range(self.num_chunks) if self.kind(c) is FROZEN_NF4)

    @property
    def state_numel(self) -> int:
        """Elements with optimizer states, over every chunk."""
        return sum(self._extents)

    @property
    def total_numel(self) -> int:
        return sum(e.numel for e in self.entries)

    @property
    def trainable_numel(self) -> int:
        return sum(e.numel for e in self.entries if e.trainable)

    @property
    def capacity_numel(self) -> int:
        return self.num_chunks * self.chunk_size

    @property
    def utilisation(self) -> float:
        """Fraction of chunk space holding parameters (the rest is padding)."""
        return self.total_numel / self.capacity_numel if self.capacity_numel else 1.0

    def describe(self) -> str:
        frozen = len(self.frozen_chunks)
        split = (f" ({self.num_chunks - frozen} trainable, {frozen} frozen: "
                 f"{self.trainable_numel:,} params train)") if frozen else ""
        return (f"{len(self.entries)} tensors, {self.total_numel:,} params in {self.num_chunks} chunks of "
                f"{self.chunk_size:,} elements{split} ({self.utilisation:.1%} utilised)")


def _pack(numels: Sequence[int], chunk_size: int,
          streams: Sequence[int] | None = None) -> tuple[list[tuple[Piece, ...]], int]:
    """Pack in order; ``streams`` (one key per tensor) packs each key's tensors into chunks of their
    own, the chunk ids handed out in the order the chunks are opened."""
    pieces_per_tensor: list[tuple[Piece, ...]] = []
    count = 0
    state: dict[int, list[int]] = {}         # stream -> [current chunk, offset in it]

    def new_chunk() -> int:
        nonlocal count
        count += 1
        return count - 1

    for i, numel in enumerate(numels):
        key = 0 if streams is None else streams[i]
        cur = state.get(key)
        if cur is None:
            cur = state[key] = [new_chunk(), 0]
        if numel <= chunk_size:
            if cur[1] + numel > chunk_size:
                cur[:] = [new_chunk(), 0]
            pieces_per_tensor.append((Piece(cur[0], cur[1], 0, numel),))
            cur[1] += numel
        else:
            if cur[1] == chunk_size:
                cur[:] = [new_chunk(), 0]
            pieces, done = [], 0
            while done < numel:
                take = min(numel - done, chunk_size - cur[1])
                pieces.append(Piece(cur[0], cur[1], done, take))
                done += take
                cur[1] += take
                if cur[1] == chunk_size and done < numel:
                    cur[:] = [new_chunk(), 0]
            pieces_per_tensor.append(tuple(pieces))
    return pieces_per_tensor, count


def _trim(pieces: tuple[Piece, ...], numel: int) -> tuple[Piece, ...]:
    """Pieces packed for a footprint rounded up (``NF4_ALIGN``), cut back to the tensor's ``numel``."""
    last = pieces[-1]
    return pieces[:-1] + (Piece(last.chunk, last.chunk_offset, last.tensor_offset, numel - last.tensor_offset),)


def build_layout(tensors: Iterable[tuple[str, tuple[int, ...]]], chunk_size: int,
                 aliases: Mapping[str, str] | None = None, frozen: Iterable[str] = (),
                 quantized: Iterable[str] = ()) -> ChunkLayout:
    """Pack ``(fqn, shape)`` pairs in the given order into chunks of ``chunk_size`` elements.

    ``aliases`` maps tied parameter names to the canonical name that is packed; ``frozen`` names
    the parameters that do not train (packed into chunks of their own); ``quantized`` (frozen
    too) those kept in NF4: a third stream, each tensor starting on a block boundary.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size} must be a positive number of elements")
    tensors = list(tensors)
    numels = []
    for fqn, shape in tensors:
        n = 1
        for s in shape:
            n *= int(s)
        numels.append(n)
    quantized = frozenset(quantized)
    frozen = frozenset(frozen) | quantized
    if quantized and chunk_size % NF4_ALIGN:
        raise ValueError(f"chunk_size={chunk_size}: chunks kept in NF4 hold a multiple of {NF4_ALIGN} elements")
    streams = [2 if fqn in quantized else int(fqn in frozen) for fqn, _ in tensors]
    footprints = [-(-n // NF4_ALIGN) * NF4_ALIGN if fqn in quantized else n for (fqn, _), n in zip(tensors, numels)]
    pieces, num_chunks = _pack(footprints, chunk_size, streams if frozen else None)
    pieces = [_trim(p, n) if fqn in quantized else p for (fqn, _), n, p in zip(tensors, numels, pieces)]
    entries = tuple(TensorEntry(fqn, tuple(int(s) for s in shape), n, p, fqn not in frozen, fqn in quantized)
                    for (fqn, shape), n, p in zip(tensors, numels, pieces))
    return ChunkLayout(chunk_size, entries, num_chunks, tuple(sorted((aliases or {}).items())))


def padding_waste(numels: Sequence[int], chunk_size: int, streams: Sequence[int] | None = None) -> int:
    """Elements of padding when ``numels`` are packed into chunks of ``chunk_size``."""
    _, num_chunks = _pack(numels, chunk_size, streams)
    return num_chunks * chunk_size - sum(numels)


@dataclass(frozen=True)
class ChunkSizeChoice:
    chunk_size: int
    num_chunks: int
    utilisation: float
    candidates: int


def search_chunk_size(numels: Sequence[int], *, max_chunk_size: int | None = None,
                      min_chunks: int = 4, step: int = 1024, max_candidates: int = 512,
                      keep_tensors_whole: bool = False,
                      streams: Sequence[int] | None = None) -> ChunkSizeChoice:
    """Find the chunk size with the least padding waste (PatrickStar's chunk-size search).

    Candidates run from half the upper bound to the upper bound in ``step`` elements. The upper
    bound is the largest tensor (so no tensor has to span chunks), lowered so there are at least
    ``min_chunks`` chunks (eviction needs a choice) and to ``max_chunk_size`` (what the device
    budget allows); a lower bound below the largest tensor makes that tensor span chunks.
    Ties go to the larger chunk (fewer, larger transfers). At most ``max_candidates`` sizes are
    tried (the step grows in multiples of ``step`` for very large models). With
    ``keep_tensors_whole`` no tensor may span chunks: candidates run from the largest tensor to
    1.5 times it, whatever the bounds above. ``streams``: as ``build_layout`` packs frozen and
    trainable tensors apart (one key per tensor); with both kinds, candidates start at an eighth
    of the upper bound.
    """
    total = sum(numels)
    if total == 0:
        raise ValueError("the model has no parameters to place in chunks")
    hi = max(numels)
    hi = min(hi, -(-total // min_chunks))
    if max_chunk_size is not None:
        hi = min(hi, max_chunk_size)
    hi = max(step, -(-hi // step) * step)
    # frozen and trainable tensors packed apart: the trainable stream's last chunk is mostly
    # padding in a LoRA run (its host copy is a whole chunk), so smaller chunks are weighed too
    lo = max(step, (hi // (8 if streams is not None and len(set(streams)) > 1 else 2)) // step * step)
    if keep_tensors_whole:
        lo = -(-max(numels) // step) * step
        hi = lo + (lo // 2) // step * step
    step = max(step, -(-(hi - lo) // (max_candidates * step)) * step)
    best: tuple[int, int] | None = None  # (waste, -size)
    count = 0
    for size in range(lo, hi + 1, step):
        count += 1
        key = (padding_waste(numels, size, streams), -size)
        if best is None or key < best:
            best = key
    size = -best[1]
    _, n = _pack(numels, size, streams)
    return ChunkSizeChoice(size, n, total / (n * size), count)
