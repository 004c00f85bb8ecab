"""A second process starts warm: time to a steady step in two processes in turn, sharing one cache.

For each system, process 1 starts with an empty Inductor cache (a new temporary folder,
``TORCHINDUCTOR_CACHE_DIR``) and process 2 runs the same job with that folder as process 1 left it.
The clock starts before the model is built and stops at the end of the first steady step (the
first from which every step takes at most 1.5x the median of the last four, ``steady_at``):

- ``plain torch.compile``: ``torch.compile(model)``, ``torch.optim.AdamW(fused=True)``;
- ``pscompile``: ``pscompile.compile(model, batch, Config(...))`` with the default backend (a
  rerun: process 2 measures at its first step, as process 1 did);
- ``pscompile, resume``: as above, and process 2 loads the checkpoint process 1 saved after its
  last step (its measurements planned with: no measuring step);
- ``pscompile, backend="eager"``.

pscompile runs at 1.15x the minimum that ``min_device_memory`` names for the default ``Config``.
Each row says how many programs each process compiled and how many it loaded from Inductor's cache
(pscompile's INFO records), and the share of compute that ran compiled at its last step. The
project's GPT (4 layers, d=128, vocabulary 2048, batch 2 x 64), float32, one torch thread.

    python bench/warm_start.py [--quick] [--markdown] [--layers 4 8] [--repeats 3] [--out bench/results/warm_start.json]

Process 2 runs ``--repeats`` times (a single process's time varies by a second or more here); the
table gives their median and range, and compares medians.

``--quick`` (the smoke test): a 2-layer d=64 GPT, plain torch.compile and pscompile only.
"""

from __future__ import annotations

import logging
import statistics
import sys
import tempfile
import time
from functools import partial

from harness.output import parser, write_json
from harness.runner import ChildFailed, child, run_fresh
from harness.timing import steady_at

SHAPE = dict(d=128, vocab=2048, seq=64, batch=2)
QUICK = dict(d=64, vocab=256, seq=32, batch=2)
STEPS = 8
SYSTEMS = ("plain torch.compile", "pscompile", "pscompile, resume", 'pscompile, backend="eager"')


class _Programs(logging.Handler):
    """Counts pscompile's INFO records of a program compiled, and of one loaded from Inductor's cache."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.compiled = self.loaded = 0
        logging.getLogger("pscompile").addHandler(self)
        logging.getLogger("pscompile").setLevel(logging.INFO)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "compiled as one program" in message:
            self.loaded += "(loaded:" in message
            self.compiled += "(loaded:" not in message


def _child(spec: dict) -> dict:
    import torch
    torch.set_num_threads(1)
    import pscompile
    from harness.specs import gpt, token_batches
    from harness.systems import compiled, plain_step
    s, system, budget = spec["s"], spec["system"], spec["budget"]
    model = partial(gpt, spec["n_layer"], s["d"], s["vocab"], s["seq"])
    data = token_batches(s["vocab"], s["batch"], s["seq"], 4, seed=1)
    if system == "probe":
        m = pscompile.min_device_memory(model(), data[0], pscompile.Config(device="cpu", dtype=torch.float32))
        return dict(budget=int(1.15 * m))
    programs = _Programs()
    t0 = time.perf_counter()
    engine = None
    if system == "plain torch.compile":
        step = plain_step(model(), "inductor")
    else:
        backend = "eager" if "eager" in system else "inductor"
        engine = compiled(model(), data[0], backend, budget)
        if system.endswith("resume") and spec["second"]:
            pscompile.load(engine, spec["checkpoint"])
        step = engine.step
    times, ends = [], []
    for i in range(STEPS):
        t = time.perf_counter()
        step(data[i % len(data)])
        times.append(time.perf_counter() - t)
        ends.append(time.perf_counter() - t0)
    k = steady_at(times)
    out = dict(steady_step=k, to_steady_s=ends[k], step_s=times, compiled=programs.compiled, loaded=programs.loaded)
    if engine is not None:
        out["compiled_share"] = engine.stats.compiled_share
        if system.endswith("resume") and not spec["second"]:
            pscompile.save(engine, spec["checkpoint"])
        engine.close()
    return out


def _pair(system: str, n_layer: int, s: dict, budget: int | None, timeout: float, repeats: int) -> list[dict]:
    """Process 1 of ``system``, then ``repeats`` processes 2 in turn, one Inductor cache folder
    between them all (each process 2 finds it as process 1 left it: a rerun and a resume keep
    nothing new)."""
    with tempfile.TemporaryDirectory(prefix="pscompile-warm-") as cache:
        env = {"TORCHINDUCTOR_CACHE_DIR": cache}
        out = []
        for second in (False, *[True] * repeats):
            spec = dict(system=system, n_layer=n_layer, s=s, budget=budget, second=second,
                        checkpoint=f"{cache}/resume.pscompile")
            try:
                out.append(run_fresh(__file__, spec, timeout=timeout, env=env, threads=1))
            except ChildFailed as e:
                raise SystemExit(f"{system} L{n_layer} failed:\n{e.tail}") from None
        return out


def main(argv=None) -> int:
    ap = parser(__doc__, "warm_start", markdown=True, child=True)
    ap.add_argument("--layers", type=int, nargs="+", default=[4])
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per process")
    ap.add_argument("--repeats", type=int, default=3, help="processes 2 per system (their median is compared)")
    args = ap.parse_args(argv)
    if child(args.child, _child):
        return 0
    s = QUICK if args.quick else SHAPE
    systems = SYSTEMS[:2] if args.quick else SYSTEMS
    rows, raw = [], []
    for n_layer in [2] if args.quick else args.layers:
        with tempfile.TemporaryDirectory() as cache:
            probe = run_fresh(__file__, dict(system="probe", n_layer=n_layer, s=s, budget=None), threads=1,
                              env={"TORCHINDUCTOR_CACHE_DIR": cache})
        plain = None
        for system in systems:
            first, *seconds = _pair(system, n_layer, s, None if system.startswith("plain") else probe["budget"],
                                    args.timeout, args.repeats)
            times = sorted(x["to_steady_s"] for x in seconds)
            median, second = statistics.median(times), seconds[-1]
            plain = plain or median
            raw.append(dict(system=system, n_layer=n_layer, budget=probe["budget"], first=first, second=seconds))
            rows.append([n_layer, system, f"{first['to_steady_s']:.1f}", f"{median:.1f} ({times[0]:.1f}-{times[-1]:.1f})",
                         f"{median / plain:.2f}", f"{first['compiled']}/{first['loaded']}",
                         "; ".join(sorted({f"{x['compiled']}/{x['loaded']}" for x in seconds})),
                         f"{second.get('compiled_share', 1.0):.2f}"])
            print(f"L{n_layer} {system}: {first['to_steady_s']:.1f} s, then {[round(t, 1) for t in times]} s", flush=True)
    headers = ["layers", "system", "process 1 s", "process 2 s, median (range)", "process 2 / torch.compile's",
               "programs compiled/loaded, 1", "2", "compiled share, 2"]
    caption = ("seconds to a steady step (model built, compiled, trained to the first steady step), two processes in "
               "turn sharing one Inductor cache; pscompile at 1.15x its named minimum; float32, one thread")
    from tabulate import tabulate
    print(caption)
    print(tabulate(rows, headers=headers, disable_numparse=True))
    if args.markdown:
        print("\n" + caption + "\n")
        print(tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True))
    write_json(args.out, dict(settings=s, rows=raw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
