"""The planner (``pscompile.plan``): the same plan as ``compile`` on fake tensors, checked against
what compile measures; where it says a model does not fit; the static baseline; the search; the
cost model's use of the schedule; the CLI; and the paper's Table 3 utilisation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import pscompile
from pscompile.cli.main import main as cli_main
from pscompile.models.bert import BertMLM, bert_config
from pscompile.models.gpt import GPT, GPTConfig, gpt_config
from pscompile.memory.layout import build_layout, search_chunk_size
from pscompile.planner import Hardware, plan, search
from pscompile.planner.cost import estimate
from pscompile.graph.pipeline import schedule_model
from pscompile.planner.plan import BASELINE_HOST_BYTES_PER_PARAM
from conftest import make_batches

TINY = GPTConfig(n_layer=2, n_head=2, d_model=64, vocab_size=256, seq_len=64)


def _config(**kw):
    return pscompile.Config(mode="compiled", backend="eager", device="cpu", dtype=torch.float32,
                            activations="recompute", **kw)


def _machine(gpu, cpu=1 << 30, **kw) -> Hardware:
    return Hardware(name="test", gpus=1, gpu_memory=gpu + 1, cpu_memory=cpu, peak_flops=1e10,
                    memory_bandwidth=1e10, pcie=1e9, interconnect=1e9, cpu_bandwidth=1e10, reserved=1, **kw)


@pytest.mark.parametrize("bias", [True, False])
def test_param_shapes_are_the_models(bias):
    cfg = dataclasses.replace(TINY, n_layer=3, bias=bias)
    assert cfg.param_shapes() == [(n, tuple(p.shape)) for n, p in GPT(cfg).named_parameters()]


@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_plan_is_what_compile_plans_and_the_first_step_moves(kind):
    """At every budget from the least up (several of them), the report's bytes moved and peak are
    the compiled engine's plan, and its first step moves exactly those bytes within that peak."""
    batch = make_batches(kind, 1)[0]
    make = (lambda: GPT(gpt_config("gpt-tiny"))) if kind == "gpt" else (lambda: BertMLM(bert_config("bert-tiny")))
    torch.manual_seed(0)
    least = pscompile.min_device_memory(make(), batch, _config())
    slot = None
    for budget in [least, least + 100_000, 4 * least]:
        with torch.device("meta"):
            meta = make()
        report = plan(meta, batch, hardware=_machine(budget), config=_config())
        assert report.fits, report.overflow
        torch.manual_seed(0)
        engine = pscompile.compile(make(), batch, config=_config(device_memory=budget, host_memory=1 << 30))
        p = engine.schedule.plan
        assert (report.h2d_bytes, report.d2h_bytes, report.peak_device_bytes, report.chunk_size) == \
            (p.h2d_bytes, p.d2h_bytes, p.peak_device_bytes, engine.layout.chunk_size)
        engine.step(batch)
        s = engine.stats
        assert (s.chunk_h2d_bytes, s.chunk_d2h_bytes) == (report.h2d_bytes, report.d2h_bytes)
        assert s.peak_device_bytes <= report.peak_device_bytes <= budget
        slot = slot or p.h2d_bytes
        engine.close()
    assert slot, "no budget made the plan move chunks: the sweep proves nothing"


def test_a_model_that_does_not_fit_says_where_and_by_how_much():
    torch.manual_seed(0)
    batch = (2, 64)
    fits = plan(TINY, batch, hardware=_machine(8 << 20), config=_config())
    assert fits.fits and fits.overflow == "" and fits.iteration_s > 0
    small = plan(TINY, batch, hardware=_machine(100_000), config=_config())
    assert not small.fits and small.overflow.startswith("GPU memory")
    assert small.min_device_memory and small.min_device_memory > 100_000
    again = plan(TINY, batch, hardware=_machine(small.min_device_memory), config=_config())
    assert again.fits, "the least GPU memory the report names does not fit"
    host = plan(TINY, batch, hardware=_machine(8 << 20, cpu=100_000), config=_config())
    assert host.fits, host.overflow            # what the host cannot hold is homed on the GPU, as the engine does
    neither = plan(TINY, batch, hardware=_machine(1_000_000, cpu=100_000), config=_config())
    assert not neither.fits and "GPU memory" in neither.overflow
    disk = plan(TINY, batch, hardware=_machine(8 << 20, cpu=1_600_000, disk=1 << 30), config=_config())
    assert disk.fits and disk.disk_model_bytes > 0


def test_the_disk_tier_is_planned_as_the_engine_places_and_moves_it(tmp_path):
    """The planner puts the same optimizer states on disk as the engine does at the same host
    budget, its disk bytes per iteration are what the engine's step reads and writes, and their
    time at the disk's bandwidth bounds the optimizer's (it runs behind the host updates)."""
    torch.manual_seed(0)
    model = GPT(TINY)
    batch = (torch.randint(0, 256, (2, 64)), torch.randint(0, 256, (2, 64)))
    slow = _machine(8 << 20, cpu=1_600_000, disk=1 << 30, disk_bandwidth=1e5)
    report = plan(model, batch, hardware=slow, config=_config())
    assert report.fits and report.disk_io_bytes == 2 * report.disk_model_bytes > 0
    assert report.disk_s == pytest.approx(report.disk_io_bytes / 1e5)
    assert report.optimizer_s >= report.disk_s and "disk per iteration" in report.format()
    fast = plan(model, batch, hardware=dataclasses.replace(slow, disk_bandwidth=1e12), config=_config())
    assert fast.optimizer_s < report.optimizer_s, "the disk's time did not reach the estimate"
    engine = pscompile.compile(model, batch, config=_config(device_memory=8 << 20, host_memory=slow.host_budget,
                                                            chunk_size=report.chunk_size, disk_dir=str(tmp_path)))
    assert engine.store.disk_model_bytes() == report.disk_model_bytes
    engine.step(batch)
    assert (engine.stats.disk_read_bytes, engine.stats.disk_write_bytes) == (report.disk_model_bytes,) * 2
    engine.close()


def test_parameters_on_disk_are_planned_as_the_engine_places_and_moves_them(tmp_path):
    """A host too small for the compute-dtype chunks: the planner puts the same parameters and
    states on disk as the engine, and the engine's disk bytes per step stay within the planned
    volume (its staging cache only saves reads and writes) and above one pass over them."""
    torch.manual_seed(0)
    model = GPT(TINY)
    batch = (torch.randint(0, 256, (2, 64)), torch.randint(0, 256, (2, 64)))
    machine = _machine(1 << 20, cpu=600_000, disk=1 << 30, disk_bandwidth=1e6)      # chunks move too
    report = plan(model, batch, hardware=machine, config=_config(chunk_size=8192))
    assert report.fits and report.param_disk_bytes > 0, report.format()
    assert "of it parameters" in report.format() and "behind the forward, backward" in report.format()
    assert report.iteration_s >= report.disk_s == pytest.approx(report.disk_io_bytes / 1e6)
    engine = pscompile.compile(model, batch, config=_config(device_memory=1 << 20, host_memory=machine.host_budget,
                                                            chunk_size=8192, disk_dir=str(tmp_path)))
    assert engine.param_disk_chunks and engine.store.disk_model_bytes() == report.disk_model_bytes
    once = report.disk_model_bytes
    for _ in range(2):
        engine.step(batch)
        s = engine.stats
        assert once <= s.disk_read_bytes and once <= s.disk_write_bytes
        assert s.disk_read_bytes + s.disk_write_bytes <= report.disk_io_bytes
        assert (s.chunk_h2d_bytes, s.chunk_d2h_bytes) == (report.h2d_bytes, report.d2h_bytes) != (0, 0)
    engine.close()
    zero = plan(model, batch, hardware=dataclasses.replace(machine, gpus=2, cpu_memory=1_200_000),
                config=_config(chunk_size=8192))
    assert not zero.fits and "parameters on disk need one GPU" in zero.overflow
    # no disk under ZeRO: what each GPU's host share cannot hold is homed on that GPU, as the engine does
    gpus = dataclasses.replace(machine, gpus=2, gpu_memory=(8 << 20) + 1, disk=None)
    homes = plan(model, batch, hardware=dataclasses.replace(gpus, cpu_memory=1_200_000), config=_config(chunk_size=8192))
    roomy = plan(model, batch, hardware=dataclasses.replace(gpus, cpu_memory=1 << 30), config=_config(chunk_size=8192))
    assert homes.fits and roomy.fits, homes.overflow
    assert homes.device_model_bytes > roomy.device_model_bytes and homes.host_model_bytes < roomy.host_model_bytes


def test_the_static_partition_needs_every_parameter_on_the_gpu():
    report = plan(TINY, (2, 64), hardware=_machine(8 << 20), config=_config())
    n, need = report.params, report.baseline_device_bytes
    assert report.baseline_fits and need > n * 4       # every parameter (4 bytes) and the non-model peak
    exact = plan(TINY, (2, 64), hardware=_machine(need), config=_config())
    assert exact.baseline_fits
    short = plan(TINY, (2, 64), hardware=_machine(need - 1), config=_config())
    assert short.fits and not short.baseline_fits and "GPU needs" in short.baseline_detail
    assert report.baseline_host_bytes == n * BASELINE_HOST_BYTES_PER_PARAM
    host = plan(TINY, (2, 64), hardware=_machine(8 << 20, cpu=n * BASELINE_HOST_BYTES_PER_PARAM - 1), config=_config())
    assert not host.baseline_fits and "CPU needs" in host.baseline_detail


def test_search_finds_the_largest_depth_that_fits():
    hw = _machine(1_000_000)
    res = search(TINY, (2, 64), dimension="depth", hardware=hw, config=_config(), upper=8)
    assert res.value >= 1 and res.report.fits
    assert not plan(dataclasses.replace(TINY, n_layer=res.value + 1), (2, 64), hardware=hw, config=_config()).fits
    batch = search(TINY, (1, 64), dimension="batch", hardware=hw, config=_config(), upper=8)
    assert batch.value >= 1
    assert not plan(TINY, (batch.value + 1, 64), hardware=hw, config=_config()).fits


def test_the_cost_model_charges_what_the_schedule_moves():
    """A slower link costs at least its bytes' time; a link too fast to matter leaves compute."""
    batch = make_batches("gpt", 1)[0]
    torch.manual_seed(0)
    least = pscompile.min_device_memory(GPT(gpt_config("gpt-tiny")), batch, _config())
    with torch.device("meta"):
        meta = GPT(gpt_config("gpt-tiny"))
    _, sched = schedule_model(meta, batch, _config(device_memory=least))
    p = sched.plan
    assert p.h2d_bytes > 0
    fast = estimate(sched, dataclasses.replace(_machine(least), pcie=1e18), model_flops=1, host_params=0,
                    device_params=0)
    assert fast.forward_backward_s == pytest.approx(fast.compute_s, rel=1e-6)
    slow_hw = dataclasses.replace(_machine(least), pcie=1e6)
    slow = estimate(sched, slow_hw, model_flops=1, host_params=0, device_params=0)
    assert slow.forward_backward_s >= max(p.h2d_bytes, p.d2h_bytes) / 1e6
    assert slow.forward_backward_s <= fast.compute_s + (p.h2d_bytes + p.d2h_bytes) / 1e6 + 1e-9


def test_the_steady_state_charges_the_chunks_fetched_ahead_once():
    """A step that fetches the next one's first chunks after their update, and starts with them in
    flight (one GPU, float32): walking it, the host->device engine carries exactly the bytes the
    plan counts (its own fetches and those ahead), each once; with loss scaling (float16) there
    is no such step and the two estimates are one."""
    from pscompile.graph.pipeline import PlanRequest, plan_at_budget, plan_inputs
    batch = make_batches("gpt", 1)[0]
    torch.manual_seed(0)
    least = pscompile.min_device_memory(GPT(gpt_config("gpt-tiny")), batch, _config())
    budget = int(least * 1.25)
    with torch.device("meta"):
        meta = GPT(gpt_config("gpt-tiny"))
    layout, analyzed = plan_inputs(meta, batch, _config(device_memory=budget))
    request = PlanRequest(budget, torch.float32, activations="recompute", lookahead=True, plan_only=True)
    first = plan_at_budget(analyzed, layout, request)
    assert first.lookahead is not None and first.lookahead.fetches, "no chunk fetched ahead: proves nothing"
    steady = plan_at_budget(analyzed, layout, dataclasses.replace(request, start=dict(first.lookahead.fetches)))
    hw = dataclasses.replace(_machine(budget), pcie=1e6)
    cost = estimate(steady, hw, model_flops=1, host_params=layout.total_numel, device_params=0)
    assert cost.h2d_s * 1e6 == pytest.approx(steady.plan.h2d_bytes, rel=1e-9)
    assert cost.forward_backward_s >= cost.compute_s > 0
    report = plan(TINY, (2, 64), hardware=_machine(8 << 20), config=_config())
    assert report.first_iteration_s > 0 and report.iteration_s > 0
    half = plan(TINY, (2, 64), hardware=_machine(8 << 20), config=dataclasses.replace(_config(), dtype=torch.float16))
    assert half.iteration_s == half.first_iteration_s


def test_plan_command_prints_the_report(capsys):
    rc = cli_main(["plan", "--d-model", "64", "--n-layer", "2", "--n-head", "2", "--vocab-size", "256", "--seq-len", "64",
                   "--batch-size", "2", "--hardware", "pc700", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert rc == 0 and "fits" in out and "static partition" in out and "TFLOP/s per GPU" in out
    assert "GPT d64 L2 h2 vocab 256" in out and "batch 2 x 64" in out
    # the flags' old names still work, each with a note naming its new one
    rc = cli_main(["plan", "--hidden", "64", "--layers", "2", "--heads", "2", "--vocab", "256", "--seq", "64",
                   "--batch", "2", "--gpu-memory", "1.0001GiB", "--dtype", "float32"])
    captured = capsys.readouterr()
    assert rc == 0 and "NO: GPU memory" in captured.out and "GPT d64 L2 h2 vocab 256" in captured.out
    for old, new in [("--hidden", "--d-model"), ("--layers", "--n-layer"), ("--heads", "--n-head"),
                     ("--vocab", "--vocab-size"), ("--seq", "--seq-len"), ("--batch", "--batch-size")]:
        assert f"{old} is deprecated, use {new}" in captured.err


# PatrickStar Table 3: the chunk utilisation the paper reports for each model (percent)
TABLE3 = {"10b": 94.47, "15b": 92.62, "18b": 91.5, "20b": 90.5, "40b": 90.6, "60b": 92.2, "68b": 97.4}


@pytest.mark.parametrize("model", sorted(TABLE3))
def test_table3_utilisation_is_at_least_the_papers(model):
    """compiled mode's "auto" layout on the paper's machine (YARD or SuperPod budget), for the
    paper's GPT shapes: at least the utilisation PatrickStar's chunk-size search reports."""
    shapes = gpt_config(f"ps-{model}").param_shapes()
    numels = [int(torch.Size(s).numel()) for _, s in shapes]
    budget = pscompile.planner.hardware_preset("yard" if model in ("10b", "15b", "18b") else "superpod").device_budget
    cs = search_chunk_size(numels, max_chunk_size=budget // (2 * 8)).chunk_size
    assert 100 * build_layout(shapes, cs).utilisation >= TABLE3[model]
