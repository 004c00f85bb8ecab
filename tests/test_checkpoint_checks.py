"""A checkpoint someone edited (its SHA-256 recomputed, so the checksum passes) is refused before
anything changes, naming what is wrong: every value is checked first (types, ranges, finite Adam
states, the RNG state built aside, the client state a JSON object, no tensor listed twice, the
header's length against the file's size). The engine stays bit-identical, its RNG too, in both
modes, and the untouched checkpoint still loads after."""

from __future__ import annotations

import struct

import pytest
import torch

import pscompile
from pscompile.checkpoint.file_format import CheckpointReader, write_checkpoint
from conftest import make_batches, make_model, rewrite_checkpoint

GOOD = make_batches("gpt", 1)[0]


def _state(h: dict, **kw) -> dict:
    return {**h, "state": {**h["state"], **kw}}


def _groups(h: dict, **kw) -> dict:
    return _state(h, param_groups=[{**g, **kw} for g in h["state"]["param_groups"]])


def _tensors(prefix: str, fn):
    return lambda ts: {n: fn(t) if n.startswith(prefix) else t for n, t in ts.items()}


EDITS = {   # what is changed: (header edit, tensors edit, words of the refusal)
    "rng.cpu of the right size, not a state": (None, _tensors("rng.cpu", lambda t: torch.zeros_like(t)),
                                              "rng['cpu'] is not a generator state"),
    "client a list": (lambda h: {**h, "client": [1, 2]}, None, "its 'client' is a list, not a JSON object"),
    "client a string": (lambda h: {**h, "client": "x"}, None, "its 'client' is a str, not a JSON object"),
    "meta a list": (lambda h: {**h, "meta": [1]}, None, "its 'meta' is a list, not a JSON object"),
    "step 2**70": (lambda h: _state(h, step=2**70), None, "an int >= 0 that fits int64"),
    "a NaN in exp_avg": (None, _tensors("exp_avg.", lambda t: t.clone().fill_(float("nan"))),
                         "the Adam state exp_avg of chunk 0) holds inf or NaN"),
    "a negative exp_avg_sq": (None, _tensors("exp_avg_sq.", lambda t: t.clone().fill_(-1.0)),
                              "holds negative values"),
    "inf in exp_avg_sq": (None, _tensors("exp_avg_sq.", lambda t: t.clone().fill_(float("inf"))),
                          "the Adam state exp_avg_sq of chunk 0) holds inf or NaN"),
    "a group's lr inf": (lambda h: _groups(h, lr=float("inf")), None, "lr=inf must be a finite number"),
    "a group's weight_decay inf": (lambda h: _groups(h, weight_decay=float("inf")), None,
                                   "weight_decay=inf must be a finite number"),
}


def _engine(mode: str):
    engine = pscompile.compile(make_model("gpt"), GOOD, config=pscompile.Config(
        mode=mode, backend="eager", device="cpu", dtype=torch.float32))
    engine.step(GOOD)
    return engine


def _unchanged(engine, before: dict, rng: torch.Tensor) -> None:
    after = engine.state_dict()
    assert after["step"] == before["step"] and torch.equal(torch.get_rng_state(), rng)
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert all(torch.equal(before[key][f], after[key][f]) for f in before[key]), key


def _with_duplicate(src, dst) -> None:
    """``src`` rewritten with its first tensor listed (and stored) twice, checksum recomputed."""
    with CheckpointReader(src) as r:
        head = {k: v for k, v in r.header.items() if k not in ("tensors", "format", "version")}
        ts = [(n, r.read(n)) for n in r.records]
    ts = ts[:1] + ts
    with open(dst, "wb") as f:
        write_checkpoint(f, head, [(n, t.dtype, t.numel(), (lambda t=t: t)) for n, t in ts])


def _with_length(src, dst, n: int) -> None:
    """``src`` with the header's length field set to ``n`` (plain corruption: no checksum edit)."""
    data = bytearray(src.read_bytes())
    data[8:16] = struct.pack("<Q", n)
    dst.write_bytes(bytes(data))


@pytest.mark.parametrize("mode", ["compiled", "hooks"])
def test_an_edited_checkpoint_is_refused_with_the_engine_unchanged(tmp_path, mode):
    engine = _engine(mode)
    good = tmp_path / "good.ckpt"
    pscompile.save(engine, good)
    engine.step(GOOD)                      # the engine moves on: a load would change it
    before, rng = engine.state_dict(), torch.get_rng_state()
    crafted = {}
    for name, (header, tensors, words) in EDITS.items():
        crafted[name] = (tmp_path / f"{len(crafted)}.ckpt", words)
        rewrite_checkpoint(good, crafted[name][0], header=header, tensors=tensors)
    crafted["a tensor listed twice"] = (tmp_path / "dup.ckpt", "is listed twice")
    _with_duplicate(good, crafted["a tensor listed twice"][0])
    for n, why in ((2**60, "runs past the file's"), (1 << 10, "has a corrupted header")):
        crafted[f"header length {n}"] = (tmp_path / f"len{n}.ckpt", why)
        _with_length(good, crafted[f"header length {n}"][0], n)
    for name, (path, words) in crafted.items():
        with pytest.raises(ValueError) as err:
            pscompile.load(engine, path)
        assert words in str(err.value) and "nothing was loaded" in str(err.value), (name, str(err.value))
        _unchanged(engine, before, rng)
    pscompile.load(engine, good)
    assert engine.state_dict()["step"] == before["step"] - 1


def test_two_engines_saving_to_one_path_at_once_both_succeed(tmp_path):
    """Each save writes its own temporary (the writer's pid in its name) and clears only the
    temporaries of writers no longer alive: 2 x 10 saves from two threads all succeed, the file
    left is whole, and no temporary is left."""
    import threading
    path, errors = tmp_path / "one.ckpt", []
    engines = [_engine("hooks"), _engine("hooks")]

    def saves(engine):
        for _ in range(10):
            try:
                pscompile.save(engine, path)
            except Exception as e:          # noqa: BLE001 -- collected, the test fails on any
                errors.append(e)
    threads = [threading.Thread(target=saves, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    pscompile.load(engines[0], path)
    assert not list(tmp_path.glob("*.pscompile-tmp"))


def test_only_the_temporaries_of_dead_writers_are_stale(tmp_path):
    import os
    import subprocess
    import sys
    from pscompile.checkpoint.files import remove_stale
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    names = {"dead": f".x.ckpt.{int(dead.stdout)}.ab12.pscompile-tmp", "old": ".x.ckpt.ab12cd.pscompile-tmp",
             "mine": f".x.ckpt.{os.getpid()}.ef34.pscompile-tmp", "parent": f".x.ckpt.{os.getppid()}.gh56.pscompile-tmp"}
    for n in names.values():
        (tmp_path / n).write_bytes(b"x")
    remove_stale(tmp_path, "x.ckpt")
    left = {k for k, n in names.items() if (tmp_path / n).exists()}
    assert left == {"mine", "parent"}
