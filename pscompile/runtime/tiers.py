"""Where model data lives when the host cannot hold it all: a mixin of ``ChunkEngine``
(``runtime/engine.py``).

The host keeps every chunk's compute-dtype copy and optimizer states when it can
(``memory/model_bytes.py`` counts them). When it cannot, the first chunks live on the device
(``min_device_homes``, their optimizer states with them), or, with ``Config(disk_dir=...)``, the
last chunks keep their optimizer states on disk (``disk_chunks``), and when the host cannot hold
even the compute-dtype chunks, the last ones keep those there too (``param_disk_chunks``: their
parameters and gradients, or an NF4 chunk's packed bytes, live on disk, every optimizer state does). ``host_room`` is what the host
has besides the chunks (offloaded activations use it).
"""

from __future__ import annotations

from pscompile.config import Config, available_host_bytes
from pscompile.errors import BudgetError
from pscompile.memory.disk_homes import ACC_BUFFERS, HOME_BUFFERS, disk_staging_bytes
from pscompile.memory.disk_states import STAGED_SETS
from pscompile.memory.model_bytes import (GRAD_BYTES, STATE_BYTES, ModelBytes, dequant_workspace, device_homable,
                                          owned_chunks, state_chunks)
from pscompile.memory.tiers import Tier
from pscompile.optim.placement import device_state_chunks, host_shortfall_chunks, host_state_chunks
from pscompile.units import format_bytes


class HostTiers:
    """Mixin of ``ChunkEngine``: the host and disk tiers' placement (see the module docstring)."""

    def _device_state_count(self, peak_nonmodel: int) -> int:
        """How many chunks (the first ones) keep their optimizer states on the device, both modes:
        the placement rule (``optim.placement.device_state_chunks``) for ``peak_nonmodel``, none
        where updates must run on the host (ZeRO, lock-free), and at least the chunks the host
        cannot hold."""
        count = 0 if self.states_on_host_only else device_state_chunks(
            budget=self.budget, peak_nonmodel=peak_nonmodel, num_chunks=len(state_chunks(self.layout)),
            param_chunks=self.layout.num_chunks, chunk_size=self.layout.chunk_size, param_chunk_bytes=self.store.param_chunk_bytes,
            state_chunk_bytes=self.store.os_chunk_bytes)
        return max(count, self.min_device_homes)

    def _place_host_tiers(self, config: Config) -> None:
        """Where model data lives when the host cannot hold it all: ``min_device_homes`` chunks on
        the device (their optimizer states with them), or ``disk_chunks`` whose states live on disk;
        ``host_room``, the host bytes besides the chunks (offloaded activations). Raises when no
        tier can take what the host cannot."""
        mb = ModelBytes.of(self.dtype)
        elsize = mb.param_bytes
        host_budget = config.host_memory if config.host_memory is not None else int(0.8 * available_host_bytes())
        owned = owned_chunks(self.layout.num_chunks, rank=self.rank, world=self.world, per_chunk=self.per_chunk)
        grad_sets = config.staleness + 1 if config.lock_free else 0
        host_need = mb.host_bytes(self.layout, owned, self.home_numel, lock_free=config.lock_free,
                                  staleness=config.staleness)
        # Chunks the host cannot hold live on the device (their optimizer states with them): the
        # first ``min_device_homes`` chunks this rank keeps homes for (``device_homes``) at least,
        # whatever the placement rule says
        self.min_device_homes = 0
        self.device_homes: frozenset[int] = frozenset()
        self.host_room = max(0, host_budget - host_need)    # host bytes besides the chunks (offloaded activations)
        # With a disk tier, the optimizer states the host cannot hold live on disk instead
        self.disk_chunks: frozenset[int] = frozenset()
        self.param_disk_chunks: frozenset[int] = frozenset()
        if host_need > host_budget and config.disk_dir is not None:
            self.disk_chunks = self._disk_homes(host_budget, elsize)
        elif host_need > host_budget and config.lock_free:
            raise ValueError(
                f"host_memory={format_bytes(host_budget)} cannot hold this model's chunks with lock-free updating: "
                f"they need {format_bytes(host_need)} ({self.layout.num_chunks} chunks x {mb.per_element} bytes/param, "
                f"plus {grad_sets} fp32 gradient buffer sets for staleness={config.staleness} and a second "
                f"compute-dtype copy, {elsize + 4 * grad_sets} bytes/param); the update thread "
                f"works on host memory, so give host_memory >= {host_need}, a smaller staleness, or lock_free=False")
        elif host_need > host_budget:
            self._place_device_homes(host_budget, host_need, mb)

    def _place_device_homes(self, host_budget: int, host_need: int, mb: ModelBytes) -> None:
        """The first chunks this rank keeps homes for (under ZeRO its shards of the first groups,
        or the first chunks it owns) live on the device, as many as the host cannot hold; each
        takes its optimizer states there (and under ZeRO an fp32 gradient buffer: the shard's
        compute-dtype copy is the master's cast). Raises when the device budget cannot take them."""
        owned = owned_chunks(self.layout.num_chunks, rank=self.rank, world=self.world, per_chunk=self.per_chunk)
        # (a kind never homed on the device, a frozen chunk, stays on the host whatever the room)
        host_only = [c for c in owned if not self.layout.homed_on(c, Tier.DEVICE)]
        owned = device_homable(self.layout, owned)
        unit = self.home_numel
        chunk_need = mb.chunk(unit)
        host_budget = max(0, host_budget - mb.host_bytes(self.layout, host_only, self.home_numel))
        self.min_device_homes = host_shortfall_chunks(num_chunks=len(owned), chunk_bytes=chunk_need,
                                                      host_budget=host_budget)
        self.device_homes = frozenset(owned[:self.min_device_homes])
        self.host_room = max(0, host_budget - (len(owned) - self.min_device_homes) * chunk_need)
        per_home = chunk_need if self.world == 1 else (STATE_BYTES + GRAD_BYTES) * unit
        device_need = self.min_device_homes * per_home
        if self.budget is None or device_need <= self.budget:
            return
        owned_note = f" (this rank's share of {self.world})" if self.world > 1 else ""
        detail = (f"to hold the {self.min_device_homes} chunks host_memory={format_bytes(host_budget)} "
                  f"cannot ({format_bytes(device_need)} before any activation; Config(disk_dir=...) "
                  "keeps their optimizer states on disk instead)")
        raise BudgetError(
            f"host_memory={format_bytes(host_budget)} cannot hold this model's chunks{owned_note}: they need "
            f"{format_bytes(host_need)} ({len(owned)} chunks x 14-16 bytes/param), and "
            f"device_memory={format_bytes(self.budget)} cannot take the other {self.min_device_homes} chunks' homes "
            f"({format_bytes(device_need)} before any activation); give host_memory >= {host_need}, more "
            "device_memory, or Config(disk_dir=...) to keep the optimizer states the host cannot hold on disk",
            minimum=device_need, detail=detail)

    def _agree_home_bytes(self) -> None:
        """ZeRO: every rank plans its moves around the largest device-homes footprint of any rank
        (ranks own different chunks), so all ranks make the same gathers and releases (a collective:
        every rank calls it once, when its store is made)."""
        self._zero_home_bytes = (self.comm.agree_max([self.store.dev_os_pool.bytes_in_use])[0]
                                 if self.comm is not None else 0)

    def _fixed_device_bytes(self) -> int:
        """Device bytes the chunk moves must leave alone: the optimizer states (and, under ZeRO,
        gradient buffers) homed there; under ZeRO the most any rank has, so every rank decides alike."""
        return max(self.store.dev_os_pool.bytes_in_use, self._zero_home_bytes) + dequant_workspace(self.layout)

    @property
    def home_numel(self) -> int:
        """Elements of one chunk's home on this rank (its shard of a group under ZeRO by group)."""
        return self.layout.chunk_size // self.world if self.world > 1 and not self.per_chunk else \
            self.layout.chunk_size

    def _disk_homes(self, host_budget: int, elsize: int) -> frozenset[int]:
        """The chunks (the last ones) whose optimizer states live on disk: the host keeps every
        compute-dtype chunk, the staging buffers of ``STAGED_SETS`` disk chunks and as many chunks' states
        as fit. Sets ``host_room``."""
        # this rank's homes: under ZeRO by group a shard of every group, per chunk the chunks it owns
        owned = [c for c in range(self.layout.num_chunks) if not self.per_chunk or c % self.world == self.rank]
        n, cs = len(owned), self.home_numel
        # what the host holds for every chunk: its compute-dtype copy; lock-free updating adds the
        # next parameters' copy and the fp32 gradient buffer sets (the update thread's)
        lock_free = self.config.lock_free
        per_chunk = elsize + (elsize + GRAD_BYTES * (self.config.staleness + 1) if lock_free else 0)
        on_host, room = host_state_chunks(num_chunks=n, chunk_size=cs, param_bytes=per_chunk,
                                          staging_chunks=STAGED_SETS, host_budget=host_budget)
        if room < 0 and not lock_free and self.world == 1:
            return self._param_disk_homes(host_budget, elsize, owned)
        if room < 0:
            fixed = host_budget - room
            what = (f"the compute-dtype chunks, the next parameters and {self.config.staleness + 1} gradient buffer "
                    "sets" if lock_free else "this model's compute-dtype chunks")
            raise ValueError(
                f"host_memory={format_bytes(host_budget)} cannot hold {what} and the disk "
                f"tier's staging buffers ({format_bytes(fixed)}: {n} chunks x {per_chunk} bytes/param, plus "
                f"{STAGED_SETS} chunks of optimizer states); give host_memory >= {fixed}")
        self.host_room = room
        return frozenset(state_chunks(self.layout, owned)[on_host:])     # (a frozen chunk has no states)

    def _param_disk_homes(self, host_budget: int, elsize: int, owned: list[int]) -> frozenset[int]:
        """The host cannot hold every compute-dtype chunk: every optimizer state lives on disk, and
        so do the parameters of the last chunks the host cannot hold besides the staging buffers
        (``HOME_BUFFERS`` compute-dtype chunks, ``ACC_BUFFERS`` fp32 gradient accumulation buffers,
        ``STAGED_SETS`` chunks of states). Sets ``param_disk_chunks`` and ``host_room``; returns the
        chunks whose states are on disk. The host keeps the first chunks whose homes fit, at their
        kinds' bytes (an NF4 chunk's packed bytes: ``ChunkKind.home_bytes``); a chunk whose kind is
        not homed on disk stays on the host."""
        cs = self.home_numel
        movable = [c for c in owned if self.layout.homed_on(c, Tier.DISK)]
        staging = disk_staging_bytes(cs, elsize) + sum(self.layout.kind(c).home_bytes(cs, elsize)
                                                       for c in owned if c not in set(movable))
        on_host, kept = 0, 0
        for c in movable:
            nbytes = self.layout.kind(c).home_bytes(cs, elsize)
            if staging + kept + nbytes > host_budget:
                break
            on_host, kept = on_host + 1, kept + nbytes
        if host_budget < staging:
            raise ValueError(
                f"host_memory={format_bytes(host_budget)} cannot hold the disk tier's staging buffers and "
                f"the chunks that stay on the host ({format_bytes(staging)}: {HOME_BUFFERS} compute-dtype chunks, "
                f"{ACC_BUFFERS} fp32 gradient accumulation buffers and {STAGED_SETS} chunks of optimizer states, "
                f"{cs} elements each, and any NF4 chunks); give host_memory >= {staging}, or a smaller chunk_size")
        self.param_disk_chunks = frozenset(movable[on_host:])
        self.host_room = host_budget - staging - kept
        return frozenset(owned)

    def _disk_bytes(self) -> tuple[int, int]:
        """Bytes the disk tier has read and written so far."""
        if self.store.disk is None:
            return 0, 0
        t = self.store.disk.queue.traffic
        return t.read_bytes, t.write_bytes

    def model_data(self) -> dict[str, int]:
        """Bytes of model data each tier is home to (this rank's, with ZeRO): ``device`` -- the
        chunks that live there, fp32 master, Adam states and compute-dtype chunk; ``host`` -- the
        host homes. Copies of host chunks cached on the device are not counted (they are copies)."""
        homed = sum(self.store.device_homed(c) for c in range(self.layout.num_chunks))
        return {"device": homed * self.store.param_chunk_bytes + self.store.dev_os_pool.bytes_in_use,
                "host": self.store.host_model_bytes()}

    def describe_tiers(self) -> str:
        n = self.layout.num_chunks
        homed = sum(self.store.device_homed(c) for c in range(n))
        data = self.model_data()
        return (f"model data: {homed}/{n} chunks live on the device ({format_bytes(data['device'])}: master, "
                f"Adam states and compute-dtype chunk; no host copy), {n - homed} on the host "
                f"({format_bytes(data['host'])})")
