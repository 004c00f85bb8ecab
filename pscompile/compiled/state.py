"""What compiled mode adds to a checkpoint, and how a failed run is undone: a mixin of ``CompiledEngine``.

A checkpoint carries compiled mode's measurements (the non-model curve of every capture, the
optimizer-state placement, the measured rates, its re-plans for Inductor's buffers and the
captures it runs as compiled eager, the ranges of batch sizes it
plans for) so a resumed engine plans and lowers exactly as the saved one did from its first step (docs/design.md, section 11).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from pscompile.compiled import trust
from pscompile.compiled.keys import CaptureKey
from pscompile.memory.rates import Rates
from pscompile.memory.tracker import OverBudget
from pscompile.memory.tiers import Tier
from pscompile.kinds import Activations

if TYPE_CHECKING:
    from pscompile.graph.pipeline import Scheduled

log = logging.getLogger("pscompile.compiled")


class CompiledState:
    """Mixin of ``CompiledEngine``: its part of the state dict, the checks of what a run moved, and
    recovery after a failed run."""

    def _context(self) -> dict:
        """What the saved measurements are valid for."""
        return {"budget": self.budget, "world": self.world, "chunk_size": self.layout.chunk_size,
                "num_chunks": self.layout.num_chunks, "activations": str(self.config.activations),
                "backend": str(self.config.backend), "dtype": str(self.dtype)}

    def _mode_state(self) -> dict:
        """What this engine measured (per capture: the non-model curve it plans with, the one
        measured node by node, its re-plans for Inductor's buffers, whether it runs as compiled eager)
        and where the optimizer states live. A resumed engine plans and compiles exactly the program
        this one runs, instead of measuring again in an eager run whose kernels round differently
        from Inductor's."""
        book = self.book
        entries = ((cap, life.checkpoint_entry(book.analysis(cap).nonmodel))
                   for cap, life in book.lives() if book.analysis(cap) is not None)
        captures = {cap.token: entry for cap, entry in entries if entry is not None}
        rates = None if self._rates is None else [self._rates.flops_per_s, self._rates.link_bytes_per_s]
        measurements = {"context": self._context(), "captures": captures, "os_placed": self._os_placed,
                        "rates": rates, "ranges": self.ranges.state(),
                        "os_device": [c for c in range(self.layout.num_chunks) if self.store.os_tier[c] is Tier.DEVICE]}
        return {"compiled": trust.seal(measurements, self.device)}

    def _load_mode_state(self, sd: dict) -> None:
        saved = sd.get("compiled")
        usable = isinstance(saved, dict) and saved.get("context") == self._context()
        trusted = usable and trust.verified(saved, self.device)
        if self.comm is not None:          # the ranks plan alike: all of them trust, or none does
            trusted = not self.comm.agree_max([int(not trusted)])[0]
        if usable and not trusted:
            log.info("pscompile: the checkpoint's measurements carry no valid tag of this user and machine "
                     "(edited, or saved elsewhere): this engine measures again at its first step")
        if not trusted:
            return                         # another budget or layout, or untrusted: measured anew
        self._restored = dict(saved["captures"])
        self.ranges.restore(saved.get("ranges") or {})     # its batch ranges: planned from the first batch
        rates = saved.get("rates")
        if rates is not None and self.config.activations == Activations.AUTO and Rates(*rates) != self._rates:
            # the rates the saved run chose its activations with (a measurement on a busy machine
            # may choose otherwise, and recomputed or offloaded segments round differently)
            self._rates = Rates(*map(float, rates))
            for cap in self.book.analyzed():
                self._drop_capture(cap)
        now = [c for c in range(self.layout.num_chunks) if self.store.os_tier[c] is Tier.DEVICE]
        if saved["os_placed"] and list(saved["os_device"]) != now:
            self._place_states(set(saved["os_device"]))
        self._os_placed = self._os_placed or saved["os_placed"]
        for cap in self.book.analyzed():
            self._install_restored(cap)

    def _drop_capture(self, cap: CaptureKey) -> None:
        """Forget a capture and its schedules: captured and planned again at its next use."""
        self._drop_schedules(cap)
        self.book.drop_analysis(cap)
        self.book.life(cap).forget()

    def _install_restored(self, cap: CaptureKey) -> None:
        """Plan ``cap`` with a loaded checkpoint's measurements, if it has them for this graph."""
        entry = self._restored.pop(cap.token, None)
        if entry is None:                   # a checkpoint written before captures had a token
            entry = self._restored.pop(repr(cap), None)
        if entry is None or list(self.book.analysis(cap).nonmodel) != list(entry["static"]):
            return
        life = self.book.life(cap)
        life.restore(entry)                 # (what ran as compiled eager runs so again: the same code)
        self._replan_capture(cap, life.curve, measured=True)

    def _prove_restored(self, runs: list) -> None:
        """The line behind the tag (``trust.py``): measurements loaded from a checkpoint are kept
        once a run planned with them stays within the budget. In one process such a run stops at
        the first sample over it (its tracker's ``limit``; ``_distrust_restored`` then drops them
        and the step runs again, measuring). Under ZeRO a run goes on, since the ranks must
        decide together (their plans must match): a run over the budget drops them after the
        step, and the capture's next run measures again, as a fresh engine's first step does."""
        for r in runs:
            cap = r.context.key.capture
            if not self.book.life(cap).unproven:
                continue
            self.book.life(cap).prove()
            over = self.budget is not None and r.tracker.peak_total > self.budget
            if self.comm is not None:
                over = bool(self.comm.agree_max([int(over)])[0])
            if over:
                self._drop_restored(cap, r.tracker.peak_total)

    def _distrust_restored(self, error: OverBudget) -> bool:
        """After a run planned with a checkpoint's measurements stopped over the budget (and was
        undone): drop every capture's unproven measurements; whether there were any."""
        caps = [cap for cap, life in self.book.lives() if life.unproven]
        for cap in caps:
            self._drop_restored(cap, error.total)
        return bool(caps)

    def _drop_restored(self, cap: CaptureKey, peak: int) -> None:
        """Forget the measurements a checkpoint gave ``cap``: planned with the static estimate
        until its next run measures again."""
        log.warning("pscompile: the measurements loaded from the checkpoint understate what %s takes (a run "
                    "reached %d bytes, device_memory=%d): dropped; the capture measures again",
                    cap.token[:80], peak, self.budget)
        static = self.book.analysis(cap).nonmodel
        self.book.life(cap).forget()
        self._fit_optimizer_states(max(static))       # (the curve may leave less margin)
        self._replan_capture(cap, static, measured=False)

    def _abort_run(self, acc: list[torch.Tensor] | None) -> None:
        """After a failed run: no copy left running into memory the recovery frees, nothing in
        flight remembered, stored gradients undone and slots back at the plan's start."""
        self.moves.abort()
        self._recover(restore=acc is None)

    def _comm_bytes(self) -> tuple[int, int]:
        if self.comm is None:
            return 0, 0
        return self.comm.traffic.allgather_bytes, self.comm.traffic.reduce_scatter_bytes

    def _check_comm(self, sched: Scheduled, before: tuple[int, int], acc: list[torch.Tensor] | None) -> None:
        """ZeRO: the run all-gathered and reduce-scattered exactly what the schedule planned."""
        if self.comm is None:
            return
        now = self._comm_bytes()
        comm = (now[0] - before[0], now[1] - before[1])
        if comm != (sched.plan.allgather_bytes, sched.plan.reduce_scatter_bytes):
            self._recover(restore=acc is None)
            raise RuntimeError(f"executor: all-gathered/reduce-scattered {comm} bytes, the schedule planned "
                               f"{(sched.plan.allgather_bytes, sched.plan.reduce_scatter_bytes)}")

    def _check_traffic(self, sched: Scheduled, traffic, acc: list[torch.Tensor] | None, *,
                       ranged: bool = False) -> None:
        """The bytes a run moved (a training run: with the fetches it issued for the next step,
        which its plan counts) must be the bytes its schedule planned; otherwise the run is undone
        and this raises. ``ranged`` (a schedule planned for a range's upper bound): the chunks' bytes
        are checked exactly, the activations' offloaded and reloaded bytes to be equal and within
        the bound's."""
        moved = (traffic.h2d_bytes, traffic.d2h_bytes)
        offload = sched.offload_bytes
        if ranged and traffic.offload_bytes == traffic.reload_bytes <= offload:
            offload = traffic.offload_bytes      # a range's activations are planned at the bound: below it,
        #                                          the same storages move, smaller; the chunks' bytes are exact
        planned = (sched.plan.h2d_bytes + offload, sched.plan.d2h_bytes + offload)
        if moved != planned or traffic.offload_bytes != offload or traffic.reload_bytes != offload:
            self._recover(restore=acc is None)
            raise RuntimeError(f"executor: moved h2d/d2h {moved} bytes (activations: {traffic.offload_bytes} offloaded, "
                               f"{traffic.reload_bytes} reloaded), the schedule planned {planned} "
                               f"({sched.offload_bytes} each way)")

    def _recover(self, *, restore: bool = True) -> None:
        """After a failed graph run: undo stored gradients (``restore``; accumulation leaves the
        parameters intact), put slots back to the plan's start."""
        self.early.undo()              # (chunks updated in the backward get their masters back first)
        touched = {c for f in self.moves.written for c in self.layout.entry(f).chunks} if restore else set()
        self.moves.release_where(self.store.device_homed)
        for c in sorted(touched):
            self.store.restore_from_master(c)
        self._count_outside_steps()
