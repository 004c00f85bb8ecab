"""The host AdamW kernels (optim/host_kernel.py: the C++ one and the Inductor one): the same update
as torch's fused AdamW on the same numbers, for every gradient/param dtype pair and thread count,
gradless ranges and padding kept; the two kernels bit for bit alike; and an engine that uses them
tracks plain PyTorch."""

import threading

import pytest
import torch

import pscompile
from conftest import fresh_masters, run_parity, tracking_tol, worst_tracking
from pscompile.config import AdamW
from pscompile.optim.adamw import ChunkAdamW
from pscompile.optim.host_kernel import HostKernels
from pscompile.optim.native_kernel import unavailable_reason

NATIVE = unavailable_reason()
KERNELS = ["inductor", pytest.param("native", marks=pytest.mark.skipif(NATIVE is not None, reason=str(NATIVE)))]

HP = AdamW(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
N = 4096 + 64          # a chunk; the last 64 elements are padding


def _chunks(seed: int):
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(N, generator=g)
    master[-64:] = 0
    return master, torch.zeros(N), torch.zeros(N)


def _grads(dtype: torch.dtype, step: int) -> torch.Tensor:
    g = torch.randn(N, generator=torch.Generator().manual_seed(100 + step)) * 1e-2
    g[-64:] = 0
    return g.to(dtype)


# (param dtype, where the gradient is): "param" (it overwrote the param chunk), "acc" (an fp32
# accumulation buffer, the params kept), "shared" (fp32: the master is the param chunk)
CASES = [(torch.bfloat16, "param"), (torch.float16, "param"), (torch.bfloat16, "acc"), (torch.float32, "shared"),
         (torch.float32, "param")]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype,where", CASES, ids=[f"{str(d)[6:]}-{w}" for d, w in CASES])
def test_kernel_matches_fused_adamw(dtype, where, kernel):
    """Three steps with a loss-scale factor and gradless ranges, against ChunkAdamW's eager path
    (``torch._fused_adamw_``, checked against torch.optim.AdamW in test_optimizer.py)."""
    runs = []
    for kernels in (None, HostKernels(kernel)):
        adam = ChunkAdamW(HP, kernels=kernels)
        master, ea, eas = _chunks(0)
        param = None if where == "shared" else master.to(dtype, copy=True)
        for step in range(3):
            grad = _grads(torch.float32 if where != "param" else dtype, step)
            if where == "param":
                param.copy_(grad)
            adam.begin_step()
            adam.update_chunk(param, master, ea, eas, grad_factor=0.5, gradless=[(100, 30), (2000, 7)],
                              grad=None if where == "param" else grad)
            if param is not None:
                assert torch.equal(param, master.to(dtype))      # every element: its master's cast
        runs.append((master, ea, eas))
    master0 = _chunks(0)[0]
    for ours, ref in zip(runs[1], runs[0]):
        torch.testing.assert_close(ours, ref, rtol=2e-6, atol=1e-7)
    ours = runs[1][0]
    assert torch.equal(ours[100:130], master0[100:130]) and torch.equal(ours[2000:2007], master0[2000:2007])
    assert torch.count_nonzero(torch.cat([t[-64:] for t in runs[1]])) == 0     # padding stays zero
    assert not torch.equal(ours[:100], master0[:100])


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_thread_counts_agree(kernel):
    """One and two OpenMP threads: the same bits (the kernel is elementwise). The C++ kernel gets
    a chunk of several of its parallel blocks (16Ki elements) and a tail."""
    outs = []
    for threads in (1, 2):
        adam = ChunkAdamW(HP, kernels=HostKernels(kernel, threads=threads))
        master, ea, eas = _chunks(1)
        param = _grads(torch.bfloat16, 0)
        if kernel == "native":
            master, ea, eas = (torch.cat([t] * 13)[:-5] for t in (master, ea, eas))
            param = torch.cat([param] * 13)[:-5]
        adam.begin_step()
        adam.update_chunk(param, master, ea, eas, grad_factor=1.0, gradless=[])
        outs.append((param, master, ea, eas))
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_the_kernel_runs_where_it_saves_a_pass():
    """"auto": chunks of 1M+ elements only; the Inductor kernel never for an fp32 gradient into a
    master that is the param chunk with no factor (torch's fused kernel is one pass already, and
    faster than it), the C++ kernel there too (faster than torch's)."""
    big, small = torch.empty(1 << 20), torch.empty(4096)
    bf = torch.empty(1 << 20, dtype=torch.bfloat16)
    auto = HostKernels("auto")
    assert auto.wanted(big, bf, bf, 1.0) and not auto.wanted(small, bf[:4096], bf[:4096], 1.0)
    assert auto.wanted(big, big, None, 0.5)
    assert auto.wanted(big, big, None, 1.0) == (NATIVE is None)
    assert not HostKernels("eager").wanted(big, bf, bf, 1.0)
    inductor = HostKernels("inductor")
    assert inductor.wanted(small, small, small, 1.0) and not inductor.wanted(big, big, None, 1.0)


def test_bad_kernel_choices_are_refused():
    with pytest.raises(ValueError, match="optimizer_kernel="):
        pscompile.Config(device="cpu", optimizer_kernel="avx")
    with pytest.raises(ValueError, match="optimizer_threads="):
        pscompile.Config(device="cpu", optimizer_threads=0)


@pytest.mark.parametrize("kernel", KERNELS)
def test_engine_with_the_kernel_tracks_plain_pytorch(tight_budget, kernel):
    """bf16 under a budget that forces eviction: every chunk updated by the kernel."""
    dtype = torch.bfloat16
    ref_l, ours_l, _, engine, ref = run_parity("gpt", dtype, steps=6, device_memory=tight_budget("gpt", dtype),
                                               config_kw=dict(optimizer_kernel=kernel))
    assert {k[0] for k in engine.adam.kernels.used} == {kernel}           # the kernel ran
    worst, name = worst_tracking(engine, ref, fresh_masters("gpt", dtype))
    assert worst < tracking_tol(dtype), (worst, name)
    for a, b in zip(ref_l, ours_l):
        assert abs(a - b) < 2e-2 * abs(a)


@pytest.mark.parametrize("kernel", KERNELS)
def test_out_of_place_kernel_equals_in_place(kernel):
    """``update_chunk_out`` (an update in the backward, on a thread: a kernel that lets go of the
    GIL) writes the same bits into the spare buffers as ``update_chunk`` does in place, and
    leaves what it read as it was."""
    adam_in, adam_out = (ChunkAdamW(HP, kernels=HostKernels(kernel)) for _ in range(2))
    master, ea, eas = _chunks(2)
    ea.normal_().abs_().mul_(1e-3)
    eas.normal_().abs_().mul_(1e-6)
    grad = _grads(torch.bfloat16, 0)
    before = [t.clone() for t in (grad, master, ea, eas)]
    spares = tuple(torch.empty(N) for _ in range(3))
    param_out = torch.empty(N, dtype=torch.bfloat16)
    for adam in (adam_in, adam_out):
        adam.begin_step()
    adam_out.update_chunk_out(param_out, master, ea, eas, spares, grad=grad, grad_factor=0.5, gradless=[(100, 30)])
    assert all(torch.equal(a, b) for a, b in zip((grad, master, ea, eas), before))
    param = grad.clone()
    adam_in.update_chunk(param, master, ea, eas, grad_factor=0.5, gradless=[(100, 30)])
    assert torch.equal(param_out, param)
    assert all(torch.equal(a, b) for a, b in zip(spares, (master, ea, eas)))
    assert (kernel, "out_to", torch.bfloat16, torch.bfloat16) in adam_out.kernels.used
    if kernel == "inductor":                                       # compiled with the C++ wrapper
        assert any(k[0] == "out_to" and k[-1] for k in adam_out.kernels._compiled)


def test_a_background_update_beside_a_main_thread_one_keeps_its_bits():
    """An early update (``background``) runs on its thread while the main thread updates another
    chunk, both on the eager 16-bit path, whose fp32 block buffer each must have to itself."""
    n = 1 << 20
    g = torch.Generator().manual_seed(5)
    base = [(torch.randn(n, generator=g) * 1e-2).bfloat16() for _ in range(2)], [torch.randn(n, generator=g) for _ in range(2)]

    def run(together: bool):
        adam = ChunkAdamW(HP)
        adam.begin_step()
        params = [p.clone() for p in base[0]]
        masters = [m.clone() for m in base[1]]
        states = [(torch.zeros(n), torch.zeros(n)) for _ in range(2)]

        def one(i: int, background: bool):
            for _ in range(3):
                adam.update_chunk(params[i], masters[i], *states[i], grad_factor=1.0, gradless=[], background=background)
        if together:
            t = threading.Thread(target=one, args=(1, True))
            t.start()
            one(0, False)
            t.join()
        else:
            one(0, False)
            one(1, True)
        return params + masters
    alone = run(False)
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(run(True), alone))
