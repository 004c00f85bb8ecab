"""compiled/capture_life.py on its own: a capture's stages move only as the LIFE table says, and the
book keeps each capture's analysis, schedules and life together (no engine, no compile)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pscompile.compiled.capture_life import LIFE, CaptureBook, CaptureLife, LifeError, Stage


@dataclass(frozen=True)
class _Cap:                      # a stand-in for keys.CaptureKey: hashable, describes itself
    name: str

    def describe(self) -> str:
        return self.name


@dataclass(frozen=True)
class _Key:                      # ... and for keys.ScheduleKey
    capture: _Cap
    kind: str


def test_every_event_outside_its_stages_raises_and_changes_nothing():
    calls = {"measure": lambda life: life.measure((1, 2)), "raise_for_program": lambda life: life.raise_for_program((3, 4)),
             "undo_raise": CaptureLife.undo_raise, "prove": CaptureLife.prove}
    for event, call in calls.items():
        for stage in set(Stage) - LIFE[event]:
            life = CaptureLife()
            life.stage = stage
            before = dict(vars(life))
            with pytest.raises(LifeError, match=event):
                call(life)
            assert vars(life) == before, (event, stage)


def test_a_life_from_static_to_raised_and_back():
    life = CaptureLife()
    life.measure((5, 7))
    assert (life.stage, life.curve, life.node_curve) == (Stage.MEASURED, (5, 7), (5, 7))
    assert life.raise_for_program((6, 9)) == 1 and life.stage is Stage.RAISED and life.curve == (6, 9)
    assert life.undo_raise() == (5, 7) and life.stage is Stage.MEASURED
    assert life.run_eager("too big") and not life.run_eager("again") and life.eager_reason == "too big"
    life.refresh()                                  # made again: measured anew, what programs learned kept
    assert (life.stage, life.curve, life.program_rounds, life.eager_reason) == (Stage.STATIC, None, 1, "too big")
    life.forget()                                   # everything dropped
    assert (life.stage, life.program_rounds, life.eager_reason) == (Stage.STATIC, 0, None)


def test_a_restored_life_is_proven_to_the_stage_it_was_saved_in():
    saved = CaptureLife()
    saved.measure((5, 7))
    saved.raise_for_program((6, 9))
    entry = saved.checkpoint_entry((1, 1))
    life = CaptureLife()
    life.restore(entry)
    assert life.unproven and life.curve == (6, 9) and life.node_curve == (5, 7)
    life.prove()
    assert life.stage is Stage.RAISED and not life.unproven
    assert CaptureLife().checkpoint_entry((1, 1)) is None       # static: nothing measured to carry


def test_the_book_replaces_a_schedule_in_place_and_drops_a_capture_whole():
    book, a, b = CaptureBook(), _Cap("a"), _Cap("b")
    ka, kb, ka2 = _Key(a, "train"), _Key(b, "train"), _Key(a, "eval")
    for k in (ka, kb, ka2):
        book.set_cold(k, f"cold {k.capture.name} {k.kind}")
    book.set_warm(ka, "warm a")
    book.set_cold(ka, "cold a again")               # a re-plan: the key keeps its place
    assert book.keys() == [ka, kb, ka2] and book.keys(a) == [ka, ka2] and book.last_key() == ka2
    assert book.drop_schedules(ka) == ["cold a again", "warm a"] and book.keys(a) == [ka2]
    assert book.drop_schedules(ka) == [] and book.warm_variants() == []
    book.life(b).measure((1,))
    assert book.known_life(a) is None and [s.capture for s in book.status()] == ["b"]
    assert book.status()[0].stage is Stage.MEASURED
