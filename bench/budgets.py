"""Every budget from the minimum up works, in both modes, on every architecture the README claims.

The full sweep that ``tests/test_budgets.py`` samples. For each architecture of
``pscompile.testing.ARCHITECTURES`` (tiny 2-layer models; the Hugging Face ones need transformers)
and each mode:

- ``minimum = pscompile.min_device_memory(model, batch, config)``;
- compiled mode (``backend="eager"``): one capture (``pipeline.BudgetSweep``), then a schedule at
  every budget from the minimum to twice it in 1% steps, plus 4 KiB steps over the first 64 KiB
  above the minimum, each with the layout the engine picks at that budget (paged, or keeping
  tensors whole; ``BudgetSweep.plan`` runs ``verify_schedule`` and raises on a broken
  schedule; the planned peak must be within the budget); one byte below the minimum must be
  refused with ``BudgetError``;
- both modes: a sample of budgets (the minimum, 1.1x, 1.5x, 2x) trains 3 steps with
  ``pscompile.compile`` and every step's measured peak stays within the budget;
- both modes: ``compile`` refuses 1% below the minimum with ``BudgetError``;
- ``--inductor``: compiled mode also trains with ``backend="inductor"`` at the minimum
  ``min_device_memory`` names for it (its program's) and 1.15x, 1.5x and 2x it (a cold Inductor
  compile per model: tens of seconds), beside compiled eager at the same budget
  (``bench/inductor_cells.py``): per cell the share of compute operators that ran inside compiled
  code, the largest peak/budget of both, the steady step time over compiled eager's and over plain
  PyTorch's (interleaved, one process), the programs compiled, and the first steps' time against
  plain ``torch.compile``'s first step; ``--inductor-only`` trains only those (``--arch mixtral``
  too: a model the Inductor tests run that is not in the sweeps).

Any other exception, a peak over its budget, a non-finite loss or a budget below the minimum that is
accepted counts as a failure; the first failure's message is kept. Exit status 1 if any failed.

    python bench/budgets.py [--quick] [--inductor | --inductor-only] [--link RATE] [--markdown] [--arch NAME ...]
                            [--out bench/results/budgets.json]

``--quick``: only "gpt" and "opt" (opt when transformers imports), 10 budgets of the sweep, and only
the minimum trained (with Inductor: 1.15x the minimum, and no plain ``torch.compile`` first step).
Float32, one torch thread (see bench/foundation.py for why).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
import time
from dataclasses import dataclass

import torch
from tabulate import tabulate

import pscompile
from harness.host import meta
from harness.output import parser, write_json
from harness.runs import cpu_config
from inductor_cells import STEADY, WARMUP, Cell, plain_compile_first_step, run_cell
from pscompile.graph.pipeline import BudgetSweep
from pscompile.testing import ARCHITECTURES, EXTRA_ARCHITECTURES, tiny_model

HAVE_HF = importlib.util.find_spec("transformers") is not None
STEPS = 3                                  # steps trained per budget (compiled: the measuring one first)
TRAIN_FACTORS = (1.0, 1.1, 1.5, 2.0)       # budgets trained, as multiples of the minimum
INDUCTOR_FACTORS = (1.0, 1.15, 1.5, 2.0)
QUICK_INDUCTOR_FACTORS = (1.15,)            # (tests/test_regions_fit.py's budget: its compiles are shared)
QUICK_BUDGETS = 10
BELOW = 0.99                               # compile must refuse this fraction of the minimum


@dataclass(frozen=True)
class Sweep:
    """Compiled mode's schedules at every budget of the sweep, from one capture."""

    budgets: int                # budgets planned
    verified: int               # schedules that verified with a planned peak within the budget
    failures: tuple[str, ...]   # one message per failed budget
    below_refused: bool         # one byte below the minimum raised BudgetError
    seconds: float


@dataclass(frozen=True)
class Trained:
    """One budget trained for ``STEPS`` steps."""

    budget: int
    factor: float               # budget / minimum, as asked
    backend: str | None
    ok: bool
    peaks: tuple[int, ...]      # measured peak device bytes per step
    losses: tuple[float, ...]
    error: str | None
    seconds: float
    regions: bool | None = None   # inductor: compiled regions ran in the last step (else node by node)


@dataclass(frozen=True)
class Refusal:
    budget: int
    refused: bool               # compile raised BudgetError
    error: str | None           # what it raised instead, or why it is a failure


@dataclass(frozen=True)
class Row:
    arch: str
    mode: str                   # "compiled", "hooks", or "compiled (inductor)"
    minimum: int
    sweep: Sweep | None
    trained: tuple[Trained, ...]
    below: Refusal | None
    failures: tuple[str, ...]   # every failure of this row, in order

    @property
    def max_peak_ratio(self) -> float | None:
        ratios = [p / t.budget for t in self.trained for p in t.peaks]
        return max(ratios) if ratios else None

    def as_json(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(verified=self.sweep.verified if self.sweep else None,
                   num_failures=len(self.failures), first_failure=self.failures[0] if self.failures else None,
                   trained_ok=sum(t.ok for t in self.trained), max_peak_ratio=self.max_peak_ratio,
                   below_refused=self.below.refused if self.below else None)
        return out


def config(mode: str, budget: int | None = None, backend: str = "eager", link: str | None = None) -> pscompile.Config:
    return cpu_config(mode, backend=backend, device_memory=budget, link_bandwidth=link)


def describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:400]}"


def sweep_budgets(minimum: int, quick: bool) -> list[int]:
    """The minimum to 2x in 1% steps, plus 4 KiB steps over the first 64 KiB; ``quick``: 10 of them,
    spread over the whole range (the minimum and 2x included)."""
    full = sorted({int(minimum * (1 + k / 100)) for k in range(101)} | {minimum + 4096 * k for k in range(17)})
    if not quick:
        return full
    n = min(QUICK_BUDGETS, len(full))
    return sorted({full[round(i * (len(full) - 1) / (n - 1))] for i in range(n)})


def sweep_compiled(arch: str, minimum: int, budgets: list[int]) -> Sweep:
    """Plan and verify a schedule at each budget from one capture."""
    t0 = time.perf_counter()
    model, batch = tiny_model(arch)
    cfg = config("compiled")
    sweep = BudgetSweep(model, batch, cfg)              # the activation choices' graphs shared by the budgets
    verified, failures = 0, []
    for b in budgets:
        try:
            sched = sweep.plan(b)
        except Exception as e:                          # noqa: BLE001 - every error is a finding
            failures.append(f"budget {b} ({b / minimum:.3f}x): {describe(e)}")
            continue
        if sched.plan.peak_device_bytes > b:
            failures.append(f"budget {b}: planned peak {sched.plan.peak_device_bytes} > budget")
            continue
        verified += 1
    try:
        sweep.plan(minimum - 1)
        below, msg = False, f"budget {minimum - 1} (minimum - 1) was planned, not refused"
    except pscompile.BudgetError:
        below, msg = True, None
    except Exception as e:                              # noqa: BLE001
        below, msg = False, f"budget {minimum - 1} (minimum - 1): {describe(e)} instead of BudgetError"
    if msg:
        failures.append(msg)
    return Sweep(len(budgets), verified, tuple(failures), below, time.perf_counter() - t0)


def train(arch: str, mode: str, budget: int, factor: float, backend: str = "eager", link: str | None = None) -> Trained:
    """``STEPS`` steps at ``budget``; ok when each loss is finite and each measured peak <= budget."""
    t0 = time.perf_counter()
    peaks, losses, error, regions = [], [], None, None
    engine = None
    try:
        model, batch = tiny_model(arch)
        engine = pscompile.compile(model, batch, config=config(mode, budget, backend, link))
        for _ in range(STEPS):
            losses.append(engine.step(batch))
            peaks.append(engine.stats.peak_device_bytes)
            if not math.isfinite(losses[-1]):
                error = f"step {len(losses)}: loss {losses[-1]}"
                break
            if peaks[-1] > budget:
                error = f"step {len(losses)}: measured peak {peaks[-1]} > budget {budget}"
                break
        if backend == "inductor":
            regions = any(ex.split == "program" for ex in engine._executors.values())
    except Exception as e:                              # noqa: BLE001
        error = describe(e)
    finally:
        if engine is not None:
            engine.close()
    return Trained(budget, factor, backend if mode == "compiled" else None, error is None, tuple(peaks),
                   tuple(losses), error, time.perf_counter() - t0, regions)


def refuse_below(arch: str, mode: str, minimum: int) -> Refusal:
    """``compile`` at 1% below the minimum must raise BudgetError."""
    budget = int(minimum * BELOW)
    model, batch = tiny_model(arch)
    try:
        engine = pscompile.compile(model, batch, config=config(mode, budget))
    except pscompile.BudgetError:
        return Refusal(budget, True, None)
    except Exception as e:                              # noqa: BLE001
        return Refusal(budget, False, f"{describe(e)} instead of BudgetError")
    engine.close()
    return Refusal(budget, False, f"budget {budget} ({BELOW:.0%} of the minimum) was accepted")


def failures_of(sweep: Sweep | None, trained: tuple[Trained, ...], below: Refusal | None) -> tuple[str, ...]:
    out = list(sweep.failures) if sweep else []
    out += [f"train at {t.budget} ({t.factor}x, {t.backend or 'hooks'}): {t.error}" for t in trained if not t.ok]
    if below is not None and not below.refused:
        out.append(f"1% below: {below.error}")
    return tuple(out)


def run_arch(arch: str, mode: str, *, quick: bool, link: str | None) -> Row:
    model, batch = tiny_model(arch)
    minimum = pscompile.min_device_memory(model, batch, config(mode))
    sweep = sweep_compiled(arch, minimum, sweep_budgets(minimum, quick)) if mode == "compiled" else None
    factors = TRAIN_FACTORS[:1] if quick else TRAIN_FACTORS
    trained = tuple(train(arch, mode, int(minimum * f), f, link=link) for f in factors)
    below = refuse_below(arch, mode, minimum)
    return Row(arch, mode, minimum, sweep, trained, below, failures_of(sweep, trained, below))


@dataclass(frozen=True)
class InductorRow:
    """One architecture through Inductor at each budget of ``INDUCTOR_FACTORS`` (``inductor_cells``)."""

    arch: str
    minimum: int
    cells: tuple[Cell, ...]
    plain_compile_first_s: float | None     # plain torch.compile's first step, no budget
    failures: tuple[str, ...]

    def as_json(self) -> dict:
        return dict(arch=self.arch, mode="compiled (inductor)", minimum=self.minimum,
                    plain_compile_first_s=self.plain_compile_first_s, failures=list(self.failures),
                    num_failures=len(self.failures),
                    cells=[dict(dataclasses.asdict(c), ratio=c.ratio, regions=c.regions) for c in self.cells])


def run_inductor(arch: str, minimum: int, link: str | None, factors=INDUCTOR_FACTORS,
                 plain_compile: bool = True, dtype: torch.dtype = torch.float32) -> InductorRow:
    cells = tuple(run_cell(arch, int(minimum * f), f, link, dtype) for f in factors)
    try:
        plain = plain_compile_first_step(arch, dtype) if plain_compile else None
    except Exception:                                   # noqa: BLE001 -- a model torch.compile cannot take
        plain = None
    failures = tuple(f"{c.factor}x ({c.budget}): {c.error}" for c in cells if not c.ok)
    return InductorRow(arch, minimum, cells, plain, failures)


def inductor_table(rows: list[InductorRow]) -> tuple[list[str], list[list]]:
    """Per architecture and budget: the compiled share, the largest peak/budget of both backends,
    Inductor's steady step over compiled eager's."""
    headers = ["architecture", "minimum bytes"] + [f"{c.factor}x" for c in rows[0].cells] + [
        "first steps (s)", "plain compile 1st (s)"]
    out = []
    for r in rows:
        cells = [("FAILED" if not c.ok else
                  f"{c.compiled_share:.0%} {max(c.peaks + c.eager_peaks) / c.budget:.3f} {c.ratio:.2f}x "
                  f"{c.plain_ratio:.2f}x {c.programs}")
                 for c in r.cells]
        first = "/".join(f"{c.first_steps_s:.0f}" for c in r.cells)
        out.append([r.arch, f"{r.minimum:,}", *cells, first,
                    f"{r.plain_compile_first_s:.1f}" if r.plain_compile_first_s is not None else "-"])
    return headers, out


def architectures(args) -> tuple[list[str], list[str]]:
    """(to run, skipped for want of transformers)."""
    wanted = args.arch or (["gpt", "opt"] if args.quick else list(ARCHITECTURES))
    known = ARCHITECTURES + EXTRA_ARCHITECTURES if args.inductor_only else ARCHITECTURES
    for a in wanted:
        if a not in known:
            raise SystemExit(f"--arch {a!r}: use one of {known}"
                             + ("" if args.inductor_only else f" ({EXTRA_ARCHITECTURES} with --inductor-only)"))
    run = [a for a in wanted if HAVE_HF or a in ("gpt", "bert")]
    return run, [a for a in wanted if a not in run]


def table_rows(rows: list[Row]) -> list[list]:
    out = []
    for r in rows:
        s = r.sweep
        ratio = r.max_peak_ratio
        out.append([r.arch, r.mode, f"{r.minimum:,}", f"{s.verified}/{s.budgets}" if s else "-", len(r.failures),
                    f"{sum(t.ok for t in r.trained)}/{len(r.trained)}", f"{ratio:.3f}" if ratio is not None else "-",
                    ("yes" if r.below.refused else "NO") if r.below else "-"])
    return out


def main(argv=None) -> int:
    ap = parser(__doc__, "budgets", markdown=True)
    ap.add_argument("--inductor", action="store_true", help="also train compiled mode with backend='inductor'")
    ap.add_argument("--inductor-only", action="store_true",
                    help="only train compiled mode with backend='inductor' (no sweep, no hooks mode)")
    ap.add_argument("--arch", action="append", help="only this architecture (repeatable)")
    ap.add_argument("--link", metavar="RATE", default=None,
                    help="train under an emulated device<->host link of this bandwidth, e.g. 10MB/s")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="--inductor-only: the compute dtype of every system (16-bit matmuls are slow on a CPU: "
                         "tiny models only)")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if dtype != torch.float32 and not args.inductor_only:
        raise SystemExit("--dtype: only with --inductor-only (the sweep and hooks rows run in float32)")
    torch.set_num_threads(args.threads)
    archs, skipped = architectures(args)
    t0 = time.perf_counter()
    rows: list[Row | InductorRow] = []
    for arch in archs:
        for mode in ("compiled", "hooks") if not args.inductor_only else ():
            rows.append(run_arch(arch, mode, quick=args.quick, link=args.link))
            print(f"[{time.perf_counter() - t0:6.1f} s] {arch} {mode}: {len(rows[-1].failures)} failure(s)",
                  file=sys.stderr, flush=True)
        if args.inductor or args.inductor_only:
            minimum = pscompile.min_device_memory(*tiny_model(arch), cpu_config(backend="inductor", dtype=dtype))
            factors = QUICK_INDUCTOR_FACTORS if args.quick else INDUCTOR_FACTORS
            rows.append(run_inductor(arch, minimum, args.link, factors, plain_compile=not args.quick, dtype=dtype))
            print(f"[{time.perf_counter() - t0:6.1f} s] {arch} inductor: {len(rows[-1].failures)} failure(s)",
                  file=sys.stderr, flush=True)
    headers = ["architecture", "mode", "minimum bytes", "budgets verified", "failures", "budgets trained",
               "max peak/budget", "1% below refused"]
    n_sweep = next((r.sweep.budgets for r in rows if isinstance(r, Row) and r.sweep), 0)
    dtype = args.dtype if args.inductor_only else "float32"       # (the sweep and hooks mode train float32)
    caption = (f"Budgets from the minimum up, {dtype}, one thread; compiled: {n_sweep} budgets planned and verified "
               f"per architecture from one capture (minimum to 2x); trained: {STEPS} steps per budget, "
               f"peak measured" + (f", emulated link {args.link}" if args.link else "")
               + f"; {time.perf_counter() - t0:.0f} s")
    print(caption)
    fmt = "github" if args.markdown else "simple"
    plain_rows = [r for r in rows if isinstance(r, Row)]
    if plain_rows:
        print(tabulate(table_rows(plain_rows), headers=headers, tablefmt=fmt, disable_numparse=True))
    inductor = [r for r in rows if isinstance(r, InductorRow)]
    if inductor:
        ind_caption = (f"Inductor at each budget (x the minimum min_device_memory names for the default backend), "
                       f"{args.dtype}: "
                       f"the share of compute operators that ran inside compiled code in its last step, the largest "
                       f"peak/budget over every step of Inductor and of compiled eager, Inductor's steady step over "
                       f"compiled eager's and over plain PyTorch's (no budget; medians of {STEADY} interleaved "
                       f"steps each, after {WARMUP} steps alone), and the Inductor programs compiled (one runs); "
                       f"first steps: Inductor's first {WARMUP} steps per budget (capture, measuring, compiling); "
                       f"plain compile 1st: torch.compile's first training step, no budget")
        ind_headers, ind_rows = inductor_table(inductor)
        print("\n" + ind_caption)
        print(tabulate(ind_rows, headers=ind_headers, tablefmt=fmt, disable_numparse=True))
    if skipped:
        print(f"skipped (transformers is not installed): {', '.join(skipped)}")
    failed = [(r.arch, getattr(r, "mode", "compiled (inductor)"), f) for r in rows for f in r.failures]
    for arch, mode, f in failed:
        print(f"FAILED {arch} {mode}: {f}")
    settings = dict(quick=args.quick, inductor=args.inductor or args.inductor_only, link=args.link, steps=STEPS,
                    dtype=args.dtype,
                    below=BELOW, inductor_factors=[c.factor for c in next(
                        (r.cells for r in inductor), ())] or None, inductor_warmup=WARMUP, inductor_steady=STEADY,
                    train_factors=TRAIN_FACTORS[:1] if args.quick else TRAIN_FACTORS)
    write_json(args.out, dict(meta=meta(), settings=settings, skipped=skipped, rows=[r.as_json() for r in rows],
                              total_s=time.perf_counter() - t0))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
