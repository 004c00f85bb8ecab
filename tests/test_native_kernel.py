"""The C++ host AdamW kernel (optim/native_kernel.py, optim/host_adamw.cpp): bit for bit the Inductor
kernel's update in every variant, its AVX2 and AVX-512 builds alike, its 16-bit casts torch's on
every kind of number, and a clear fallback or error where it cannot be built."""

import itertools

import pytest
import torch

import pscompile
from pscompile.config import AdamW
from pscompile.optim.host_kernel import HostKernels, coefficients
from pscompile.optim.native_kernel import _cpu_flags, load, unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))

HP = AdamW(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
N = 4096 + 37                 # not a multiple of any vector width: the scalar tail runs too
VARIANTS = ["plain", "into", "to", "out", "out_to"]
GRADS = [torch.float32, torch.bfloat16, torch.float16]


def _case(gdt: torch.dtype, variant: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    grad = torch.randn(N, generator=g).to(gdt)
    master, m = torch.randn(N, generator=g), torch.randn(N, generator=g) * 1e-3
    v = torch.rand(N, generator=g) * 1e-5
    master[:40] = 0                                        # zeros: the exact path of the bf16 cast
    return grad, master, m, v


def _run(kernel, gdt, variant, coef, odt=None):
    """One update; what it wrote (states, then the cast) and whether its inputs stayed. ``odt``:
    the new params' dtype (None: the gradient's, bf16 for an fp32 gradient)."""
    grad, master, m, v = _case(gdt, variant)
    before = [t.clone() for t in (grad, master, m, v)]
    so = tuple(torch.empty(N) for _ in range(3)) if variant.startswith("out") else None
    odt = odt or (torch.bfloat16 if gdt == torch.float32 else gdt)
    out = None if variant in ("plain", "out") else grad if variant == "into" else torch.empty(N, dtype=odt)
    kernel(grad, master, m, v, coef, so, out)
    kept = so is None or all(torch.equal(a, b) for a, b in zip((grad, master, m, v), before))
    return [*(so or (master, m, v)), *(() if out is None else (out,))], kept


def _cases():
    """(grad dtype, variant, param dtype): every pair, and an fp32 param chunk apart from its master."""
    return [(g, v, None) for g, v in itertools.product(GRADS, VARIANTS) if not (v == "into" and g == torch.float32)] \
        + [(torch.float32, "to", torch.float32), (torch.float32, "out_to", torch.float32)]


@pytest.mark.parametrize("gdt,variant,odt", [(torch.bfloat16, "into", None), (torch.float16, "out_to", None),
                                             (torch.float32, "to", None), (torch.float32, "to", torch.float32)],
                         ids=["bf16-into", "fp16-out_to", "fp32-to-bf16", "fp32-to-fp32"])
def test_native_equals_inductor_bit_for_bit(gdt, variant, odt):
    """The C++ kernel writes the Inductor kernel's bits (three variants and dtypes here: an
    Inductor kernel takes seconds to compile; the others agree with these through the next test
    and test_host_kernel.py)."""
    coef = coefficients(HP, 3, 0.5)
    nat, ind = HostKernels("native"), HostKernels("inductor")
    outs = []
    for k in (nat, ind):
        out, kept = _run(lambda g, p, m, v, c, so, o, k=k: k.update(g, p, m, v, HP, c, o, so), gdt, variant, coef, odt)
        assert kept                                        # out of place: the inputs as they were
        outs.append(out)
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    assert {k[0] for k in nat.used} == {"native"} and {k[0] for k in ind.used} == {"inductor"}


@pytest.mark.skipif("avx512f" not in _cpu_flags(), reason="needs an AVX-512 CPU to build both loops")
def test_avx2_and_avx512_builds_agree(tmp_path):
    """The 8-lane (AVX2) and 16-lane (AVX-512, AVX512-BF16 cast) loops: the same bits."""
    wide = load(tmp_path)
    narrow = load(tmp_path, cpu=_cpu_flags() - {"avx512f", "avx512_bf16"})
    assert (wide.lanes, narrow.lanes) == (16, 8) and wide.path != narrow.path
    coef = coefficients(HP, 2, 1.0)
    for gdt, variant, odt in _cases():
        outs = [_run(lambda *a, k=k: k.update(*a, HP.betas, HP.eps, 1), gdt, variant, coef, odt)[0]
                for k in (wide, narrow)]
        assert all(torch.equal(a, b) for a, b in zip(*outs)), (gdt, variant)


SPECIAL = [1e-39, -2e-39, float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0,
           3.4e38, 65504.0, 65520.0, 1e-8, 6e-8, 1.00390625, 1.01171875, -1.00390625]


@pytest.mark.parametrize("lanes", [16, 8])
def test_casts_are_torchs_on_every_kind_of_number(tmp_path, lanes):
    """With lr = 0 and no decay the new master is the old one, so the cast is seen alone:
    subnormals, NaNs, infinities, signed zeros, overflow and ties (vectors mixing them take the
    exact path), then 48 normal numbers with ties (the AVX512-BF16 instruction where it is built)."""
    if lanes == 16 and "avx512f" not in _cpu_flags():
        pytest.skip("no AVX-512 here")
    k = load(tmp_path, cpu=None if lanes == 16 else _cpu_flags() - {"avx512f", "avx512_bf16"})
    g = torch.Generator().manual_seed(3)
    ties = (torch.randint(-2 ** 15, 2 ** 15, (48,), generator=g, dtype=torch.int32) * 2 ** 16 + 2 ** 15)
    values = torch.cat([torch.tensor(SPECIAL * 2), ties.view(torch.float32), torch.randn(37, generator=g)])
    n = values.numel()
    for odt in (torch.bfloat16, torch.float16):
        out, master = torch.empty(n, dtype=odt), values.clone()
        k.update(torch.zeros(n), master, torch.zeros(n), torch.zeros(n), torch.tensor([1.0, 1.0, 0.0, 1.0]),
                 None, out, HP.betas, HP.eps, 1)
        assert torch.equal(out.view(torch.int16), values.to(odt).view(torch.int16)), odt


def test_a_missing_compiler_falls_back_or_is_named(monkeypatch):
    """No compiler: "auto" uses the Inductor kernel and says why; "native" is refused up front,
    naming the field and what to use."""
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert "no-such-compiler-here" in unavailable_reason()
    auto = HostKernels("auto")
    grad, master, m, v = _case(torch.bfloat16, "into")
    auto.update(grad, master, m, v, HP, coefficients(HP, 1, 1.0), grad)
    assert {k[0] for k in auto.used} == {"inductor"} and "no-such-compiler-here" in auto.native_unavailable
    with pytest.raises(ValueError, match="optimizer_kernel='native' cannot run here.*'inductor'"):
        HostKernels("native")
    pscompile.Config(device="cpu", optimizer_kernel="native")        # (the choice itself is valid)


def test_a_failed_build_is_reported_and_leaves_no_file(monkeypatch, tmp_path):
    """A compiler that fails: the error says so; nothing half-written is left to load later."""
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(RuntimeError, match="failed to build host_adamw.cpp"):
        load(tmp_path)
    assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob("*.tmp"))
