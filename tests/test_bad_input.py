"""Bad batches get the right error, in both modes, and lose nothing.

A batch of the compiled form (the same arguments, tensors of the same dtypes) that the model
rejects (a sequence longer than the model allows, a token id outside the vocabulary, ids of
another rank) raises what eager PyTorch raises for it: the same exception type and message, in
compiled mode too (where the capture runs the forward once more on fake tensors to tell the
batch's fault from a model it cannot trace, or the step's own run meets it). A batch of another
form (float token ids, an extra argument, a dict for a tuple) raises a ``TypeError`` naming the
argument, both forms and what to pass before anything runs (``None`` or a string, of no type
pscompile reads, one naming the type). Either way the weights,
Adam states and the random number generator stay as they were, and the next good step gives what
a clean engine gives. Models that cannot be captured keep the capture's own advice
(``tests/test_capture.py``).
"""

from __future__ import annotations

import os

import pytest
import torch

import pscompile
from pscompile.runtime.batching import call_model
from conftest import make_batches, make_model

GOOD = make_batches("gpt", 1)[0]
MODEL_REJECTS = {
    "longer than seq_len": (torch.cat([GOOD[0], GOOD[0]], 1), torch.cat([GOOD[1], GOOD[1]], 1)),
    "a token id outside the vocabulary": (GOOD[0].clone().fill_(300), GOOD[1]),
    "3-D token ids": (GOOD[0][..., None], GOOD[1]),
}
OTHER_FORM = {   # words the message must hold: what differs, what is compared, what to pass
    "float token ids": ((GOOD[0].float(), GOOD[1]), ("batch[0] is float32 tensor where the compiled form has int64",
                                                     "Each batch is compared with the first batch",
                                                     "the same dtype of every tensor; sizes may change",
                                                     "cast a tensor whose dtype differs: batch[0].to(torch.int64)",
                                                     "or compile a new engine for this form")),
    "an extra argument": ((*GOOD, GOOD[0]), ("batch[2] is new", "the first batch's structure and dtypes, or")),
    "a dict for a tuple": ({"idx": GOOD[0], "targets": GOOD[1]}, ("batch[0] is missing",)),
}
UNREADABLE = [(None, "builtins.NoneType"), ("hello", "builtins.str"), ({1, 2}, "builtins.set")]   # (batch, its type)


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _engine(mode: str):
    return pscompile.compile(make_model("gpt", dropout=0.1), GOOD, config=pscompile.Config(
        mode=mode, backend="eager", device="cpu", dtype=torch.float32, device_memory=None))


@pytest.mark.parametrize("mode", ["compiled", "hooks"])
def test_a_batch_the_model_rejects_raises_the_models_own_error_and_loses_nothing(mode):
    engine, clean = _engine(mode), _engine(mode)
    for e in (engine, clean):
        torch.manual_seed(1)
        e.step(GOOD)
    before = engine.state_dict()
    for name, bad in MODEL_REJECTS.items():
        with pytest.raises(Exception) as eager:
            call_model(make_model("gpt"), bad)
        rng = torch.get_rng_state()
        with pytest.raises(type(eager.value)) as ours:
            engine.step(bad)
        a, b = _first_line(ours.value), _first_line(eager.value)
        # compiled mode finds the error on fake tensors, whose kernels may name a dtype differently
        # ("torch.float32" for "torch.FloatTensor"): the same exception, the same words up to there
        assert a == b or (mode == "compiled" and a[:100] == b[:100]), (name, a, b)
        assert torch.equal(torch.get_rng_state(), rng), name
    for name, (bad, words) in OTHER_FORM.items():
        with pytest.raises(TypeError, match="The engine was compiled for batches of the form") as ours:
            engine.step(bad)
        assert all(w in str(ours.value) for w in words), (name, str(ours.value))
        assert "its own schedule" not in str(ours.value), str(ours.value)     # (one symbolic capture serves sizes)
        with pytest.raises(TypeError, match=r"^evaluate\(\): "):
            engine.evaluate(bad)
        with pytest.raises(TypeError, match=r"^step\(\) \(micro-batch 1\): "):
            engine.step([GOOD, bad] if isinstance(bad, tuple) else [GOOD, (bad,)])
    for bad, kind in UNREADABLE:
        with pytest.raises(TypeError, match=rf"^step\(\): a batch of type {kind}; pscompile reads a tensor"):
            engine.step(bad)
    after = engine.state_dict()
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert all(torch.equal(before[key][f], after[key][f]) for f in before[key]), key
    torch.manual_seed(2)
    want = clean.step(GOOD)
    torch.manual_seed(2)
    assert engine.step(GOOD) == want


# ------------------------------------------------------------- docs/reliability.md's table
# Every bad input tried, what it raises and words the message must hold; docs/reliability.md's table
# ("Bad input and the error it gets") lists the same rows, so neither can drift from the code.
def _hooks(**kw) -> pscompile.Config:
    return pscompile.Config(**{"mode": "hooks", "device": "cpu", "dtype": torch.float32, **kw})


def _stepped(mode: str = "hooks"):
    engine = pscompile.compile(make_model("gpt"), GOOD, config=pscompile.Config(
        mode=mode, backend="eager", device="cpu", dtype=torch.float32))
    engine.step(GOOD)
    return engine


def _held_twice():
    model = make_model("gpt")
    pscompile.compile(model, GOOD, config=_hooks())
    pscompile.compile(model, GOOD, config=_hooks())


def _lazy():
    return pscompile.compile(make_model("gpt"), config=_hooks())


def _closed():
    engine = _stepped()
    engine.close()
    engine.step(GOOD)


class _Quantized(torch.nn.Module):
    """A layer with a weight stored as integers beside a float one (a quantized base, an index table)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.q = torch.nn.Parameter(torch.zeros(8, 8, dtype=dtype), requires_grad=False)

    def forward(self, x):
        return self.lin(x) + x @ self.q.to(x.dtype)


def _integer_parameter(dtype: torch.dtype, mode: str = "hooks"):
    model = torch.nn.Sequential(_Quantized(dtype))
    pscompile.compile(model, (torch.randn(4, 8),), config=_hooks(mode=mode), loss_fn=lambda out, b: out.mean())


def _closed_then(call):
    engine = _stepped()
    engine.close()
    call(engine)


def _frozen(mode):
    model = make_model("gpt").requires_grad_(False)
    pscompile.compile(model, GOOD, config=_hooks(mode=mode))


def _second_thread():
    """Another thread calls step() while one runs (held inside the model's forward)."""
    import threading
    engine, inside, done, seen = _stepped(), threading.Event(), threading.Event(), []
    real = engine.model.forward

    def slow_forward(*a, **k):
        inside.set()
        done.wait(30)
        return real(*a, **k)
    engine.model.forward = slow_forward
    runner = threading.Thread(target=lambda: seen.append(engine.step(GOOD)))
    runner.start()
    try:
        assert inside.wait(30), "the first step never entered the model"
        engine.step(GOOD)
    finally:
        done.set()
        runner.join()


def _grad_batch():
    """A float input that requires grad (a model fed by another model's output, say)."""
    x = torch.randn(4, 8)
    engine = pscompile.compile(torch.nn.Linear(8, 8), (x,), config=_hooks(),
                               loss_fn=lambda out, batch: out.square().mean())
    engine.step((x.clone().requires_grad_(),))


def _nan_weights():
    engine = _stepped()
    engine.load_state_dict({**(sd := engine.state_dict()),
                            "master": {**sd["master"], "wte.weight": torch.full_like(sd["master"]["wte.weight"], 1e38)}})
    engine.step(GOOD)


def _foreign_checkpoint(tmp):
    engine = pscompile.compile(make_model("bert"), make_batches("bert", 1)[0], config=_hooks())
    pscompile.save(engine, tmp / "bert.ckpt")
    pscompile.load(_stepped(), tmp / "bert.ckpt")


def _truncated_checkpoint(tmp):
    engine = _stepped()
    pscompile.save(engine, tmp / "t.ckpt")
    data = (tmp / "t.ckpt").read_bytes()
    (tmp / "t.ckpt").write_bytes(data[:len(data) // 2])
    pscompile.load(engine, tmp / "t.ckpt")


def _crafted_checkpoint(tmp, **change):
    """A checkpoint changed after it was written, its checksum recomputed."""
    from conftest import rewrite_checkpoint
    engine = _stepped()
    pscompile.save(engine, tmp / "c.ckpt")
    rewrite_checkpoint(tmp / "c.ckpt", tmp / "crafted.ckpt", **change)
    pscompile.load(engine, tmp / "crafted.ckpt")


def _negative_step(tmp):
    _crafted_checkpoint(tmp, header=lambda h: {**h, "state": {**h["state"], "step": -5}})


def _nan_masters(tmp):
    _crafted_checkpoint(tmp, tensors=lambda ts: {n: torch.full_like(t, float("nan")) if n.startswith("master.") else t
                                                 for n, t in ts.items()})


def _nested(depth: int) -> dict:
    top = inner = {}
    for _ in range(depth):
        inner["a"] = inner = {}
    return top


def _compile(**kw):
    return lambda tmp: pscompile.compile(make_model("gpt"), GOOD, **kw)


TABLE = [   # (input, what raises it, exception, words of its message)
    ("token ids of another dtype than the first batch's (float)",
     lambda tmp: _stepped("compiled").step((GOOD[0].float(), GOOD[1])),
     TypeError, "cast a tensor whose dtype differs: batch[0].to(torch.int64)"),
    ("an extra argument", lambda tmp: _stepped().step((*GOOD, GOOD[0])), TypeError, "batch[2] is new"),
    ("a dict where the engine was compiled with a tuple",
     lambda tmp: _stepped().step({"idx": GOOD[0], "targets": GOOD[1]}), TypeError, "batch['idx'] is new"),
    ("a batch of a type pscompile cannot read (`None`, a string, a set)", lambda tmp: _lazy().step("hello"),
     TypeError, "a batch of type builtins.str; pscompile reads a tensor"),
    ("a sequence longer than the model's (the model's own error)", lambda tmp: _stepped("compiled").step(MODEL_REJECTS["longer than seq_len"]),
     AssertionError, "sequence length 128 > seq_len 64"),
    ("a token id outside the vocabulary (the model's own error)",
     lambda tmp: _stepped("compiled").step(MODEL_REJECTS["a token id outside the vocabulary"]),
     IndexError, "index out of range in self"),
    ("an empty list of micro-batches", lambda tmp: _stepped().step([]), ValueError, "step() got an empty list"),
    ("a model whose loss is not a scalar", _compile(config=_hooks(), loss_fn=lambda out, batch: torch.ones(3)),
     ValueError, "the loss must be a scalar tensor, got (3,)"),
    ("`device_memory` below the minimum", _compile(config=_hooks(device_memory="64KiB")),
     pscompile.BudgetError, "is below the minimum"),
    ("`device_memory=\"lots\"`", lambda tmp: _hooks(device_memory="lots"), ValueError, "device_memory='lots' is not a size"),
    ("`host_memory` too small for the chunks", _compile(config=_hooks(host_memory="64KiB", device_memory="1MiB")),
     pscompile.BudgetError, "Config(disk_dir=...) keeps their optimizer states on disk instead"),
    ("`dtype=torch.float64`", lambda tmp: _hooks(dtype=torch.float64), ValueError,
     "use torch.float16, torch.bfloat16 or torch.float32"),
    ("`mode=\"fast\"`", lambda tmp: _hooks(mode="fast"), ValueError, "mode='fast' is not a mode"),
    ("a `disk_dir` that is not a folder", lambda tmp: _hooks(disk_dir=str(tmp / "missing")), ValueError,
     "is not an existing folder"),
    ("`device=\"tpu\"`", lambda tmp: _hooks(device="tpu"), ValueError, "use 'cpu', 'cuda' or 'cuda:N'"),
    ("`link_bandwidth=\"v200\"`", lambda tmp: _hooks(link_bandwidth="v200"), ValueError,
     "or a GPU preset, one of ['a100', 'h100', 'v100']"),
    ("`lock_free=True, staleness=0`", lambda tmp: _hooks(lock_free=True, staleness=0), ValueError,
     "staleness=0 must be an int >= 1"),
    ("`lock_free=True` with float16", lambda tmp: _hooks(lock_free=True, dtype=torch.float16), ValueError,
     "lock_free=True does not support dtype=torch.float16"),
    ("`chunk_size=0`", lambda tmp: _hooks(chunk_size=0), ValueError, "must be a positive number of elements or 'auto'"),
    ("`activations=\"offload\"` in hooks mode", lambda tmp: _hooks(activations="offload"), ValueError,
     "wrap the model's blocks in torch.utils.checkpoint"),
    ("`planner=\"lru\"`", lambda tmp: _hooks(mode="compiled", planner="lru"), ValueError,
     "planner='lru' is not a planner; use one of ('belady', 'angel')"),
    ("`planner=\"angel\"` in hooks mode", lambda tmp: _hooks(planner="angel"), ValueError,
     "mode='hooks' evicts at run time by farthest next use"),
    ("`AdamW(lr=-1)`", lambda tmp: pscompile.AdamW(lr=-1), ValueError, "lr=-1 must be a finite number >= 0"),
    ("`AdamW(betas=(0.9, 1.0))`", lambda tmp: pscompile.AdamW(betas=(0.9, 1.0)), ValueError,
     "must be two numbers in [0, 1)"),
    ("a parameter group naming a parameter the model lacks",
     _compile(config=_hooks(), optimizer=pscompile.AdamW(param_groups=[{"params": ["lm_head.bias"]}])),
     ValueError, "names 'lm_head.bias', which the model does not have"),
    ("a `torch.optim.AdamW` as the optimizer",
     _compile(optimizer=torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])), ValueError,
     "optimizer must be pscompile.AdamW(...)"),
    ("a model an open engine holds", lambda tmp: _held_twice(), ValueError, "model is held by an open pscompile engine"),
    ("a step after `close()`", lambda tmp: _closed(), RuntimeError,
     "this engine was closed: close() gave the model its trained weights back"),
    ("an integer parameter (uint8; a bitsandbytes 8-bit base)", lambda tmp: _integer_parameter(torch.uint8),
     ValueError, "self.register_buffer('q', tensor) instead of nn.Parameter(tensor)"),
    ("inf/NaN gradients in fp32 or bf16", lambda tmp: _nan_weights(), FloatingPointError,
     "the update was not applied"),
    ("a checkpoint of another model", _foreign_checkpoint, ValueError, "does not fit this engine; nothing was loaded"),
    ("a truncated checkpoint", _truncated_checkpoint, ValueError, "nothing was loaded"),
    ("`device_memory=float(\"nan\")`", lambda tmp: _hooks(device_memory=float("nan")), ValueError,
     "device_memory=nan is not a number of bytes"),
    ("`host_memory=float(\"inf\")`", lambda tmp: _hooks(host_memory=float("inf")), ValueError,
     "host_memory=inf is not a number of bytes"),
    ("a model whose parameters are all frozen (hooks mode)", lambda tmp: _frozen("hooks"), ValueError,
     "model has no trainable parameter"),
    ("a model whose parameters are all frozen (compiled mode)", lambda tmp: _frozen("compiled"), ValueError,
     "model has no trainable parameter"),
    ("a batch tensor with `requires_grad=True`",
     lambda tmp: _grad_batch(), ValueError, "requires grad"),
    ("a batch on the meta device", lambda tmp: pscompile.compile(make_model("gpt"), tuple(t.to("meta") for t in GOOD),
                                                                 config=_hooks()), ValueError, "is on the meta device"),
    ("`state_dict()` after `close()`", lambda tmp: _closed_then(lambda e: e.state_dict()), RuntimeError,
     "state_dict() of a closed engine"),
    ("`pscompile.save` after `close()`", lambda tmp: _closed_then(lambda e: pscompile.save(e, tmp / "x.ckpt")),
     RuntimeError, "this engine was closed"),
    ("`pscompile.load` into a closed engine",
     lambda tmp: _closed_then(lambda e: pscompile.load(e, tmp / "x.ckpt")), RuntimeError, "load into a new one"),
    ("a second thread calling `step()` while one runs", lambda tmp: _second_thread(), RuntimeError,
     "while this engine's step() runs"),
    ("a checkpoint with `step=-5` (checksum recomputed)", _negative_step, ValueError,
     "state_dict['step']: the number of steps taken (an int >= 0 that fits int64) is needed, got -5"),
    ("a checkpoint with NaN masters (checksum recomputed)", _nan_masters, ValueError, "holds inf or NaN"),
    ("an empty batch (`(4, 0)` token ids)", lambda tmp: _stepped().step(tuple(t[:, :0] for t in GOOD)), ValueError,
     "batch[0] has no elements (shape (4, 0))"),
    ("a sparse batch tensor", lambda tmp: _stepped().step((GOOD[0].to_sparse(), GOOD[1])), ValueError,
     "batch[0] is a torch.sparse_coo tensor"),
    ("`AdamW(lr=float('inf'))`", lambda tmp: pscompile.AdamW(lr=float("inf")), ValueError,
     "lr=inf must be a finite number >= 0"),
    ("`AdamW(eps=0)`", lambda tmp: pscompile.AdamW(eps=0), ValueError, "eps=0 must be a finite number > 0"),
    ("`Config(host_memory=0)`", lambda tmp: _hooks(host_memory=0), ValueError,
     "host_memory=0 leaves no room for the chunks' host copies"),
    ("`client_state` nested 5,000 deep", lambda tmp: pscompile.save(_stepped(), tmp / "deep.ckpt",
                                                                     client_state=_nested(5000)), ValueError,
     "pscompile.save: client_state nests lists and dicts deeper than 100 levels"),
]


def test_every_bad_input_in_the_readme_table_gets_its_error(tmp_path):
    import pathlib
    readme = (pathlib.Path(__file__).parent.parent / "docs" / "reliability.md").read_text()
    rows = []
    for what, make, error, words in TABLE:
        with pytest.raises(error) as raised:
            make(tmp_path)
        assert words in str(raised.value), (what, str(raised.value))
        rows.append(f"| {what} | `{error.__name__}` | {words.replace('|', '&#124;')} |")
        assert rows[-1] in readme, f"docs/reliability.md's bad-input table lacks the row\n{rows[-1]}"
    assert len(rows) >= 15


def test_a_closed_engine_says_what_to_do_keeps_its_stats_and_closes_twice(tmp_path):
    """After close(): step, evaluate, materialize and save name the call and say what to do; a
    second close() (and a ``with`` block's exit) does nothing; ``stats`` is the last step's."""
    engine = _stepped()
    last = engine.stats
    engine.close()
    engine.close()
    with engine:
        pass
    assert engine.stats is last and "loss" in str(engine.stats)
    calls = {"engine.step()": lambda: engine.step(GOOD), "engine.evaluate()": lambda: engine.evaluate(GOOD),
             "pscompile.save()": lambda: pscompile.save(engine, tmp_path / "x.ckpt"),
             "engine.materialize()": lambda: engine.materialize().__enter__()}
    for call, run in calls.items():
        with pytest.raises(RuntimeError) as raised:
            run()
        message = str(raised.value)
        assert message.startswith(f"{call}: this engine was closed"), message
        assert "build a new engine: pscompile.compile(model, batch, ...)" in message, message
        assert "load it into a new engine: pscompile.load(new_engine, path)" in message, message


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int64])
def test_an_integer_parameter_is_refused_naming_it_and_what_works(dtype):
    with pytest.raises(ValueError) as raised:
        _integer_parameter(dtype, mode="compiled")
    message = str(raised.value)
    for words in (f"parameter '0.q' has dtype {dtype}, shape (8, 8)", "in _Quantized.__init__ (module '0'), "
                  "self.register_buffer('q', tensor) instead of nn.Parameter(tensor)",
                  "a floating-point dtype with requires_grad=False",
                  "A base bitsandbytes loaded in 8 bits is not taken: load it in 4 bits",
                  "Config(frozen_format='nf4')"):
        assert words in message, message


@pytest.mark.parametrize("argv", [["plan", "--json", "{tmp}/no/such/../../f/x.json"], ["plan", "--json", "{tmp}"],
                                  ["inspect", "--out", "{tmp}/file.txt"]])
def test_a_cli_output_that_cannot_be_written_is_refused_before_anything_runs(tmp_path, capsys, argv):
    from pscompile.cli.main import main
    (tmp_path / "file.txt").write_text("a file, not a folder")
    (tmp_path / "f").mkdir()
    (tmp_path / "f").chmod(0o500)               # (root may write anyway: then the folder case below decides)
    argv = [a.format(tmp=tmp_path) for a in argv]
    if argv[0] == "plan" and argv[2].endswith("x.json") and os.access(tmp_path / "f", os.W_OK) and os.geteuid() == 0:
        argv[2] = "/proc/x.json"                # a place even root cannot write
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error: --" in err and ("cannot write" in err or "is a folder" in err or "is a file" in err), err


def test_a_budget_error_never_calls_the_budget_below_a_minimum_it_reaches(monkeypatch):
    """With chunk_size="auto" a refused budget's error names the least budget (what
    ``min_device_memory`` returns). Below it, it says so; where the search and the layout "auto"
    picks at this budget disagree (as they did for Phi-3, refused at its own minimum with "515652
    bytes is below the minimum 515652 bytes"), it must not call the budget below a minimum it reaches."""
    import re
    import pscompile.api as api

    def minima_claimed(e: BaseException) -> list[int]:
        return [int(n) for n in re.findall(r"below the minimum (?:\S+ \S+ \()?(\d+) bytes", str(e))]
    budget = 64 * 1024
    config = pscompile.Config(mode="compiled", backend="eager", device="cpu", dtype=torch.float32,
                              device_memory=budget)
    with pytest.raises(pscompile.BudgetError) as small:
        pscompile.compile(make_model("gpt"), GOOD, config=config)
    assert minima_claimed(small.value) and min(minima_claimed(small.value)) > budget, str(small.value)
    monkeypatch.setattr(api, "_least_budget", lambda *args: (budget, 2048))    # the search accepts this budget
    with pytest.raises(pscompile.BudgetError) as raised:
        pscompile.compile(make_model("gpt"), GOOD, config=config)
    message = str(raised.value)
    assert not [n for n in minima_claimed(raised.value) if n <= budget], message
    assert raised.value.minimum == budget and f"give device_memory={budget}" in message, message


@pytest.mark.parametrize("mode", ["compiled", "hooks"])
def test_an_empty_or_sparse_batch_is_refused_before_anything_changes(mode):
    engine = _stepped(mode)
    before, steps = engine.state_dict(), engine.state_dict()["step"]
    for bad, words in (((GOOD[0][:, :0], GOOD[1][:, :0]), "has no elements"),
                       ((GOOD[0].to_sparse(), GOOD[1]), "sparse_coo")):
        with pytest.raises(ValueError, match=words):
            engine.step(bad)
        with pytest.raises(ValueError, match=words):
            engine.evaluate(bad)
    after = engine.state_dict()
    assert after["step"] == steps
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert all(torch.equal(before[key][f], after[key][f]) for f in before[key]), key


@pytest.mark.parametrize("mode", ["compiled", "hooks"])
def test_a_transposed_batch_trains_as_its_contiguous_copy(mode):
    """A non-contiguous batch (a transposed view) that plain PyTorch takes: compiled mode copies it
    into the layout it lowered for, and the step equals the contiguous batch's."""
    view = tuple(t.t().contiguous().t() for t in GOOD)
    assert not view[0].is_contiguous() and torch.equal(view[0], GOOD[0])
    a, b = _stepped(mode), _stepped(mode)
    torch.manual_seed(3)
    want = a.step(GOOD)
    torch.manual_seed(3)
    assert b.step(view) == want

