"""LoRA beside full fine-tuning (issue 61): bytes, checkpoint, step time vs peers, capacity.

The issue's model: a Hugging Face Llama built from its config (4 layers, 256 wide, 4 heads with 2
key/value heads, vocabulary 2048: 3.98M parameters), bf16, batch 2 x 64. Full fine-tuning trains
every parameter; LoRA is ``peft``'s, r=8 on ``q_proj`` and ``v_proj`` (28,672 parameters train).
For each, in one run (``--threads`` torch threads, 1 by default):

- host model bytes (``engine.store.host_model_bytes()``, as ``engine.describe()`` prints them) of
  hooks and compiled mode against the target 1.1 x (compute-dtype base + 14 bytes per trainable
  parameter), and the model data on every tier (``engine.model_data()``);
- the named minimum device budget (``pscompile.min_device_memory``, hooks and compiled mode);
- the checkpoint ``pscompile.save`` writes (the trainable state and a record of the frozen base),
  against plain PyTorch + peft's files (the optimizer's ``state_dict`` and the adapter, as the
  Trainer writes them; for full fine-tuning the optimizer's and the model's);
- the warm step (median of the steps after the first two), as a ratio to plain PyTorch + peft's
  (no budget, fp32 masters, ``torch.optim.AdamW`` on the trainable parameters, through
  ``pscompile.testing.ReferenceTrainer``) measured with it: pscompile's hooks and compiled (eager
  backend) modes at 1.15x their minimum, which evicts every step; FSDP2 (``fully_shard`` on each
  decoder layer and the root, one gloo rank, ``CPUOffloadPolicy(pin_memory=False)``, bf16 compute
  over fp32 parameters; bench/peers.py's setup) -- these four interleaved with plain's steps in
  this process -- and DeepSpeed ZeRO-3 with parameters and optimizer offloaded to the host
  (``DeepSpeedCPUAdam``), in a process of its own (ZeRO-3 patches torch), against plain's steps
  taken there before ``deepspeed.initialize``, when ``import deepspeed`` works (else the row says
  why); not with ``--quick``;
- the largest base each fine-tunes on one fixed machine (the planner: 1 GPU with 64 MiB for the
  plan, 250 MB of CPU memory, GPT d=512 by depth), unless ``--quick``.

    python bench/lora.py [--quick] [--threads N] [--out bench/results/lora.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import multiprocessing
import os
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
PLAIN = "plain PyTorch + peft"


def llama(lora: bool, dtype: torch.dtype = torch.bfloat16):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).to(dtype)
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


def _optimizer(model) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=HP.lr, betas=HP.betas,
                             eps=HP.eps, weight_decay=HP.weight_decay)


def fsdp2(lora: bool):
    """FSDP2 as bench/peers.py runs it on the CPU: each decoder layer and the root sharded over a
    one-rank mesh, fp32 parameters on the host, bf16 compute; call inside ``peers.one_rank``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    model = llama(lora, torch.float32)
    kw = dict(mesh=init_device_mesh("cpu", (1,)), offload_policy=CPUOffloadPolicy(pin_memory=False),
              mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    for layer in (model.base_model.model if lora else model).model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    opt = _optimizer(model)

    def step(batch) -> float:
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())
    return step


def timed(systems: dict, data: list) -> tuple[dict, dict]:
    """Each system's step on each batch in turn: (step times, losses) by system."""
    times: dict[str, list[float]] = {name: [] for name in systems}
    losses: dict[str, list[float]] = {name: [] for name in systems}
    for b in data:
        for name, step in systems.items():
            t0 = time.perf_counter()
            losses[name].append(float(step(b)))
            times[name].append(time.perf_counter() - t0)
    return times, losses


def summary(times: dict, losses: dict) -> dict:
    """Warm median (steps after the first two), its ratio to plain's, the largest loss difference."""
    warm = {name: statistics.median(t[2:]) for name, t in times.items()}
    return {"step_ms": {n: 1e3 * v for n, v in warm.items()},
            "step_vs_plain": {n: v / warm[PLAIN] for n, v in warm.items()},
            "loss_diff_vs_plain": {n: max(abs(a - b) for a, b in zip(ls, losses[PLAIN])) for n, ls in losses.items()}}


def deepspeed_row(lora: bool, steps: int, threads: int) -> dict:
    """DeepSpeed ZeRO-3 offload and plain PyTorch + peft (its steps first), in a process of their own."""
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(_deepspeed_child, lora, steps, threads).result()


def _deepspeed_child(lora: bool, steps: int, threads: int) -> dict:
    import peers
    torch.set_num_threads(threads)
    try:
        deepspeed = peers.deepspeed_module()
    except peers.Unavailable as e:
        return {"unavailable": str(e)}
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": False},
                                 "offload_optimizer": {"device": "cpu", "pin_memory": False}},
           "optimizer": {"type": "AdamW", "params": {"lr": HP.lr, "betas": list(HP.betas), "eps": HP.eps,
                                                     "weight_decay": HP.weight_decay}},
           "steps_per_print": 1 << 30, "wall_clock_breakdown": False}
    # plain's steps first: deepspeed.initialize patches torch (F.linear, module hooks) for the
    # rest of the process (bench/peers.py), and a plain step after it would not be plain
    ref = ReferenceTrainer(llama(lora), optimizer=HP, dtype=torch.bfloat16)
    data = batches(steps)
    times, losses = timed({PLAIN: ref.step}, data)
    with peers.one_rank("cpu"), open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        model = llama(lora, torch.float32)
        try:
            engine, *_ = deepspeed.initialize(model=model, config=cfg,
                                              model_parameters=[p for p in model.parameters() if p.requires_grad])
        except Exception as e:      # noqa: BLE001 -- e.g. its host Adam cannot be built here
            return {"unavailable": f"deepspeed.initialize failed ({type(e).__name__}: {str(e).splitlines()[0][:160]})"}

        def step(batch) -> float:
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            return float(loss.detach())
        ds_times, ds_losses = timed({"DeepSpeed": step}, data)
    return summary(times | ds_times, losses | ds_losses)


def measure(lora: bool, steps: int, folder: Path, threads: int, with_deepspeed: bool) -> dict:
    import peers
    data = batches(steps)
    model = llama(lora)
    base = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    row = {"run": "LoRA r=8 (q_proj, v_proj)" if lora else "full fine-tuning", "params": base, "trainable": trainable,
           "target_host_bytes": 2 * base + 14 * trainable}
    ref = ReferenceTrainer(llama(lora), optimizer=HP, dtype=torch.bfloat16)
    systems = {PLAIN: ref.step}
    engines = {}
    for mode in ("hooks", "compiled"):
        minimum = pscompile.min_device_memory(llama(lora), data[0], config(mode))
        engine = pscompile.compile(llama(lora), data[0], optimizer=HP, config=config(mode, int(1.15 * minimum)))
        row[f"{mode}_min_device_memory"] = minimum
        row[f"{mode}_host_model_bytes"] = engine.store.host_model_bytes()
        row[f"{mode}_model_data"] = sum(engine.model_data().values())
        systems[mode] = engines[mode] = engine
    fetches = []

    def compiled_step(b):
        loss = engines["compiled"].step(b)
        fetches.append(engines["compiled"].stats.num_fetches)
        assert engines["compiled"].stats.peak_device_bytes <= engines["compiled"].budget, "over the budget"
        return loss
    systems = {PLAIN: ref.step, "hooks": engines["hooks"].step, "compiled": compiled_step}
    with peers.one_rank("cpu"):
        systems["FSDP2"] = fsdp2(lora)
        row.update(summary(*timed(systems, data)))
    row["compiled_fetches_per_step"] = min(fetches)
    ds = deepspeed_row(lora, steps, threads) if with_deepspeed else {"unavailable": "not run (--quick)"}
    if "unavailable" in ds:
        row["deepspeed_unavailable"] = ds["unavailable"]
    else:
        row["deepspeed"] = ds
        row["step_vs_plain"]["DeepSpeed"] = ds["step_vs_plain"]["DeepSpeed"]
        row["loss_diff_vs_plain"]["DeepSpeed"] = ds["loss_diff_vs_plain"]["DeepSpeed"]
    engine = engines["compiled"]
    row["checkpoint_bytes"] = pscompile.save(engine, folder / f"{lora}.ckpt").stat().st_size
    row["checkpoint_with_base_bytes"] = pscompile.save(engine, folder / f"{lora}-base.ckpt",
                                                       frozen_weights=True).stat().st_size
    row["plain_checkpoint_bytes"] = plain_files(lora, data[0], folder / f"plain-{lora}")
    for e in engines.values():
        e.close()
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
    ap.add_argument("--quick", action="store_true", help="5 steps; no DeepSpeed, no capacity search")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    steps = 5 if args.quick else 12
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(lora, steps, Path(tmp), args.threads, not args.quick) for lora in (False, True)]
    mib = 2**20
    print(tabulate([[r["run"], f"{r['trainable']:,} / {r['params']:,}",
                     " / ".join(f"{r[f'{m}_host_model_bytes'] / mib:.1f}" for m in ("hooks", "compiled"))
                     + f" ({r['compiled_host_model_bytes'] / r['target_host_bytes']:.2f})",
                     f"{r['hooks_min_device_memory'] / mib:.2f} / {r['compiled_min_device_memory'] / mib:.2f}",
                     f"{r['checkpoint_bytes'] / mib:.2f} ({r['checkpoint_bytes'] / r['plain_checkpoint_bytes']:.2f})"]
                    for r in rows],
                   headers=["run", "trainable / params", "host model MiB hooks / compiled (/ target)",
                            "minimum MiB hooks / compiled", "checkpoint MiB (/ plain)"], tablefmt="github"))
    print()
    peers_ = ("hooks", "compiled", "FSDP2", "DeepSpeed")
    print(tabulate([[r["run"], f"{r['step_ms'][PLAIN]:.0f}"] + [
        f"{r['step_vs_plain'][p]:.2f}" if p in r["step_vs_plain"] else "not run" for p in peers_] for r in rows],
                   headers=["run", "plain step ms"] + [f"{p} / plain" for p in peers_], tablefmt="github"))
    for r in rows:
        if "deepspeed_unavailable" in r:
            print(f"DeepSpeed ({r['run']}): {r['deepspeed_unavailable']}")
    cap = None if args.quick else capacity()
    if cap is not None:
        print(tabulate([[k, v["layers"], f"{v['params'] / 1e6:.1f}M"] for k, v in cap.items()],
                       headers=["on 64 MiB GPU + 250 MB CPU (planner)", "largest depth (d=512)", "parameters"],
                       tablefmt="github"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "capacity": cap, "threads": args.threads,
                                    "torch": torch.__version__}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
