"""Shared builders for the tests: tiny models, deterministic batches, parity runs."""

from __future__ import annotations

import os

# The race checker (docs/design.md, "The copy contract"): every test, and every process a test
# starts, runs with each copy landing at the latest moment its contract allows. Tests that measure
# overlap are marked ``copy_threads`` and run the CPU's copy threads; PSCOMPILE_STRICT_COPIES=0 in
# the caller's environment runs the whole suite on them.
os.environ.setdefault("PSCOMPILE_STRICT_COPIES", "1")

# The key that tags a checkpoint's measurements (pscompile/compiled/trust.py): one per user of the
# suite, outside the home folder, shared by the workers and the processes the tests start.
os.environ.setdefault("PSCOMPILE_KEY_FILE", os.path.join(
    __import__("tempfile").gettempdir(), f"pscompile-tests-{os.getuid()}", "measurements.key"))

if os.environ.get("PYTEST_XDIST_WORKER"):   # tests run in parallel workers (pyproject.toml: -n): one thread
    os.environ["OMP_NUM_THREADS"] = "1"     # each, for the processes the tests start too
    # and Inductor compiles in the worker itself, not in a pool of compile processes of its own
    # (each worker, and each process a test starts, would start one: ~10% of the cold compile time)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import socket

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

import pscompile
from pscompile.models.bert import BertMLM, bert_config, mask_tokens
from pscompile.models.gpt import GPT, gpt_config
from pscompile.testing import ReferenceTrainer


@pytest.fixture(autouse=True)
def _copy_engine(request, monkeypatch):
    """A test marked ``copy_threads`` (it measures how copies overlap compute) runs the copy threads."""
    if request.node.get_closest_marker("copy_threads") is not None:
        monkeypatch.setenv("PSCOMPILE_STRICT_COPIES", "0")


@pytest.fixture
def uninitialized_is_nan():
    """Every buffer the test allocates without writing it holds NaN (torch's deterministic mode
    fills uninitialized memory; both settings restored after): a read before the first write shows
    as NaN, not as whatever the allocator happened to leave there (often zeros, so it passes)."""
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def free_port() -> int:
    """A port no one listens on now, for a process group's rendezvous (test files run side by side,
    so torchrun's fixed default port would be taken)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpt_batches(n: int, *, batch: int = 4, seq: int = 64, vocab: int = 256, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch, seq), generator=g),
             torch.randint(0, vocab, (batch, seq), generator=g)) for _ in range(n)]


def bert_batches(n: int, *, batch: int = 4, seq: int = 64, vocab: int = 256, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab - 1, (batch, seq), generator=g)
        masked, labels = mask_tokens(ids, vocab, generator=g)
        out.append({"input_ids": masked, "labels": labels})
    return out


def make_model(kind: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    if kind == "gpt":
        return GPT(gpt_config("gpt-tiny", **overrides))
    if kind == "bert":
        return BertMLM(bert_config("bert-tiny", **overrides))
    raise AssertionError(kind)


def make_batches(kind: str, n: int, *, distinct: int = 2, **kw):
    """``n`` batches cycling through ``distinct`` different ones (so a tiny model can learn them)."""
    pool = gpt_batches(distinct, **kw) if kind == "gpt" else bert_batches(distinct, **kw)
    return [pool[i % distinct] for i in range(n)]


def run_parity(kind: str, dtype: torch.dtype, *, steps: int, device_memory=None, chunk_size=2048,
               hp: pscompile.AdamW | None = None, overrides=None, config_kw: dict | None = None):
    """Train the same model with plain PyTorch and with hooks mode, step by step, same seeds
    (``config_kw``: more ``Config`` fields).

    Returns (reference losses, engine losses, per-step stats, engine, reference)."""
    overrides = overrides or {}
    hp = hp or pscompile.AdamW(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    batches = make_batches(kind, steps)
    ref = ReferenceTrainer(make_model(kind, **overrides), optimizer=hp, dtype=dtype)
    engine = pscompile.compile(
        make_model(kind, **overrides), batches[0], optimizer=hp,
        config=pscompile.Config(mode="hooks", device="cpu", dtype=dtype, device_memory=device_memory,
                                chunk_size=chunk_size, **(config_kw or {})))
    ref_losses, eng_losses, stats = [], [], []
    for i, b in enumerate(batches):
        torch.manual_seed(100 + i)
        ref_losses.append(ref.step(b))
        torch.manual_seed(100 + i)
        eng_losses.append(engine.step(b))
        stats.append(engine.stats)
    return ref_losses, eng_losses, stats, engine, ref


def max_weight_diff(engine, ref) -> float:
    ours = engine.state_dict()["master"]
    theirs = ref.master_state()
    assert set(ours) == set(theirs)
    return max((ours[k] - theirs[k]).abs().max().item() for k in theirs)


@pytest.fixture
def tight_budget():
    """A device budget that forces evictions every step: the model's minimum plus two chunks."""
    def compute(kind: str, dtype: torch.dtype, chunk_size: int = 2048, **overrides) -> int:
        key = (kind, dtype, chunk_size, tuple(sorted(overrides.items())))
        if key not in _TIGHT:                # the same model gives the same minimum: computed once per run
            engine = pscompile.compile(
                make_model(kind, **overrides), make_batches(kind, 1)[0],
                config=pscompile.Config(mode="hooks", device="cpu", dtype=dtype, chunk_size=chunk_size))
            elsize = torch.empty((), dtype=dtype).element_size()
            _TIGHT[key] = engine.min_device_memory + 2 * chunk_size * elsize
        return _TIGHT[key]
    return compute


_TIGHT: dict[tuple, int] = {}


def initial_masters(ref) -> dict[str, torch.Tensor]:
    """The reference's fp32 masters before training (a copy), for ``worst_tracking``."""
    return {k: v.clone() for k, v in ref.master_state().items()}


def fresh_masters(kind: str, dtype: torch.dtype, **overrides) -> dict[str, torch.Tensor]:
    """The fp32 masters every run of ``make_model(kind)`` starts from (models are seeded)."""
    return initial_masters(ReferenceTrainer(make_model(kind, **overrides), optimizer=pscompile.AdamW(), dtype=dtype))


# Each tensor's error against plain PyTorch, in units of how far plain PyTorch moved it
# (``worst_tracking``): measured far below 1e-3 with the eager backend and hooks mode; a chunk never
# updated scores 1. Inductor's bf16 kernels round differently from eager's (fp32 inside fused
# kernels): attention biases whose true gradient is zero then drift by Adam-sized noise, measured
# up to 0.18, so that case is held to TRACKING_TOL_INDUCTOR_BF16.
# Gradient accumulation in bf16: plain PyTorch sums the micro-batches' gradients in bf16, pscompile
# in fp32 (a decision: 3.6e-3 vs 7.4e-10 relative error over 8 micro-batches), measured 0.13.
TRACKING_TOL = 1e-2
TRACKING_TOL_INDUCTOR_BF16 = 0.5
# On an AMD EPYC, without AVX512 (torch.backends.cpu.get_cpu_capability() == "AVX2") and with it
# (torch 2.13 reports "AVX512"), torch's eager bf16 kernels round the same way in hooks and compiled
# mode (bit for bit) but differently from plain PyTorch's autograd, from the third step on: the
# attention key biases (true gradient zero) drift by Adam-sized noise there too, measured 0.02-0.16
# (with one thread and with two). Only on Intel CPUs with AVX512 has bf16 held to TRACKING_TOL.
def _intel() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "GenuineIntel" in f.read(4096)
    except OSError:
        return False


AVX512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512") and _intel()


def tracking_tol(dtype: torch.dtype) -> float:
    """The tracking tolerance of an eager run in ``dtype`` on this CPU (see AVX512 above)."""
    return TRACKING_TOL if dtype == torch.float32 or AVX512 else TRACKING_TOL_INDUCTOR_BF16
TRACKING_TOL_BF16_ACCUMULATION = 0.5


def worst_tracking(engine, ref, initial: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Each tensor's error against plain PyTorch measured in units of how far plain PyTorch moved
    it from its initial value: mean |ours - theirs| / mean |theirs - initial| (at least 1e-5: a
    tensor whose true gradient is zero, like an attention key bias, barely moves and is held to
    an absolute 1e-7 at the default tolerance). Means, not maxima: Adam moves every element by about
    the learning rate whatever its gradient, so an element whose gradient is noise can differ by a
    whole step while the tensor agrees. A tensor or chunk that was never updated scores 1 whatever
    the learning rate, so a tolerance well below 1 catches it in bf16 too, where an absolute
    tolerance cannot. Returns (worst ratio, its name)."""
    return tracking_of(engine.state_dict()["master"], ref, initial)


def tracking_of(ours: dict[str, torch.Tensor], ref, initial: dict[str, torch.Tensor]) -> tuple[float, str]:
    """``worst_tracking`` of fp32 masters given as a dict (e.g. consolidated from ZeRO shards);
    ``initial`` names the trained tensors (plain PyTorch's frozen ones have no pscompile master)."""
    theirs = ref.master_state()
    assert not any(ref.model.get_parameter(k).requires_grad for k in set(theirs) - set(initial))
    theirs = {k: v for k, v in theirs.items() if k in initial}
    assert set(ours) == set(theirs) == set(initial)
    worst = (0.0, "")
    for k in theirs:
        moved = (theirs[k] - initial[k]).abs().mean().item()
        err = (ours[k] - theirs[k]).abs().mean().item()
        worst = max(worst, (err / max(moved, 1e-5), k))
    return worst


def activations_config(policy: str, budget=None, dtype: torch.dtype = torch.float32, **kw) -> pscompile.Config:
    """Compiled mode (eager backend) on the CPU with ``Config.activations=policy``."""
    return pscompile.Config(mode="compiled", backend="eager", device="cpu", dtype=dtype,
                            device_memory=budget, activations=policy, **kw)


def assert_graphs_agree(captured, rewritten, params: dict, batch) -> None:
    """Run both captured graphs on real tensors with one seed: bit-identical loss and gradients."""
    inputs = [p.detach() for p in params.values()] + list(batch.values() if isinstance(batch, dict) else batch)
    torch.manual_seed(7)
    want = captured.gm(*inputs)
    torch.manual_seed(7)
    got = rewritten.gm(*inputs)
    assert len(want) == len(got) == 1 + len(params)
    for a, b in zip(want, got):
        assert torch.equal(a, b)



def snapshot(engine) -> dict:
    """A copy of the engine's state dict: its tensors cloned, the rest as is."""
    sd = engine.state_dict()
    return {k: {f: t.clone() for f, t in v.items()} if k in ("master", "exp_avg", "exp_avg_sq") else v
            for k, v in sd.items()}


def same_state(a: dict, b: dict) -> bool:
    """Two ``snapshot``s hold the same step and the same masters and Adam states, bit for bit."""
    return a["step"] == b["step"] and all(torch.equal(a[k][f], b[k][f])
                                          for k in ("master", "exp_avg", "exp_avg_sq") for f in a[k])


def rewrite_checkpoint(src, dst, *, header=None, tensors=None) -> None:
    """Copy the pscompile checkpoint file ``src`` to ``dst`` with its header (``header(dict) ->
    dict``) or tensors (``tensors(dict) -> dict``) changed and its SHA-256 recomputed: a tampered
    file that passes its checksum."""
    from pscompile.checkpoint.file_format import CheckpointReader, write_checkpoint
    with CheckpointReader(src) as r:
        head = {k: v for k, v in r.header.items() if k not in ("tensors", "format", "version")}
        ts = {name: r.read(name) for name in r.records}
    head = header(head) if header else head
    ts = tensors(ts) if tensors else ts
    with open(dst, "wb") as f:
        write_checkpoint(f, head, [(n, t.dtype, t.numel(), (lambda t=t: t)) for n, t in ts.items()])


def resumes_alike(a, make_engine, batches, path) -> None:
    """Save ``a`` to ``path``, load it into ``make_engine()``, and both train ``batches`` to the
    same losses and state; both are closed."""
    import pscompile
    pscompile.save(a, path)
    b = make_engine()
    pscompile.load(b, path)
    for x in batches:
        assert a.step(x) == b.step(x)
    assert same_state(snapshot(a), snapshot(b))
    a.close()
    b.close()


def a_failed_step_changes_nothing(engine, batch) -> None:
    """A step on ``batch`` with out-of-range token ids fails in the embedding and leaves every
    weight and optimizer state as it was."""
    import pytest
    before = snapshot(engine)
    with pytest.raises(IndexError):
        engine.step((batch[0].clone().fill_(999), batch[1]))
    assert same_state(snapshot(engine), before)
