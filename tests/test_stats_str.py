"""``print(engine.stats)`` is a few readable lines with units; ``repr`` stays the dataclass's."""

from __future__ import annotations

import dataclasses

import torch

import pscompile
from pscompile.stats import StepStats
from conftest import make_batches, make_model

MiB = 1 << 20
STATS = StepStats(loss=2.5, h2d_bytes=3 * MiB, d2h_bytes=MiB, disk_read_bytes=0, disk_write_bytes=0,
                  peak_device_bytes=4 * MiB, peak_device_model_bytes=3 * MiB, peak_nonmodel_bytes=MiB,
                  num_fetches=12, num_evictions=9, allgather_bytes=0, reduce_scatter_bytes=0, skipped=False,
                  loss_scale=1.0, time_s=1.234, forward_s=0.4, backward_s=0.6, optimizer_s=0.2, transfer_s=0.05,
                  peak_host_bytes=20 * MiB, compute_ops=400, compiled_ops=300, grad_norm=0.87, device_memory=8 * MiB)


def test_str_is_a_short_summary_with_units_and_repr_the_dataclass_one():
    assert str(STATS).splitlines() == [
        "step 1.23 s (forward 400 ms, backward 600 ms, optimizer 200 ms; copies 50 ms), loss 2.5",
        "device peak 4.0 MiB (50% of the 8.0 MiB budget; chunks up to 3.0 MiB, non-model up to 1.0 MiB); "
        "host peak 20.0 MiB",
        "moved 4.0 MiB: host->device 3.0 MiB, device->host 1.0 MiB; 12 fetches, 9 evictions",
        "compiled share 75% (300 of 400 ops); grad norm 0.87",
    ]
    assert repr(STATS).startswith("StepStats(loss=2.5, h2d_bytes=3145728, ")
    assert eval(repr(STATS), {"StepStats": StepStats}) == STATS       # noqa: S307 -- every field, as before


def test_str_shows_the_traffic_and_states_a_step_has_and_only_those():
    text = str(dataclasses.replace(
        STATS, device_memory=None, skipped=True, loss_scale=65536.0, offload_bytes=MiB, reload_bytes=MiB,
        disk_read_bytes=5 * MiB, disk_write_bytes=5 * MiB, allgather_bytes=7 * MiB, reduce_scatter_bytes=7 * MiB,
        allocator_peak_bytes=5 * MiB, compute_ops=0, grad_norm=None))
    for words in ("loss 2.5 -- update skipped (float16 overflow)", "device peak 4.0 MiB (no budget;",
                  "CUDA allocator peak 5.0 MiB", "moved 14.0 MiB:", "disk read 5.0 MiB, written 5.0 MiB",
                  "activations offloaded 1.0 MiB, reloaded 1.0 MiB",
                  "ZeRO all-gather 7.0 MiB, reduce-scatter 7.0 MiB", "loss scale 65536"):
        assert words in text, text
    assert "compiled share" not in text and "grad norm" not in text, text
    assert len(text.splitlines()) == 5 and max(map(len, text.splitlines())) <= 130, text
    for absent in ("disk", "activations", "ZeRO", "skipped", "loss scale", "allocator"):
        assert absent not in str(STATS), str(STATS)


def test_an_engines_stats_carry_the_budget_it_ran_under():
    batch = make_batches("gpt", 1)[0]
    engine = pscompile.compile(make_model("gpt"), batch, config=pscompile.Config(
        mode="hooks", device="cpu", dtype=torch.float32, device_memory="64MiB"))
    assert engine.stats is None
    engine.step(batch)
    stats = engine.stats
    assert stats.device_memory == engine.budget == 64 * MiB
    assert f"({stats.peak_device_bytes / (64 * MiB):.0%} of the 64.0 MiB budget;" in str(stats), str(stats)
    assert f"loss {stats.loss:.4g}" in str(stats) and len(str(stats).splitlines()) <= 5, str(stats)
    engine.close()
    assert engine.stats is stats                     # the last step's record outlives close()
