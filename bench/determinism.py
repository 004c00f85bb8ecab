"""Do random and in-place ops give the same result in every process, and eager's, through Inductor?

Each cell trains one model with fixed seeds in K fresh processes (``CI=1``: Inductor refuses
implicit fallbacks), with the default backend and with ``backend="eager"`` in each, and reports:
whether the K processes gave bit-identical losses and weights, the largest relative loss difference
from the eager backend over all steps, the largest weight difference from it, each step's share of
compute operators run inside the compiled program (the first step of a capture measures node by
node; an accumulation step's first micro-batch does too), and the fetches a step made.

Models: a GPT of the project's own code with dropout 0.1 (``gpt``), ``pscompile.testing.InplaceZoo``
(``zoo``: every in-place and random op a model emits, on intermediates between layers), and tiny
Hugging Face GPT-2, BERT, OPT and T5 at their default dropout (0.1). Budgets: 1.15x, 2x and 8x the
model's minimum and none; float32, and bfloat16 at 2x; each run takes three single steps, then one
step of two micro-batches (accumulation: a capture of its own, its first program step included).

    python bench/determinism.py [--quick] [--k 3] [--markdown] [--out bench/results/determinism.json]
                                [--models gpt zoo ...] [--budgets 1.15 8 none] [--dtypes bfloat16]

``--quick``: the GPT and the zoo at 2x in float32, two processes each. A child's spec may name a
``device`` (``tests/gpu/test_cuda_compiled.py`` runs the same children on CUDA).
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys

import torch

import pscompile
from harness.output import parser, table, write_json
from harness.runner import ChildFailed, child, run_fresh

MODELS = ("gpt", "zoo", "hf-gpt2", "hf-bert", "opt", "t5")
BUDGETS = (1.15, 2.0, 8.0, None)
MICRO = [1, 1, 1, 2]
LR = 1e-3


def build(kind: str):
    """The model and its 8 batches, the same in every process (fixed seeds)."""
    from pscompile.testing import inplace_zoo, tiny_model
    if kind == "zoo":
        return inplace_zoo()
    if kind == "gpt":
        from pscompile.models.gpt import GPT, GPTConfig
        torch.manual_seed(7)
        model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=64, vocab_size=128, seq_len=32, dropout=0.1))
        g = torch.Generator().manual_seed(0)
        data = [torch.randint(0, 128, (2, 33), generator=g) for _ in range(8)]
        return model, [(d[:, :-1], d[:, 1:]) for d in data]
    model, _ = tiny_model(kind, dropout=True)
    return model, [tiny_model(kind, seed=s, dropout=True)[1] for s in range(8)]


def digest(weights: dict[str, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=8)
    for name, t in sorted(weights.items()):
        h.update(name.encode())
        h.update(t.cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def engine_for(spec: dict, backend: str):
    """A fresh engine for ``spec``'s model and budget with ``backend``, and the model's batches
    (the zoo's float inputs in the compute dtype, as a 16-bit run feeds them)."""
    model, batches = build(spec["model"])
    if spec["model"] == "zoo":
        dtype = getattr(torch, spec.get("dtype", "float32"))
        batches = [(x.to(dtype), y.to(dtype)) for x, y in batches]
    mode = {"mode": "hooks"} if backend == "hooks" else {"backend": backend}
    base = pscompile.Config(device=spec.get("device", "cpu"), dtype=getattr(torch, spec.get("dtype", "float32")),
                            chunk_size=spec.get("chunk_size", "auto"), **mode)
    budget = None
    if spec.get("budget") is not None:
        budget = int(spec["budget"] * pscompile.min_device_memory(build(spec["model"])[0], batches[0], base))
    config = dataclasses.replace(base, device_memory=budget)
    return pscompile.compile(model, optimizer=pscompile.AdamW(lr=LR), config=config), batches


def run(spec: dict, backend: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """``spec["micro"]`` (micro-batches per step, one entry a step) steps from a fresh engine, or
    from the checkpoint ``spec["load"]``; saved at ``spec["save"]`` after ``spec["save_after"]``
    steps. Each step's loss as ``float.hex`` (bit for bit), its compiled share, fetches and
    evictions, the final weights' digest; and the weights."""
    engine, batches = engine_for(spec, backend)
    torch.manual_seed(11)                     # the seed the steps' random ops draw from
    first = 0
    if spec.get("load"):
        pscompile.load(engine, spec["load"])   # (the random generator's state comes with it)
        first = spec["save_after"]
    out = {"loss": [], "share": [], "fetches": [], "evictions": [], "budget": engine.config.device_memory}
    at = sum(spec["micro"][:first])
    for s, micro in enumerate(spec["micro"][first:], start=first):
        group, at = batches[at:at + micro], at + micro
        loss = engine.step(group if micro > 1 else group[0])
        st = engine.stats
        out["loss"].append(float(loss).hex())
        out["share"].append(st.compiled_share)
        out["fetches"].append(st.num_fetches)
        out["evictions"].append(st.num_evictions)
        if spec.get("save") and s + 1 == spec["save_after"]:
            pscompile.save(engine, spec["save"])
    weights = {k: v.detach().float().cpu().clone() for k, v in engine.full_state_dict().items()}
    out["weights"] = digest(weights)
    engine.close()
    return out, weights


def work(specs: list[dict]) -> list[dict]:
    """The child: each spec's runs by backend, with each run's largest weight difference from the
    spec's first backend's (``weight_diff``)."""
    results = []
    for spec in specs:
        runs = {b: run(spec, b) for b in spec["backends"]}
        first = runs[spec["backends"][0]][1]
        for out, weights in runs.values():
            out["weight_diff"] = max((weights[k] - first[k]).abs().max().item() for k in first)
        results.append({b: out for b, (out, _) in runs.items()})
    return results


def cell(spec: dict, k: int) -> dict:
    """``spec`` in ``k`` fresh processes (one torch thread each): the row's figures."""
    try:
        got = [run_fresh(__file__, [spec], env={"CI": "1"}, threads=1)[0] for _ in range(k)]
    except ChildFailed as e:
        return {**spec, "error": str(e).splitlines()[-1][:300]}
    ours, eager = [g["inductor"] for g in got], got[0]["eager"]
    same = all((o["loss"], o["weights"]) == (ours[0]["loss"], ours[0]["weights"]) for o in ours)
    rel = max(abs(float.fromhex(a) - float.fromhex(b)) / abs(float.fromhex(b))
              for a, b in zip(ours[0]["loss"], eager["loss"]))
    return {**spec, "identical": same, "loss_rel_vs_eager": rel, "weight_diff_vs_eager": eager["weight_diff"],
            "shares": ours[0]["share"], "fetches": ours[0]["fetches"], "runs": got}


def specs(quick: bool, models=None, budgets=None, dtypes=None) -> list[dict]:
    """The cells: the quick pair, the default sweep, or every model x budget x dtype named."""
    if quick:
        return [{"model": m, "budget": 2.0, "dtype": "float32"} for m in ("gpt", "zoo")]
    if models or budgets or dtypes:
        return [{"model": m, "budget": b, "dtype": d} for d in (dtypes or ["float32"])
                for m in (models or MODELS) for b in (budgets or BUDGETS)]
    out = [{"model": m, "budget": b, "dtype": "float32"} for m in MODELS for b in BUDGETS]
    return out + [{"model": m, "budget": 2.0, "dtype": "bfloat16"} for m in MODELS]


def _budget(text: str) -> float | None:
    return None if text == "none" else float(text)


def main() -> int:
    ap = parser(__doc__, "determinism", child=True, markdown=True)
    ap.add_argument("--k", type=int, default=3, help="fresh processes per cell")
    ap.add_argument("--models", nargs="+", choices=MODELS, help="these models only")
    ap.add_argument("--budgets", nargs="+", type=_budget, help="multiples of the minimum, or none")
    ap.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"), help="these dtypes only")
    args = ap.parse_args()
    if child(args.child, work):
        return 0
    k = 2 if args.quick else args.k
    rows, cells = [], []
    for spec in specs(args.quick, args.models, args.budgets, args.dtypes):
        spec = {**spec, "backends": ["inductor", "eager"], "micro": MICRO,
                **({"chunk_size": 2048} if spec["model"] == "zoo" else {})}
        c = cell(spec, k)
        cells.append(c)
        budget = "none" if spec["budget"] is None else f"{spec['budget']}x"
        if "error" in c:
            rows.append([spec["model"], budget, spec["dtype"], "error", c["error"], "", "", ""])
        else:
            rows.append([spec["model"], budget, spec["dtype"], f"{k}/{k}" if c["identical"] else "no",
                         f"{c['loss_rel_vs_eager']:.1e}", f"{c['weight_diff_vs_eager']:.1e}",
                         " ".join(f"{x:.2g}" for x in c["shares"]), c["fetches"][-2]])
        print(rows[-1], file=sys.stderr, flush=True)
    print(table(rows, ["model", "budget", "dtype", "processes identical", "loss vs eager (rel)",
                       "weights vs eager (abs)", "compiled share by step", "fetches/step"], markdown=args.markdown))
    write_json(args.out, {"meta": {"k": k, "torch": torch.__version__, "threads": 1, "CI": "1",
                                   "micro": MICRO, "lr": LR}, "cells": cells})
    failed = [c for c in cells if "error" in c or not c["identical"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
