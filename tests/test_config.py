"""Config and AdamW validate their fields and name them in the error; a Config is plain data that
``pscompile.resolve`` (what every engine does when it is built) makes into the machine's record."""

import dataclasses

import pytest
import torch

import pscompile
from pscompile.units import format_bytes, parse_rate, parse_size


@pytest.mark.parametrize("kwargs,field", [
    (dict(device="tpu"), "device"),
    (dict(device_memory="lots"), "device_memory"),
    (dict(device_memory=-5), "device_memory"),
    (dict(device_memory=0), "device_memory"),
    (dict(host_memory="1XB"), "host_memory"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(chunk_size="big"), "chunk_size"),
    (dict(dtype=torch.int8), "dtype"),
    (dict(mode="jit"), "mode"),
    (dict(backend="tvm"), "backend"),
    (dict(device="cpu", link_bandwidth="fast"), "link_bandwidth"),
    (dict(initial_loss_scale=0), "initial_loss_scale"),
    (dict(process_group="world"), "process_group"),
    (dict(collectives="ring"), "collectives"),
    (dict(planner="lru"), "planner"),
    (dict(planner="angel", mode="hooks"), "planner"),
    (dict(pinned_host="no"), "pinned_host"),
])
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        pscompile.Config(**kwargs)


@pytest.mark.parametrize("kwargs,field", [
    (dict(lr=-1), "lr"), (dict(betas=(0.9,)), "betas"), (dict(betas=(0.9, 1.0)), "betas"),
    (dict(eps=-1), "eps"), (dict(weight_decay=-0.1), "weight_decay"), (dict(max_grad_norm=0), "max_grad_norm"),
])
def test_adamw_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        pscompile.AdamW(**kwargs)


def test_a_config_holds_what_was_given_and_resolves_to_bytes_and_members():
    c = pscompile.Config(device="cpu", device_memory="96MiB", host_memory="2GB", link_bandwidth="50MB/s")
    assert (c.device_memory, c.host_memory, c.link_bandwidth) == ("96MiB", "2GB", "50MB/s")   # as given
    r = pscompile.resolve(c)
    assert r.device_memory == 96 * 2**20 and r.host_memory == 2 * 10**9 and r.link_bandwidth == 50e6
    assert isinstance(r, pscompile.Config) and pscompile.resolve(r) is r
    with pytest.raises(Exception):
        c.device_memory = 5
    with pytest.raises(ValueError, match=r"ResolvedConfig.device_memory='1GiB' is not resolved"):
        dataclasses.replace(r, device_memory="1GiB")
    assert parse_size(1024, "x") == 1024 and parse_size("1.5KiB", "x") == 1536
    assert parse_rate("1GB/s", "x") == 1e9
    assert format_bytes(1536) == "1.5 KiB" and format_bytes(12) == "12 B"


def test_compile_rejects_wrong_argument_types():
    m = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="optimizer"):
        pscompile.compile(m, (torch.randn(1, 2),), optimizer=torch.optim.SGD(m.parameters(), lr=1))
    with pytest.raises(ValueError, match="nn.Module"):
        pscompile.compile(lambda x: x, (torch.randn(1, 2),))


def test_link_preset_is_calibrated_to_this_machine(monkeypatch):
    """link_bandwidth="v100": the emulated link is as slow, relative to this machine's measured
    fp32 matmul rate, as a V100's PCIe 3 link is to a V100 (7,000 FLOP per byte); an unknown name
    is refused with the presets listed. The rate is measured (a positive number here); the
    division is checked against a rate fixed by the test, since two timings on a busy machine
    need not agree."""
    from pscompile.memory import rates
    c = pscompile.Config(device="cpu", dtype=torch.float32, link_bandwidth="V100")
    r = pscompile.resolve(c).link_bandwidth
    assert isinstance(r, float) and 0 < r < float("inf")
    assert rates.LINK_PRESETS["v100"][1] == 7000.0
    monkeypatch.setattr(rates, "measure_rates", lambda *a, **k: rates.Rates(flops_per_s=7e10, link_bytes_per_s=1.0))
    assert pscompile.resolve(c).link_bandwidth == 1e7
    with pytest.raises(ValueError, match="v100"):
        pscompile.Config(device="cpu", link_bandwidth="v200")


def test_building_a_config_measures_nothing_and_asks_no_device(monkeypatch):
    """A preset is calibrated, CUDA looked for and the device index asked for when the Config is
    resolved (an engine being built), never when it is made: a Config for a GPU can be written on a
    machine without one, and is refused, naming the field, when an engine would run it there."""
    from pscompile.memory import rates

    def never(*a, **k):
        raise AssertionError("measured or asked at construction")
    monkeypatch.setattr(rates, "measure_rates", never)
    monkeypatch.setattr(torch.cuda, "is_available", never)
    monkeypatch.setattr(torch.cuda, "current_device", never)
    pscompile.Config(device="cpu", link_bandwidth="a100")
    gpu = pscompile.Config(device="cuda:0", dtype=torch.float32)
    pscompile.Config()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device='cuda:0' but CUDA is not available on this machine"):
        pscompile.resolve(gpu)
    with pytest.raises(ValueError, match=r"device='cuda:0' but CUDA is not available"):
        pscompile.compile(torch.nn.Linear(2, 2), (torch.randn(1, 2),), config=gpu)
    assert pscompile.resolve(pscompile.Config()).device == "cpu"      # None: CUDA where there is one


def test_choices_are_enums_given_as_members_or_names():
    """Config holds every choice as its pscompile enum member, whether given the member or its name;
    the members compare equal to their names and print as them."""
    a = pscompile.Config(device="cpu", mode="hooks", backend="eager", collectives="per_chunk")
    b = pscompile.Config(device="cpu", mode=pscompile.Mode.HOOKS, backend=pscompile.Backend.EAGER,
                         collectives=pscompile.Collectives.PER_CHUNK)
    assert a == b and a.mode == "hooks"          # (a Config holds what was given: the name, or the member)
    a = pscompile.resolve(a)
    assert a == pscompile.resolve(b) and a.mode is pscompile.Mode.HOOKS and a.backend is pscompile.Backend.EAGER
    assert a.planner is pscompile.Policy.BELADY and a.activations is pscompile.Activations.AUTO
    assert a.mode == "hooks" and f"{a.mode}" == "hooks" and str(a.collectives) == "per_chunk"
    with pytest.raises(ValueError, match=r"activations='sometimes' is not a policy; use one of \('auto', 'keep'"):
        pscompile.Config(device="cpu", activations="sometimes")


@pytest.mark.parametrize("mode", ["hooks", "compiled"])
def test_a_device_named_with_an_index_trains_like_plain_pytorch(mode):
    """``cpu:0`` names the device CPU tensors call ``cpu`` (and ``cuda`` the one they call
    ``cuda:0``): the engine compares tensors' devices with its own, so Config names the device as
    the tensors do. Before, hooks mode kept the parameters' placeholder (NaN) for backward on such
    a device -- the first GPU run's hooks failure, reproduced on the CPU."""
    from conftest import make_batches, make_model
    from pscompile.testing import ReferenceTrainer
    assert pscompile.resolve(pscompile.Config(device="cpu:0")).device == "cpu"
    if torch.cuda.is_available():
        assert pscompile.resolve(pscompile.Config(device="cuda")).device == f"cuda:{torch.cuda.current_device()}"
    batches = make_batches("gpt", 3)
    hp = pscompile.AdamW(lr=1e-3)
    config = pscompile.Config(mode=mode, device="cpu:0", dtype=torch.float32, backend="eager", chunk_size=2048)
    budget = pscompile.min_device_memory(make_model("gpt"), batches[0], config) + 2 * 2048 * 4   # evicts
    ref = ReferenceTrainer(make_model("gpt"), optimizer=hp, dtype=torch.float32)
    engine = pscompile.compile(make_model("gpt"), batches[0], optimizer=hp,
                               config=dataclasses.replace(config, device_memory=budget))
    for b in batches:
        ours, plain = engine.step(b), ref.step(b)
        assert abs(ours - plain) <= 1e-5 * abs(plain)
        assert engine.stats.num_evictions > 0 and engine.stats.peak_device_bytes <= budget
