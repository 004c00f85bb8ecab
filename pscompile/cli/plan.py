"""``python -m pscompile plan``: does a GPT train on a machine, how fast, with what settings.

Plans on fake tensors (nothing is allocated, no GPU is needed) through ``pscompile.plan``; with
``--search`` finds the largest depth, width or batch that fits. It plans the project's GPT only
(``pscompile.plan`` takes any model from Python). A machine is a preset (``--hardware``, default
``yard``) with any of its sizes overridden; the report starts with the machine it assumed, each size
in bytes. Every size is read one way: "GB" is 10^9 bytes, "GiB" 2^30 (``--gpu-memory 32GB`` is
32 * 10^9 bytes, 29.8 GiB; a V100's "32 GB" is ``--gpu-memory 32GiB``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pscompile.cli.flags import SIZE_RULE, add_flag, check_output, size_flag
from pscompile.config import Config
from pscompile.checkpoint.files import write_atomic
from pscompile.models.gpt import GPTConfig
from pscompile.planner import HARDWARE, Hardware, LoRA, hardware_preset, plan, search
from pscompile.planner.search import DIMENSIONS
from pscompile.units import parse_size

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
DEFAULT_HARDWARE = "yard"


# the model and batch, named as every command names them: (flag, its old name = the dest, default, help)
_SHAPE_FLAGS = (("--d-model", "hidden", 4096, "hidden size"),
                ("--n-layer", "layers", 60, "transformer blocks"),
                ("--n-head", "heads", 32, "attention heads; must divide --d-model"),
                ("--vocab-size", "vocab", 50304, "token vocabulary (GPT-2's, padded)"),
                ("--seq-len", "seq", 1024, "tokens per sequence"),
                ("--batch-size", "batch", 8, "sequences per GPU per step"))


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt", choices=("gpt",), help="model family (GPT, nanoGPT style)")
    for name, old, default, what in _SHAPE_FLAGS:
        add_flag(p, name, old=(f"--{old}",), dest=old, metavar="N", type=int, default=default,
                 help=f"{what} (default {default})")
    p.add_argument("--hardware", default=None, choices=sorted(HARDWARE),
                   help=f"a preset machine; the flags below override its sizes (default {DEFAULT_HARDWARE}: "
                        f"{HARDWARE[DEFAULT_HARDWARE].note})")
    p.add_argument("--gpus", metavar="N", type=int, default=None,
                   help="GPUs of the node to use, ZeRO over them (default: the preset's)")
    p.add_argument("--gpu-memory", metavar="SIZE", type=size_flag("--gpu-memory"), default=None,
                   help=f"per GPU, e.g. 32GiB or 80GB ({SIZE_RULE}; default: the preset's)")
    p.add_argument("--cpu-memory", metavar="SIZE", type=size_flag("--cpu-memory"), default=None,
                   help=f"the node's, e.g. 240GB ({SIZE_RULE}; default: the preset's)")
    p.add_argument("--disk", metavar="SIZE", type=size_flag("--disk"), default=None,
                   help=f"disk for optimizer states, e.g. 2TB ({SIZE_RULE}; default: the preset's)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES),
                   help="compute dtype of the planned GPU run (default bfloat16, as Config's: the dtype for a GPU; "
                        "float16 plans the same bytes)")
    p.add_argument("--activations", default="auto", choices=("auto", "keep", "recompute", "offload"),
                   help="saved activations: keep, recompute, offload, or auto (the fewest taken off that fit; default)")
    p.add_argument("--chunk-size", metavar="N|auto", default="auto", help="elements per chunk, or auto (default)")
    p.add_argument("--search", default=None, choices=DIMENSIONS,
                   help="the largest depth (layers), width (hidden, steps of 256) or batch that fits")
    p.add_argument("--min-tflops", metavar="X", type=float, default=0.0,
                   help="with --search: also require this estimated TFLOP/s per GPU (default 0)")
    p.add_argument("--lora-rank", metavar="R", type=int, default=0,
                   help="plan a LoRA fine-tune: the base frozen (its compute-dtype bytes only), rank-R adapters "
                        "on --lora-targets (default 0: every parameter trains)")
    p.add_argument("--lora-targets", metavar="NAMES", default="c_attn",
                   help="with --lora-rank: the projections to adapt, comma-separated (default c_attn: q, k and v)")
    p.add_argument("--frozen-format", default="compute", choices=("compute", "nf4"),
                   help="frozen weights at home and over PCIe: compute (the compute dtype; default) or nf4 (every "
                        "frozen linear weight in 4 bits, QLoRA's base; Config(frozen_format=...))")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the report(s) as JSON to PATH")


def _size(n: int | None) -> str:
    """A byte count in both units: '22.4 GiB = 24.0 GB (24,000,000,000 bytes)'."""
    if n is None:
        return "none"
    big = n >= 2**40
    return (f"{n / 2**(40 if big else 30):,.1f} {'TiB' if big else 'GiB'} = "
            f"{n / (1e12 if big else 1e9):,.1f} {'TB' if big else 'GB'} ({n:,} bytes)")


def machine_lines(args: argparse.Namespace, hw: Hardware) -> list[str]:
    """The machine the plan assumes: the preset (and whether it was the default), each size in
    bytes and both units, and where it came from."""
    given = ("--hardware" if args.hardware else
             f"assumed: the default; --hardware picks one of {', '.join(sorted(HARDWARE))}")
    lines = [f"machine: preset {hw.name!r} ({given}): {hw.note}"]
    for what, flag, value, text in (("GPUs", "--gpus", hw.gpus, args.gpus),
                                    ("GPU memory", "--gpu-memory", _size(hw.gpu_memory) + " each", args.gpu_memory),
                                    ("CPU memory", "--cpu-memory", _size(hw.cpu_memory), args.cpu_memory),
                                    ("disk", "--disk", _size(hw.disk), args.disk)):
        source = "the preset's" if text is None else f"{flag} {text}"
        lines.append(f"  {what:<11} {value} ({source})")
    return lines


def machine(args: argparse.Namespace) -> Hardware:
    """The preset (``--hardware``, default ``yard``) with the flags' counts and sizes."""
    preset = hardware_preset(args.hardware or DEFAULT_HARDWARE)
    if args.gpu_memory is not None and parse_size(args.gpu_memory, "--gpu-memory") <= preset.reserved:
        raise ValueError(f"--gpu-memory {args.gpu_memory} leaves nothing after the {_size(preset.reserved)} each GPU "
                         f"keeps for the CUDA context; give more, e.g. --gpu-memory 24GiB")
    return preset.with_(gpus=args.gpus, gpu_memory=args.gpu_memory, cpu_memory=args.cpu_memory, disk=args.disk)


def plan_command(args: argparse.Namespace) -> int:
    check_output(args.json, "--json")
    hw = machine(args)
    print("\n".join(machine_lines(args, hw)), flush=True)
    chunk = args.chunk_size if args.chunk_size == "auto" else int(args.chunk_size)
    config = Config(device="cpu", dtype=_DTYPES[args.dtype], activations=args.activations, chunk_size=chunk,
                    frozen_format=args.frozen_format)
    cfg = GPTConfig(n_layer=args.layers, n_head=args.heads, d_model=args.hidden, vocab_size=args.vocab,
                    seq_len=args.seq)
    lora = LoRA(args.lora_rank, tuple(t for t in args.lora_targets.split(",") if t)) if args.lora_rank else None
    if args.search is None:
        report = plan(cfg, (args.batch, args.seq), hardware=hw, config=config, lora=lora)
        print(report.format())
        out = report.as_dict()
    else:
        def progress(v, r):
            print(f"  {args.search} {v}: {r.params / 1e9:.2f}B parameters, "
                  f"{'fits' if r.fits else 'does not fit'}, {r.tflops_per_gpu:.1f} TFLOP/s per GPU "
                  f"({r.plan_s:.0f} s)", flush=True)
        res = search(cfg, (args.batch, args.seq), dimension=args.search, hardware=hw, config=config,
                     min_tflops=args.min_tflops, on_plan=progress, lora=lora)
        if res.report is None:
            print(f"not even the smallest {args.search} fits on {hw.describe()}")
        else:
            print(f"largest {args.search}: {res.value}")
            print(res.report.format())
        out = {"dimension": res.dimension, "value": res.value, "tried": res.tried,
               "report": None if res.report is None else res.report.as_dict()}
    out["machine"] = {"preset": hw.name, "assumed": args.hardware is None, "gpus": hw.gpus,
                      "gpu_memory": hw.gpu_memory, "cpu_memory": hw.cpu_memory, "disk": hw.disk}
    if args.json:
        write_atomic(Path(args.json), json.dumps(out, indent=1, default=str).encode())
    return 0
