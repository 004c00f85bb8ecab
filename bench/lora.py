"""LoRA beside full fine-tuning (issue 61): bytes, checkpoint, step time, capacity.

The issue's model: a Hugging Face Llama built from its config (4 layers, 256 wide, 4 heads with 2
key/value heads, vocabulary 2048: 3.98M parameters), bf16, batch 2 x 64. Full fine-tuning trains
every parameter; LoRA is ``peft``'s, r=8 on ``q_proj`` and ``v_proj`` (28,672 parameters train).
For each, in one run:

- host model data (``engine.model_data()``, every chunk on its home tier) against the target
  1.1 x (compute-dtype base + 14 bytes per trainable parameter);
- the named minimum device budget (``pscompile.min_device_memory``, hooks and compiled mode);
- the checkpoint ``pscompile.save`` writes, against plain PyTorch + peft's files (the optimizer's
  ``state_dict`` and the adapter, as the Trainer writes them; for full fine-tuning the optimizer's
  and the model's);
- the warm step (median of the steps after the first two) of plain PyTorch + peft (no budget,
  ``torch.optim.AdamW`` on the trainable parameters, through ``pscompile.testing.ReferenceTrainer``)
  and of pscompile's hooks and compiled (eager) modes at 1.15x their minimum, which evicts every
  step, as ratios to plain PyTorch's, the systems' steps interleaved;
- the largest base each fine-tunes on one fixed machine (the planner: 1 GPU with 64 MiB for the
  plan, 250 MB of CPU memory, GPT d=512 by depth), unless ``--quick``.

FSDP2 and DeepSpeed are not run here (DeepSpeed is not installed on this machine; FSDP2's CPU path
with frozen parameters is not wired into this bench): no claim about them.

    python bench/lora.py [--quick] [--out bench/results/lora.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tabulate import tabulate

import pscompile
from pscompile.testing import ReferenceTrainer

DEFAULT_OUT = Path(__file__).parent / "results" / "lora.json"
HP = pscompile.AdamW(lr=1e-3, weight_decay=0.0)


def llama(lora: bool):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    return get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"])) if lora else model


def batches(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 2048, (2, 64), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def config(mode: str, budget=None) -> pscompile.Config:
    return pscompile.Config(mode=mode, backend="eager", device="cpu", dtype=torch.bfloat16, device_memory=budget)


def plain_files(lora: bool, batch: dict, folder: Path) -> int:
    """Bytes of plain PyTorch + peft's checkpoint: optimizer state_dict and adapter (or model)."""
    folder.mkdir(parents=True)
    model = llama(lora)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model(**batch).loss.backward()
    opt.step()
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    model.save_pretrained(folder / "model")
    return (folder / "optimizer.pt").stat().st_size + sum(f.stat().st_size for f in (folder / "model").glob("*.safetensors"))


def measure(lora: bool, steps: int, folder: Path) -> dict:
    data = batches(steps)
    model = llama(lora)
    base = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    row = {"run": "LoRA r=8 (q_proj, v_proj)" if lora else "full fine-tuning", "params": base, "trainable": trainable,
           "target_host_bytes": 2 * base + 14 * trainable}
    ref = ReferenceTrainer(llama(lora), optimizer=HP, dtype=torch.bfloat16)
    systems = {"plain PyTorch + peft": ref.step}
    for mode in ("hooks", "compiled"):
        minimum = pscompile.min_device_memory(llama(lora), data[0], config(mode))
        engine = pscompile.compile(llama(lora), data[0], optimizer=HP, config=config(mode, int(1.15 * minimum)))
        row[f"{mode}_min_device_memory"] = minimum
        row[f"{mode}_model_data"] = sum(engine.model_data().values())
        systems[mode] = engine
    times: dict[str, list[float]] = {name: [] for name in systems}
    fetches = []
    for b in data:                                  # interleaved: each system's step on the same batch
        for name, s in systems.items():
            t0 = time.perf_counter()
            s(b) if callable(s) else s.step(b)
            times[name].append(time.perf_counter() - t0)
            if name == "compiled":
                fetches.append(s.stats.num_fetches)
                assert s.stats.peak_device_bytes <= s.budget, "over the budget"
    warm = {name: statistics.median(t[2:]) for name, t in times.items()}
    row["step_ms"] = {name: 1e3 * v for name, v in warm.items()}
    row["step_vs_plain"] = {name: v / warm["plain PyTorch + peft"] for name, v in warm.items()}
    row["compiled_fetches_per_step"] = min(fetches)
    engine = systems["compiled"]
    row["checkpoint_bytes"] = pscompile.save(engine, folder / f"{lora}.ckpt").stat().st_size
    row["checkpoint_with_base_bytes"] = pscompile.save(engine, folder / f"{lora}-base.ckpt",
                                                       frozen_weights=True).stat().st_size
    row["plain_checkpoint_bytes"] = plain_files(lora, data[0], folder / f"plain-{lora}")
    for name in ("hooks", "compiled"):
        systems[name].close()
    return row


def capacity() -> dict:
    """The largest GPT (d=512, by depth) each run fine-tunes on one machine, by the planner."""
    from pscompile.models.gpt import GPTConfig
    from pscompile.planner import LoRA, hardware_preset, search
    hw = dataclasses.replace(hardware_preset("yard"), gpus=1, gpu_memory=2**30 + 64 * 2**20, cpu_memory=250 * 10**6)
    cfg = GPTConfig(n_layer=1, n_head=8, d_model=512, vocab_size=256, seq_len=128)
    out = {}
    for name, lora in (("full fine-tuning", None), ("LoRA r=8 (c_attn)", LoRA(8, ("c_attn",)))):
        res = search(cfg, (2, 128), dimension="depth", hardware=hw, config=pscompile.Config(device="cpu"),
                     upper=64, lora=lora)
        out[name] = {"layers": res.value, "params": res.report.params if res.report else 0}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 steps, no capacity search")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    steps = 5 if args.quick else 12
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(lora, steps, Path(tmp)) for lora in (False, True)]
    mib = 2**20
    print(tabulate([[r["run"], f"{r['trainable']:,} / {r['params']:,}",
                     f"{r['compiled_model_data'] / mib:.1f} ({r['compiled_model_data'] / r['target_host_bytes']:.2f})",
                     f"{r['hooks_min_device_memory'] / mib:.2f} / {r['compiled_min_device_memory'] / mib:.2f}",
                     f"{r['checkpoint_bytes'] / mib:.2f} ({r['checkpoint_bytes'] / r['plain_checkpoint_bytes']:.2f})",
                     f"{r['step_ms']['plain PyTorch + peft']:.0f}",
                     f"{r['step_vs_plain']['hooks']:.2f} / {r['step_vs_plain']['compiled']:.2f}"] for r in rows],
                   headers=["run", "trainable / params", "model data MiB (/ target)", "minimum MiB hooks / compiled",
                            "checkpoint MiB (/ plain)", "plain step ms", "hooks / compiled step vs plain"],
                   tablefmt="github"))
    cap = None if args.quick else capacity()
    if cap is not None:
        print(tabulate([[k, v["layers"], f"{v['params'] / 1e6:.1f}M"] for k, v in cap.items()],
                       headers=["on 64 MiB GPU + 250 MB CPU (planner)", "largest depth (d=512)", "parameters"],
                       tablefmt="github"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "capacity": cap, "torch": torch.__version__}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
