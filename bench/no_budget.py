"""With no budget: pscompile compiled + Inductor against plain torch.compile + fused AdamW, interleaved.

Nothing has to move when everything fits, so what is left is the executor's own cost: its memory
nodes, the Python between compiled regions, the gradient copies into the chunks and the chunked
optimizer step. For each GPT of ``bench/compare.py`` these systems train on the same batches, one
step each in turn, round after round (so a slow spell of the machine hits every system alike):
``plain PyTorch`` (eager model, ``torch.optim.AdamW``), ``plain torch.compile`` (``torch.compile(model)``,
``torch.optim.AdamW(fused=True)``: the baseline), and ``compiled inductor`` and ``compiled eager``
(``pscompile.compile`` with ``Config(mode="compiled", backend=...)``, no ``device_memory``).

Per system: the median step time over the timed rounds, its ratio to plain torch.compile's, the
forward+backward and optimizer times (pscompile's ``StepStats``; plain systems: timed around
``backward`` and ``optimizer.step``), how many regions and memory nodes the executor ran per step,
and the largest loss difference from plain PyTorch. The first ``--warmup`` rounds (compiles, the
measuring step) are not timed.

    python bench/no_budget.py [--quick] [--markdown] [--rounds 20] [--warmup 4] [--out bench/results/no_budget.json]

Float32, one torch thread.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import pscompile
from compare import FULL, QUICK, batches
from harness.output import parser, table, write_json
from harness.runs import cpu_config
from harness.specs import gpt
from harness.timing import interleave
from pscompile.testing import call_model, extract_loss

BASELINE = "plain torch.compile"


class Plain:
    """Plain PyTorch training (eager or torch.compile'd model), fp32 parameters as their own masters."""

    def __init__(self, model: torch.nn.Module, compiled: bool):
        self.model = torch.compile(model) if compiled else model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=compiled or None)
        self.fwd_bwd_s = self.optimizer_s = 0.0

    def step(self, batch) -> float:
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = extract_loss(call_model(self.model, batch), batch, None)
        loss.backward()
        t1 = time.perf_counter()
        self.opt.step()
        self.fwd_bwd_s, self.optimizer_s = t1 - t0, time.perf_counter() - t1
        return float(loss.detach())


class Engine:
    """A pscompile engine with no budget, read the same way."""

    def __init__(self, model: torch.nn.Module, batch, backend: str):
        self.engine = pscompile.compile(model, batch, config=cpu_config(backend=backend))
        self.fwd_bwd_s = self.optimizer_s = 0.0

    def step(self, batch) -> float:
        loss = self.engine.step(batch)
        st = self.engine.stats
        self.fwd_bwd_s, self.optimizer_s = st.forward_s + st.backward_s, st.optimizer_s
        return loss

    def program(self) -> tuple[int, int]:
        """(regions, memory nodes) the executor of the last step ran."""
        ex = self.engine._executors[self.engine.schedule.gm]
        if ex.split == "program":                 # one compiled program
            return 1, len(ex.memory_nodes)
        if ex.split != "regions":
            return 0, sum(1 for s in ex._program if s.kind == "mem")
        return ex.report.regions, ex.report.memory_nodes


def run_size(n_layer: int, d: int, s: dict, rounds: int, warmup: int) -> list[dict]:
    data = batches(s, 8)

    def model():
        return gpt(n_layer, d, s["vocab"], s["seq"])
    systems = {"plain PyTorch": Plain(model(), compiled=False), BASELINE: Plain(model(), compiled=True),
               "compiled inductor": Engine(model(), data[0], "inductor"),
               "compiled eager": Engine(model(), data[0], "eager")}
    parts = {k: [] for k in systems}              # (fwd+bwd s, optimizer s) per step
    losses = {k: [] for k in systems}

    def stepper(name, system):
        def step(_):
            losses[name].append(system.step(data[len(losses[name]) % len(data)]))
            parts[name].append((system.fwd_bwd_s, system.optimizer_s))
        return step
    times = interleave({k: stepper(k, v) for k, v in systems.items()}, rounds, warmup=warmup)
    base = statistics.median(times[BASELINE])
    params = sum(p.numel() for p in model().parameters())
    rows = []
    for name, system in systems.items():
        step = statistics.median(times[name])
        regions, mem = system.program() if isinstance(system, Engine) else (None, None)
        rows.append(dict(
            size=[n_layer, d], params=params, system=name, step_s=step, vs_torch_compile=step / base,
            fwd_bwd_s=statistics.median(p[0] for p in parts[name][warmup:]),
            optimizer_s=statistics.median(p[1] for p in parts[name][warmup:]),
            regions=regions, memory_nodes=mem,
            max_dloss=max(abs(a - b) for a, b in zip(losses[name], losses["plain PyTorch"]))))
    for system in systems.values():
        if isinstance(system, Engine):
            system.engine.close()
    return rows


def main(argv=None) -> int:
    ap = parser(__doc__, "no_budget", markdown=True)
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 20, quick 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed first rounds (default 4, quick 2)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    s = dict(QUICK if args.quick else FULL)
    rounds = args.rounds if args.rounds is not None else (3 if args.quick else 20)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 4)
    rows = [r for n_layer, d in s["sizes"] for r in run_size(n_layer, d, s, rounds, warmup)]
    cells = [[f"L{r['size'][0]} d{r['size'][1]}", f"{r['params'] / 1e6:.1f}M", r["system"],
              f"{r['step_s'] * 1e3:.1f}", f"{r['vs_torch_compile']:.3f}", f"{r['fwd_bwd_s'] * 1e3:.1f}",
              f"{r['optimizer_s'] * 1e3:.1f}", "-" if r["regions"] is None else f"{r['regions']} / {r['memory_nodes']}",
              f"{r['max_dloss']:.1e}"] for r in rows]
    print(f"no budget, float32, one thread; median of {rounds} interleaved rounds after {warmup}")
    print(table(cells, ["model", "params", "system", "step ms", "/ torch.compile", "fwd+bwd ms", "optimizer ms",
                        "regions / mem nodes", "max |dloss|"], markdown=args.markdown))
    write_json(args.out, dict(rounds=rounds, warmup=warmup, settings=s, rows=rows))
    bad = [r for r in rows if r["max_dloss"] > 1e-3]
    if bad:
        print("loss differs from plain PyTorch:", [(r["size"], r["system"], r["max_dloss"]) for r in bad])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
