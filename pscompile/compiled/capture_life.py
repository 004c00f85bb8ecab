"""What compiled mode has learned about one capture, and the events that change it: one table.

A capture (one traced iteration of a batch shape and run kind, ``keys.CaptureKey``) is planned from a
non-model curve. Which curve, and whether its schedules run as one compiled program, is the
capture's life, owned here by a ``CaptureLife`` (one per capture). ``CaptureBook`` holds every
capture's analysis, schedules and life: one owner. A life's stage is one of ``Stage``, and only the
events in ``LIFE`` move it:

======================  =========================================  =================  ===========================
event                   from                                       to                 where it happens
======================  =========================================  =================  ===========================
``measure``             static, restored                           measured           the capture's first run
                                                                                      (``engine._remeasure``)
``raise_for_program``   measured, restored, raised                 raised             Inductor's buffers exceed the
                                                                                      plan (``lowering._fit_program``)
``undo_raise``          raised                                     the stage before   the raised plan does not fit
``run_eager``           any                                        (eager flag set)   a program cannot run: said at
                                                                                      WARNING (``lowering._eager_program``)
``restore``             any                                        restored           a checkpoint's trusted
                                                                                      measurements (``state._install_restored``)
``prove``               restored                                   the stage saved    a run within the budget
                                                                                      (``state._prove_restored``)
``refresh``             any                                        static             the capture made again: its
                                                                                      activation plan chosen again, a
                                                                                      range's bound raised (rounds and
                                                                                      the eager reason are kept)
``forget``              any                                        static             everything dropped: restored
                                                                                      measurements distrusted, or the
                                                                                      capture dropped (``state``)
======================  =========================================  =================  ===========================

Each change of stage plans the capture's schedules again: where the event happens, the engine
calls ``planning._replan_capture``, the one place a capture is re-planned. An event in a stage the table does not allow raises ``LifeError`` (a bug, never the
user's input). ``CaptureBook.status()`` is the public view of every life (``CaptureStatus``,
``CompiledEngine.captures()``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pscompile.kinds import StrEnum

__all__ = ["ActivationBases", "CaptureBook", "CaptureLife", "CaptureStatus", "LIFE", "Stage"]


class Stage(StrEnum):
    STATIC = "static"        # planned with the static estimate; its next run measures it
    MEASURED = "measured"    # planned with its measured curve
    RESTORED = "restored"    # planned with a checkpoint's measurements, not yet run within the budget
    RAISED = "raised"        # planned with its curve raised to Inductor's buffers (``rounds`` times)


# event -> the stages it may happen in (see the module doc's table)
LIFE: dict[str, frozenset[Stage]] = {
    "measure": frozenset({Stage.STATIC, Stage.RESTORED}),
    "raise_for_program": frozenset({Stage.MEASURED, Stage.RESTORED, Stage.RAISED}),
    "undo_raise": frozenset({Stage.RAISED}),
    "run_eager": frozenset(Stage),
    "restore": frozenset(Stage),
    "prove": frozenset({Stage.RESTORED}),
    "refresh": frozenset(Stage),
    "forget": frozenset(Stage),
}


class LifeError(RuntimeError):
    """An event in a stage the table does not allow (a bug in the engine, never the user's input)."""


@dataclass(frozen=True)
class CaptureStatus:
    """What ran for one capture and why (``engine.captures()``): its stage, the re-plans Inductor's
    buffers caused, why it runs as compiled eager (None: it runs one program where it can)."""

    capture: str
    stage: Stage
    program_rounds: int
    eager_reason: str | None


class CaptureLife:
    """One capture's life (see the module doc). ``curve`` is the non-model curve its plans use
    (None while static), ``node_curve`` what its measuring run measured node by node."""

    def __init__(self):
        self.stage = Stage.STATIC
        self.curve: tuple[int, ...] | None = None
        self.node_curve: tuple[int, ...] | None = None
        self.program_rounds = 0
        self.eager_reason: str | None = None
        self._before_raise: tuple[Stage, tuple[int, ...] | None] | None = None
        self._proven_stage = Stage.MEASURED

    def _move(self, event: str) -> None:
        if self.stage not in LIFE[event]:
            raise LifeError(f"capture life: {event!r} in stage {self.stage.value!r} (allowed in "
                            f"{sorted(s.value for s in LIFE[event])})")

    def measure(self, curve: tuple[int, ...]) -> None:
        self._move("measure")
        self.stage, self.curve, self.node_curve = Stage.MEASURED, tuple(curve), tuple(curve)

    def raise_for_program(self, curve: tuple[int, ...]) -> int:
        """Plan with ``curve`` (raised to Inductor's buffers); returns the round this is."""
        self._move("raise_for_program")
        self._before_raise = (self.stage, self.curve)
        self.stage, self.curve = Stage.RAISED, tuple(curve)
        self.program_rounds += 1
        return self.program_rounds

    def undo_raise(self) -> tuple[int, ...] | None:
        """Back to the curve before the last raise (returned; None: it was static)."""
        self._move("undo_raise")
        self.stage, self.curve = self._before_raise if self._before_raise else (Stage.MEASURED, self.curve)
        return self.curve

    def run_eager(self, why: str) -> bool:
        """From now on compiled eager, for ``why``; whether that is news (said once)."""
        self._move("run_eager")
        news = self.eager_reason is None
        self.eager_reason = self.eager_reason or why
        return news

    def restore(self, entry: dict) -> None:
        """A checkpoint's measurements (``checkpoint_entry``'s form), trusted until a run proves them."""
        self._move("restore")
        self.curve, self.node_curve = tuple(entry["measured"]), tuple(entry["node"])
        self.program_rounds = int(entry.get("program_rounds", 0))
        self.eager_reason = str(entry["eager"]) if entry.get("eager") else None
        self._proven_stage = Stage.RAISED if self.program_rounds else Stage.MEASURED
        self.stage = Stage.RESTORED

    def prove(self) -> None:
        self._move("prove")
        self.stage = self._proven_stage

    def refresh(self) -> None:
        """The capture was made again: static (measured at its next run); what its programs
        learned (rounds, why it runs as compiled eager) is kept."""
        self._move("refresh")
        self.stage, self.curve, self.node_curve, self._before_raise = Stage.STATIC, None, None, None

    def forget(self) -> None:
        """Everything learned: static again (measured at its next run)."""
        self._move("forget")
        self.refresh()
        self.program_rounds, self.eager_reason = 0, None

    @property
    def unproven(self) -> bool:
        return self.stage is Stage.RESTORED

    def checkpoint_entry(self, static: tuple[int, ...]) -> dict | None:
        """What a checkpoint carries of it (None while static: nothing measured)."""
        if self.curve is None:
            return None
        return {"static": list(static), "measured": list(self.curve), "node": list(self.node_curve or self.curve),
                "program_rounds": self.program_rounds, "eager": self.eager_reason}


class ActivationBases:
    """Per capture, what its activation plan is chosen from: the capture before the plan
    (``base``), and the bytes a choice leaves Inductor's buffers (``reserve``: set once, where a
    program did not fit the plan chosen for the whole budget; ``lowering._rechoose_activations``).
    The planning notes the bases and chooses with the reserve; the lowering sets it."""

    def __init__(self):
        self._bases: dict = {}
        self._reserve: dict = {}

    def note(self, cap, analyzed) -> None:
        self._bases[cap] = analyzed

    def base(self, cap):
        return self._bases.get(cap)

    def forget(self, cap) -> None:
        """``cap`` is captured again (a range's new bound): its base goes (a reserve stays)."""
        self._bases.pop(cap, None)

    def reserve(self, cap) -> int:
        return self._reserve.get(cap, 0)

    def reserved(self, cap) -> bool:
        return cap in self._reserve

    def set_reserve(self, cap, nbytes: int) -> None:
        self._reserve[cap] = nbytes


class CaptureBook:
    """Every capture compiled mode holds, and all it holds of each: its analysis (the captured
    graph with its activation plan, ``pipeline.AnalyzedGraph``), what that plan was chosen from
    (``bases``), its schedules (the cold one of each ``ScheduleKey`` and its warm variant,
    ``pipeline.Scheduled``) and its ``CaptureLife``. The engine's planning asks and tells through
    these methods; the schedules of one capture are dropped together (``drop_schedules``)."""

    def __init__(self):
        self._analyses: dict = {}      # CaptureKey -> AnalyzedGraph
        self._cold: dict = {}          # ScheduleKey -> Scheduled, in planning order
        self._warm: dict = {}          # ScheduleKey -> its warm variant
        self._lives: dict = {}         # CaptureKey -> CaptureLife (made at first use)
        self.bases = ActivationBases()

    # the analysis
    def analysis(self, cap):
        """``cap``'s analysis; None while it has none (captured at its next use)."""
        return self._analyses.get(cap)

    def set_analysis(self, cap, analyzed) -> None:
        self._analyses[cap] = analyzed

    def drop_analysis(self, cap) -> None:
        self._analyses.pop(cap, None)

    def analyzed(self) -> list:
        """The captures that have an analysis now."""
        return list(self._analyses)

    # the schedules
    def cold(self, key):
        return self._cold.get(key)

    def set_cold(self, key, sched) -> None:
        self._cold[key] = sched

    def warm(self, key):
        return self._warm.get(key)

    def set_warm(self, key, sched) -> None:
        self._warm[key] = sched

    def keys(self, cap=None) -> list:
        """The keys with a schedule (``cap``'s only, if given), in the order they were planned."""
        return [k for k in self._cold if cap is None or k.capture == cap]

    def last_key(self):
        """The key planned last (None: none is)."""
        return next(reversed(self._cold), None)

    def drop_schedules(self, key) -> list:
        """``key``'s cold schedule and warm variant go; returned (what was made for them goes too)."""
        return [s for s in (self._cold.pop(key, None), self._warm.pop(key, None)) if s is not None]

    def drop_warm(self, key):
        return self._warm.pop(key, None)

    def warm_variants(self) -> list:
        return list(self._warm.values())

    # the lives
    def life(self, cap) -> CaptureLife:
        life = self._lives.get(cap)
        if life is None:
            life = self._lives[cap] = CaptureLife()
        return life

    def known_life(self, cap) -> CaptureLife | None:
        """``cap``'s life if it has one yet (None: nothing learned)."""
        return self._lives.get(cap)

    def lives(self):
        return self._lives.items()

    def status(self) -> list[CaptureStatus]:
        return [CaptureStatus(cap.describe(), life.stage, life.program_rounds, life.eager_reason)
                for cap, life in self._lives.items()]
