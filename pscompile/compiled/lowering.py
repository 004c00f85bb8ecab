"""Compiled mode's executors: how each schedule runs, and the plan checked against its code.

``ScheduleLowering`` is the part of ``CompiledEngine`` that owns the executors of its schedules.
A schedule's life (docs/compiled-mode.md, "A schedule's life"):

1. **capture and plan** (``compiled/planning.py``): the first plan uses the static estimate of the
   non-model bytes; with Inductor every plan keeps headroom for the program's buffers
   (``minimum.program_headroom``, ``pipeline.plan_within``);
2. **measure**: its first run runs node by node (``executor.py``, ``split="nodes"``) and measures
   every node; the capture is planned again with the measured curve;
3. **compile** (``_lower``, when a run of that key comes again, before it starts: a batch of another
   length may come first and form a range, so no program is compiled that would not run): with
   ``backend="inductor"`` the schedule that steady runs take (the warm variant, ``_warm_of``) is
   compiled as one Inductor program (``compiled/whole.py``), memory nodes inside; a range's for
   symbolic sizes (``_symbolic_sizes``), its buffers counted at the bound;
4. **check**: the plan is checked against Inductor's own buffer plan at every memory node
   (``_program_over``), before the program ever runs; a range's program again at each new length
   (``_admits``: Inductor's shape guards, its buffers at that length);
5. **re-plan** (``_fit_program``): where Inductor's buffers exceed the room the plan leaves, the
   capture is planned again with them counted in the segments that did not fit and wherever they
   exceed the measured curve's own peak (``_raised_curve``; deterministic,
   logged, at most ``_MAX_PROGRAM_ROUNDS`` times), and the new schedule is compiled and checked;
   where the budget cannot hold that plan, with ``activations="auto"`` the activation plan is
   chosen once more for the budget less the room Inductor needed (``_rechoose_activations``);
6. **run**: the program, its memory nodes performed by the engine (``compiled/moves.py``).

The one fallback rule: a schedule that is not compiled as one program runs as **compiled eager**
(its regions between memory nodes as eager graph code: ``backend="eager"``, and with Inductor a
cold schedule that has a warm variant under ZeRO, a program Inductor could not compile, a capture
whose re-plans did not fit, the last two said at WARNING with the reason, and a length a range's
program does not admit, at INFO). An eager region's inside (what it allocates beyond what is live
at its start) is learned by the tracker in its executor's first run (``Executor.learn``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import fx

from pscompile.compiled.executor import Executor
from pscompile.compiled.keys import CaptureKey, ScheduleKey
from pscompile.compiled.ranges import ShapeRanges
from pscompile.compiled.whole import SymbolicSizes, WholeProgram
from pscompile.errors import BudgetError
from pscompile.graph.meta import get
from pscompile.graph.minimum import least_budget
from pscompile.graph.ops import is_memory_node
from pscompile.kinds import Activations, Backend

log = logging.getLogger("pscompile.compiled")

if TYPE_CHECKING:
    from pscompile.graph.pipeline import Scheduled

__all__ = ["ScheduleLowering"]

_MODEL_INPUTS = ("slot", "host_chunk", "acc_chunk")    # placeholder metadata of model data
_MAX_PROGRAM_ROUNDS = 2   # re-plans with Inductor's buffers counted; then the capture runs as compiled eager


class ScheduleLowering:
    """Mixin of ``CompiledEngine`` (see the module doc); it relies on the engine's ``config``,
    ``budget``, ``comm``, ``device``, ``store``, ``book``, ``_replan_capture`` and
    ``_warm_of``."""

    def _init_lowering(self) -> None:
        # (every table keyed by a schedule's graph keeps it alive until _forget_lowering drops it)
        self._executors: dict = {}        # scheduled gm -> its Executor or WholeProgram
        self._tails: dict = {}            # scheduled gm -> its memory nodes after the last compute
        self._to_lower: set[ScheduleKey] = set()  # measured, its program compiled when a run of it comes
        self._lengths: dict[tuple, bool] = {}   # (range's scheduled gm, its sizes) -> its program runs them
        self._length_eager: dict = {}           # range's scheduled gm -> compiled eager, for lengths refused

    def _forget_lowering(self, gm) -> None:
        """Drop what was made for the schedule of ``gm`` (it is being replaced)."""
        for made in (self._executors, self._tails, self._length_eager):
            made.pop(gm, None)
        self._lengths = {k: v for k, v in self._lengths.items() if k[0] is not gm}

    def _tail(self, sched: Scheduled) -> frozenset[fx.Node]:
        """The memory nodes of ``sched`` after its last compute node (the end of the step)."""
        known = self._tails.get(sched.gm)
        if known is None:
            tail = []
            for n in reversed(list(sched.gm.graph.nodes)):
                if n.op == "output":
                    continue
                if not is_memory_node(n):
                    break
                tail.append(n)
            known = self._tails[sched.gm] = frozenset(tail)
        return known

    def _executor_for(self, key: ScheduleKey, sched: Scheduled, inputs: list | None = None, *,
                      between_steps: bool = False) -> Executor | WholeProgram:
        """The executor of a schedule: node by node for its measuring run, then one compiled program
        (``_program_for``) or compiled eager (the module doc). ``between_steps``: no run is under
        way, so a re-plan may move optimizer states off the device (``_fit_program``). ``inputs``:
        a run's; a range's program runs them where it admits their sizes (``_admits``)."""
        ex = self._executors.get(sched.gm)
        if ex is None:
            ex = self._made_executor(key, sched, between_steps)
        if inputs is not None and isinstance(ex, WholeProgram) and ex.sizes is not None \
                and not self._admits(key, sched, ex, inputs):
            return self._length_eager.setdefault(sched.gm, self._compiled_eager(key, sched))
        return ex

    def _made_executor(self, key: ScheduleKey, sched: Scheduled, between_steps: bool) -> Executor | WholeProgram:
        """``sched``'s executor, made now and kept (``_executor_for``'s first call for it)."""
        if not sched.measured:
            ex = Executor(sched.gm, split="nodes")
        elif self._wants_program(key, sched):
            ex = self._program_for(key, sched, between_steps=between_steps)
            if sched.gm in self._executors:          # (this run's, while the capture was planned again)
                return self._executors[sched.gm]
            ex = ex if ex is not None else self._compiled_eager(key, sched)
        else:
            ex = self._compiled_eager(key, sched)
        self._executors[sched.gm] = ex
        return ex

    def _admits(self, key: ScheduleKey, sched: Scheduled, prog: WholeProgram, inputs: list) -> bool:
        """Whether a range's program runs this length (checked once per length): Inductor's shape
        guards hold for it, and its buffers at this length fit the plan (they grow with the sizes,
        so below the bound they do; checked all the same). A length refused runs the schedule as
        compiled eager, said at INFO with the reason."""
        values = prog.size_values(inputs)
        length = (sched.gm, tuple(sorted(values.items(), key=str)))
        if length not in self._lengths:
            why = None
            if not prog.admits(inputs):
                why = "Inductor's shape guards for the range's program do not hold"
            elif self._program_over(sched, prog, prog.buffers_for(inputs)):
                why = "Inductor's buffers at these sizes exceed the plan"
            if why is not None:
                log.info("pscompile: sizes %s of %s run as compiled eager: %s", list(values.values()),
                         key.capture.describe(), why)
            self._lengths[length] = why is None
        return self._lengths[length]

    def _lower(self, key: ScheduleKey) -> None:
        """Make the executor of ``key``'s schedule now (compiled), not inside the next step: the
        program steady runs take (the warm variant, if any); where its buffers make the capture
        plan again, the new one (bounded)."""
        for _ in range(_MAX_PROGRAM_ROUNDS + 2):
            cold = self.book.cold(key)
            if cold is None:
                return
            target = self._warm_of(key) if self._program_capture(key) and cold.measured else None
            self._executor_for(key, target or cold, between_steps=True)
            if self.book.cold(key) is cold:            # (no re-plan: done)
                return

    def _wants_program(self, key: ScheduleKey, sched: Scheduled) -> bool:
        """Compiled as one program: Inductor, fixed sizes, no reason found to run compiled eager, and
        not a cold schedule with a warm variant (one program per loop: steady runs take the warm
        one, which a run starts from, ``ChunkMoves.warm_start``)."""
        return (self._program_capture(key) and self.book.life(key.capture).eager_reason is None
                and not (sched is self.book.cold(key) and self._warm_of(key) is not None))

    def _lower_when_run(self, key: ScheduleKey) -> None:
        """``key``'s schedule is measured: its program is compiled when a run of it comes
        (``_lower_if_due``), not now (a batch of another length may come first and form a range,
        whose program serves it)."""
        self._to_lower.add(key)

    def _lower_if_due(self, key: ScheduleKey) -> bool:
        """Compile ``key``'s program now if it waits for this run (True: its schedule may have
        been planned again meanwhile; read it anew)."""
        if key not in self._to_lower:
            return False
        self._to_lower.discard(key)
        self._lower(key)
        return True

    def _program_capture(self, key: ScheduleKey) -> bool:
        """Inductor (a range's schedule too: one program for symbolic sizes)."""
        return self.config.backend == Backend.INDUCTOR

    def _symbolic_sizes(self, key: ScheduleKey, sched: Scheduled) -> SymbolicSizes | None:
        """A range's program: its batch's dynamic dimensions as symbols (one per symbol of the range's
        symbolic capture), hinted at the bound the capture was planned for. None for fixed sizes."""
        if not ShapeRanges.is_ranged(key.batch):
            return None
        dims = self.ranges.dims(key.batch)
        bound = self.ranges.planned(key.capture) or self.ranges.bound(key.batch)
        sym = self.ranges.symbolic(key.capture)
        offset = sym.num_params + len(sym.buffer_fqns)
        phs = list(sched.gm.graph.find_nodes(op="placeholder"))
        scale = 1 if self.scaler is not None and key.kind.backward else 0
        first = len(phs) - scale - len(sym.symbolic.inputs) + offset
        exprs, out, hints = {}, [], []
        for (i, d), size in zip(dims, bound):
            expr = sym.symbolic.inputs[offset + i].shape[d].node.expr
            if expr not in exprs:
                exprs[expr] = len(hints)
                hints.append(size)
            out.append((first + i, d, exprs[expr]))
        return SymbolicSizes(tuple(out), tuple(hints))

    # ---------------------------------------------------------------- one compiled program per schedule
    def _program_for(self, key: ScheduleKey, sched: Scheduled, *, between_steps: bool = False) -> WholeProgram | None:
        """Compile ``sched`` as one program and check its plan against Inductor's buffer plan. None
        when it runs as compiled eager instead: Inductor failed (said at WARNING, with the reason,
        from then on for the capture), or its buffers do not fit the plan, which is then made again
        with them counted (``_fit_program``, at most ``_MAX_PROGRAM_ROUNDS`` times)."""
        cap = key.capture
        prog = WholeProgram(sched.gm, self.device, sizes=self._symbolic_sizes(key, sched))
        failed = ""
        try:
            prog.compile()
            if prog.buffers is None:
                failed = "Inductor's buffer plan could not be read"
        except Exception as e:  # noqa: BLE001 - the fallback rule: compiled eager, with the reason
            failed = f"{type(e).__name__}: {str(e)[:300]}"
        if self.comm is not None:      # the ranks run the same kind of code (their collectives match): every
            if self.comm.agree_max([int(bool(failed))])[0]:        # rank asks, whether its own compile failed
                failed = failed or "another rank could not compile it"
        if failed:
            self._eager_program(cap, f"Inductor could not compile the schedule as one program ({failed})")
            return None
        over = self._program_over(sched, prog)
        if self.comm is not None:
            agreed = self.comm.agree_max([max(over.values(), default=0)])[0]
            over = over or ({-1: agreed} if agreed else {})
        log.info("pscompile: %s compiled as one program in %.1f s%s: %d memory nodes, %d ordering edges, Inductor's "
                 "buffers at most %d bytes%s", cap.token[:60], prog.compile_s,
                 " (loaded: compiled by an earlier run)" if prog.cache_hit else "", len(prog.memory_nodes), prog.pinned,
                 prog.buffers.peak, f"; over the plan at {len(over)} memory nodes" if over else "")
        if not over:
            return prog
        self._fit_program(key, sched, prog, over, between_steps=between_steps)
        return None

    def _program_over(self, sched: Scheduled, prog: WholeProgram, buffers=None) -> dict[int, int]:
        """Memory node index -> bytes by which Inductor's buffers (``buffers``, by default at the
        sizes it compiled for) plus the step's fixed non-model bytes (the batch, buffers) exceed the
        room the plan leaves there (``verify_schedule``'s ``room``, for the budget it was planned
        at, plus the headroom between that and the budget: ``planning._program_headroom``), before
        it or while it runs; empty without a budget."""
        if self.budget is None:
            return {}
        fixed = self._fixed_inputs_bytes(sched)
        headroom = self.budget - sched.request.budget      # (the plan was made for less: ``_plan``)
        over: dict[int, int] = {}
        k, room = 0, None
        buffers = buffers or prog.buffers
        for n in sched.gm.graph.nodes:
            r = get(n, "room")
            if r is not None:
                room = r if room is None else min(room, r)
            if k < len(prog.memory_nodes) and n is prog.memory_nodes[k]:
                if room is not None:
                    need = fixed + max(buffers.inside[k], buffers.at[k])
                    if need > room + headroom:
                        over[k] = need - room - headroom
                k, room = k + 1, None
        return over

    def _fixed_inputs_bytes(self, sched: Scheduled) -> int:
        """Bytes of the graph inputs that are neither slots nor host chunks (buffers, the batch):
        live the whole run, non-model, not Inductor's buffers."""
        total = 0
        for p in sched.gm.graph.find_nodes(op="placeholder"):
            v = p.meta.get("val")
            if isinstance(v, torch.Tensor) and not any(get(p, k) is not None for k in _MODEL_INPUTS):
                total += v.numel() * v.element_size()
        return total

    def _fit_program(self, key: ScheduleKey, sched: Scheduled, prog: WholeProgram, over: dict[int, int], *,
                     between_steps: bool = False) -> None:
        """Inductor's buffers do not fit the plan: the capture's schedules are planned again with the
        non-model curve raised to them in every segment that did not fit (deterministic; logged),
        at most ``_MAX_PROGRAM_ROUNDS`` times; then the capture runs as compiled eager (WARNING).
        Between steps, optimizer states kept on the device leave it first where the raised curve
        leaves them less margin (``_fit_optimizer_states``, as a measured curve does). This run
        keeps its plan, run as compiled eager (it holds by construction)."""
        cap, life = key.capture, self.book.life(key.capture)
        this_run = self._compiled_eager(key, sched)
        if life.program_rounds >= _MAX_PROGRAM_ROUNDS:
            self._executors[sched.gm] = this_run
            self._eager_program(cap, f"Inductor's buffers still exceed the plan by up to {max(over.values())} bytes "
                                     f"after {_MAX_PROGRAM_ROUNDS} re-plans")
            return
        curve = self._raised_curve(sched, prog, over, list(life.curve or sched.nonmodel))
        if self.comm is not None:
            curve = self.comm.agree_max(curve)
        rounds = life.raise_for_program(curve)
        log.info("pscompile: %s: Inductor's buffers exceed the plan at %d memory nodes (by up to %d bytes): planned "
                 "again with them counted (round %d of %d)", cap.token[:60], len(over), max(over.values()), rounds,
                 _MAX_PROGRAM_ROUNDS)
        if between_steps:
            self._fit_optimizer_states(max(curve))
        try:
            self._replan_capture(cap, curve, measured=True)
        except BudgetError as e:      # the budget does not hold them: the plan that does (compiled eager)
            before = life.undo_raise()
            if between_steps and self._rechoose_activations(cap, max(over.values())):
                self._executors[sched.gm] = this_run
                return
            self._replan_capture(cap, before, measured=True)     # (None: each its own curve)
            needs = (f"needs device_memory >= {e.minimum} (this budget is {self.budget})" if e.minimum
                     else f"does not fit device_memory={self.budget} ({str(e)[:160]})")
            self._eager_program(cap, f"Inductor's buffers exceed the plan by up to {max(over.values())} bytes, and a "
                                     f"plan with them counted {needs}")
        self._executors[sched.gm] = this_run    # (re-planning forgot it; dropped with it, ``_forget_lowering``)

    def _raised_curve(self, sched: Scheduled, prog: WholeProgram, over: dict[int, int], curve: list[int]
                      ) -> tuple[int, ...]:
        """``curve`` (per captured node) raised to Inductor's buffers (with the step's fixed bytes)
        in each segment between memory nodes that did not fit (``over``; -1: another rank's did not)
        or where they exceed the curve's own peak there: so the next plan counts every place the
        program holds more than eager code, not only those this plan left too little room at."""
        fixed = self._fixed_inputs_bytes(sched)
        segments: dict[int, list[int]] = {}
        k = 0
        for n in sched.gm.graph.nodes:
            if k < len(prog.memory_nodes) and n is prog.memory_nodes[k]:
                k += 1
                continue
            i = get(n, "src_index")
            if i is not None and i < len(curve):
                segments.setdefault(k, []).append(i)
        buffers = prog.buffers
        for k, nodes in segments.items():
            need = fixed + max(buffers.inside[k] if k < len(buffers.inside) else buffers.after, 0)
            if k in over or -1 in over or need > max(curve[i] for i in nodes):
                for i in nodes:
                    curve[i] = max(curve[i], need)
        return tuple(curve)

    def _rechoose_activations(self, cap: CaptureKey, room: int) -> bool:
        """Inductor's buffers do not fit this activation plan even planned with them counted: with
        ``activations="auto"``, choose it again once for the budget less ``room`` (more taken off the
        device, as a smaller budget would; if that choice is the same, as the least budget of every
        choice would), never below that least budget, each
        of the capture's schedules planned anew on its static curve (its next run measures it,
        then it is compiled). False when that is done already, the policy is not "auto", the
        budget is that least already, or the choice is the same."""
        bases = self.book.bases
        base = bases.base(cap)
        if base is None or bases.reserved(cap) or self.config.activations != Activations.AUTO:
            return False
        floor = least_budget(base, self.layout, policy=self.config.activations, slot_bytes=self.store.param_chunk_bytes,
                             world=self.world, device_homes=self.min_device_homes, state_bytes=self.store.os_chunk_bytes,
                             host_room=self.host_room).nbytes
        current = self.book.analysis(cap).captured.gm.code
        chosen = None
        top = self.budget - self._program_headroom(cap) - floor     # (chosen for the budget less the headroom:
        for reserve in dict.fromkeys((min(room, top), top)):        # none fits below that least budget)
            if reserve > 0:
                bases.set_reserve(cap, reserve)
                chosen = self._choose_activations(base, None, cap)
                if chosen.captured.gm.code != current:
                    break
        if chosen is None or chosen.captured.gm.code == current:
            return False
        log.info("pscompile: %s: Inductor's buffers need %d bytes more than the activation plan leaves: it is chosen "
                 "again for a budget that much smaller", cap.describe(), room)
        self.book.set_analysis(cap, chosen)
        self.book.life(cap).refresh()
        self._replan_capture(cap, chosen.nonmodel, measured=False)
        return True

    def _compiled_eager(self, key: ScheduleKey, sched: Scheduled) -> Executor:
        """Compiled eager: the schedule's regions as eager graph code (the fallback rule), learned
        in its first run."""
        return Executor(sched.gm, split="regions", fold_stores=True)

    def _eager_program(self, cap: CaptureKey, why: str) -> None:
        """From now on ``cap`` runs as compiled eager (said once, at WARNING)."""
        if self.book.life(cap).run_eager(why):
            log.warning("pscompile: %s runs as compiled eager: %s", cap.describe(), why)
