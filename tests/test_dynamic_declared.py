"""Sizes named up front (issue 60): ``Config(dynamic=...)`` with ``pscompile.Dim``s, torch.export's form.

The batch family is ranged from its first batch: one symbolic capture serves every length, planned
at the Dim's max, and ``min_device_memory`` answers for that range. A spec that does not fit the
batch is refused naming ``Config.dynamic``; a batch above the max plans again, with a WARNING.
"""

from __future__ import annotations

import logging

import pytest
import torch

import pscompile
from conftest import max_weight_diff
from test_dynamic_shapes import HP, LENGTHS, assert_tracks, base, batch, captures, model, train

SEQ = pscompile.Dim("seq", max=max(LENGTHS))


def named(dim: pscompile.Dim = SEQ, **kw) -> pscompile.Config:
    return base(dynamic=({1: dim}, {1: dim}), **kw)


@pytest.fixture(scope="module")
def minima() -> tuple[int, int]:
    """(the range's minimum, the longest batch's own minimum)."""
    ranged = pscompile.min_device_memory(model(), batch(LENGTHS[1], 0), named())
    single = pscompile.min_device_memory(model(), batch(max(LENGTHS), 0), base())
    print(f"range minimum {ranged} bytes, longest batch's own minimum {single} bytes: {ranged / single:.3f}x")
    return ranged, single


@pytest.mark.parametrize("factor", [1.0, 1.15])
def test_one_capture_planned_at_the_max_serves_every_length(minima, factor, caplog):
    budget = int(minima[0] * factor)
    lengths = LENGTHS[1:] + LENGTHS[:1]      # the first batch is not the longest: planned at the max all the same
    batches = [batch(n, i) for i, n in enumerate(lengths)]
    engine, ref, rows = train(batches, named(device_memory=budget), caplog)
    for (loss, want, peak), b in zip(rows, batches):
        assert loss == pytest.approx(want, abs=2e-5), f"length {b[0].shape}"
        assert peak <= budget, f"length {b[0].shape}: peak {peak} over the budget {budget}"
    assert max_weight_diff(engine, ref) < 1e-5
    assert captures(caplog) == 1, [r.getMessage() for r in caplog.records if "capture" in r.getMessage()]
    assert not any("plan of their own" in r.getMessage() or "planning again" in r.getMessage()
                   for r in caplog.records)
    engine.close()


def test_the_range_minimum_covers_the_longest_batch(minima):
    ranged, single = minima
    assert single <= ranged <= 1.2 * single
    # the answer is the range's, whichever batch of it shows the structure
    assert pscompile.min_device_memory(model(), batch(max(LENGTHS), 1), named()) == ranged


@pytest.mark.parametrize("spec, match", [
    (({1: SEQ},), r"Config\.dynamic does not match the batch's structure"),
    (({1: SEQ}, {1: SEQ}, None), r"Config\.dynamic has entries at \['spec\[2\]'\]"),
    (({2: SEQ}, None), r"Config\.dynamic names dim 2 of batch\[0\], which has 2 dims"),
    (({1: pscompile.Dim("seq", max=50)}, None), r"Config\.dynamic: batch\[0\] has size 65 at dim 1, outside"),
])
def test_a_spec_that_does_not_fit_the_first_batch_is_refused(spec, match):
    with pytest.raises(ValueError, match=match):
        pscompile.compile(model(), batch(65, 0), optimizer=HP, config=base(dynamic=spec))
    with pytest.raises(ValueError, match=match):
        pscompile.min_device_memory(model(), batch(65, 0), base(dynamic=spec))


@pytest.mark.parametrize("spec, match", [
    (({1: 128}, None), r"Config\.dynamic\[0\]\[1\]=128 is not a pscompile\.Dim"),
    (({-1: SEQ}, None), r"Config\.dynamic\[0\]: dim index -1 must be >= 0"),
    ((None, None), r"Config\.dynamic=\(None, None\) names no dimension"),
    (SEQ, r"Config\.dynamic=Dim.* is not a dynamic_shapes spec"),
    (({1: SEQ}, {1: pscompile.Dim("seq", max=64)}), r"Config\.dynamic: two Dims are named 'seq'"),
    (True, r"dynamic=True.*None.*False"),
])
def test_a_bad_spec_is_refused_by_config(spec, match):
    with pytest.raises(ValueError, match=match):
        base(dynamic=spec)


def test_dim_bounds_are_checked():
    with pytest.raises(ValueError, match=r"min=1 must be >= 2 for Config\.dynamic"):
        pscompile.Dim("seq", max=64, min=1)
    with pytest.raises(ValueError, match=r"max=8 must be >= min=16"):
        pscompile.Dim("seq", max=8, min=16)


def test_the_spec_is_kept_hashable_and_survives_replace():
    import dataclasses
    config = pscompile.resolve(named())          # (a Config holds the spec as given; resolved, it is parsed)
    assert hash(config) == hash(pscompile.resolve(named())) and config == pscompile.resolve(named())
    assert dataclasses.replace(config, device_memory=1 << 20).dynamic == config.dynamic
    assert dataclasses.replace(named(), device_memory=1 << 20).dynamic == named().dynamic


def test_a_batch_above_the_max_plans_again_with_a_warning(caplog):
    dim = pscompile.Dim("seq", max=40)
    budget = int(pscompile.min_device_memory(model(), batch(60, 0), base()) * 1.3)
    lengths = [30, 35, 60, 20, 60]
    engine, ref, rows = train([batch(n, i) for i, n in enumerate(lengths)], named(dim, device_memory=budget), caplog)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "Dim(name='seq', max=40" in warnings[0] and "[60, 60]" in warnings[0], warnings
    assert captures(caplog) == 1
    assert_tracks(engine, ref, rows, budget)
    engine.close()


def test_a_max_above_what_the_model_runs_is_named(caplog):
    """The test GPT asserts T <= seq_len (128): tracing keeps it as a guard, which a max of 256 breaks."""
    config = named(pscompile.Dim("seq", max=256))
    with caplog.at_level(logging.WARNING, logger="pscompile"):
        pscompile.min_device_memory(model(), batch(65, 0), config)
        engine = pscompile.compile(model(), batch(65, 0), optimizer=HP, config=config)
        engine.step(batch(65, 0))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("<= 128" in w and "[256, 256]" in w for w in warnings), warnings
    engine.close()


def test_hooks_mode_accepts_the_spec():
    config = pscompile.Config(mode="hooks", device="cpu", dtype=torch.float32, dynamic=({1: SEQ}, {1: SEQ}))
    engine = pscompile.compile(model(), batch(30, 0), optimizer=HP, config=config)
    assert all(torch.isfinite(torch.tensor(engine.step(batch(n, i)))) for i, n in enumerate([30, 50]))
    engine.close()
