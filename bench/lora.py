"""LoRA beside full fine-tuning (issue 61): bytes, checkpoint, step time vs peers, capacity.

A Hugging Face Llama from its config (4 layers, 256 wide, 4 heads with 2 key/value heads,
vocabulary 2048: 3.98M parameters), bf16, batch 2 x 64; LoRA is ``peft``'s, r=8 on ``q_proj`` and
``v_proj``. For each run: host model bytes of hooks and compiled mode against 1.1 x (bf16 base +
14 B per trainable parameter), the model data, each mode's minimum budget; ``pscompile.save``'s
checkpoint against plain PyTorch + peft's files; the warm step (median after the first two) over
plain PyTorch + peft's (``ReferenceTrainer``, interleaved): both modes at 1.15x their minimum,
FSDP2 with CPU offload on one gloo rank, and (not with ``--quick``) DeepSpeed ZeRO-3 offload in a
process of its own; and (not with ``--quick``) the largest base each fine-tunes on one fixed
machine (the planner: 1 GPU with 64 MiB for the plan, 250 MB of CPU memory, GPT d=512 by depth).

    python bench/lora.py [--quick] [--threads N] [--out bench/results/lora.json]
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import multiprocessing
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

import pscompile
from harness.output import parser, table, write_json
from harness.runs import cpu_config
from harness.specs import adamw, gpt_config, token_batches
from harness.timing import interleave
from pscompile.testing import ReferenceTrainer

HP = adamw(1e-3, weight_decay=0.0)
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
    return [{"input_ids": ids, "labels": ids} for ids, _ in token_batches(2048, 2, 64, n)]


def plain_files(lora: bool, batch: dict, folder: Path) -> int:
    """Bytes of plain PyTorch + peft's checkpoint: optimizer state_dict and adapter (or model)."""
    folder.mkdir(parents=True)
    model = llama(lora)
    opt = _optimizer(model)
    model(**batch).loss.backward()
    opt.step()
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    model.save_pretrained(folder / "model")
    weights = (folder / "model").glob("*.safetensors")
    return (folder / "optimizer.pt").stat().st_size + sum(f.stat().st_size for f in weights)


def _optimizer(model) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=HP.lr, betas=HP.betas,
                             eps=HP.eps, weight_decay=HP.weight_decay)


def fsdp2(lora: bool):
    """FSDP2 as bench/cudabench/peers.py runs it on the CPU: each decoder layer and the root sharded over a
    one-rank mesh, fp32 parameters on the host, bf16 compute; call inside ``cudabench.peers.one_rank``."""
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
    losses: dict[str, list[float]] = {name: [] for name in systems}

    def on_batch(name, step):
        return lambda i: losses[name].append(float(step(data[i])))
    return interleave({name: on_batch(name, step) for name, step in systems.items()}, len(data)), losses


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
    from cudabench import peers
    torch.set_num_threads(threads)
    try:
        deepspeed = peers.deepspeed_module()
    except peers.Unavailable as e:
        return {"unavailable": str(e)}
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    cfg = peers.deepspeed_config({"batch": 2}, torch.bfloat16, HP, "cpu")      # (ZeRO-3, both offloaded)
    # plain's steps first: deepspeed.initialize patches torch (F.linear, module hooks) for the
    # rest of the process (bench/cudabench/peers.py), and a plain step after it would not be plain
    ref = ReferenceTrainer(llama(lora), optimizer=HP, dtype=torch.bfloat16)
    data = batches(steps)
    times, losses = timed({PLAIN: ref.step}, data)
    with peers.one_rank("cpu"), open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        model = llama(lora, torch.float32)
        try:
            trainable = [p for p in model.parameters() if p.requires_grad]
            engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=trainable)
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
    from cudabench import peers
    data = batches(steps)
    model = llama(lora)
    base = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    row = {"run": "LoRA r=8 (q_proj, v_proj)" if lora else "full fine-tuning", "params": base, "trainable": trainable,
           "target_host_bytes": 2 * base + 14 * trainable}
    ref = ReferenceTrainer(llama(lora), optimizer=HP, dtype=torch.bfloat16)
    engines = {}
    for mode in ("hooks", "compiled"):
        config = cpu_config(mode, dtype=torch.bfloat16)
        minimum = pscompile.min_device_memory(llama(lora), data[0], config)
        engine = pscompile.compile(llama(lora), data[0], optimizer=HP,
                                   config=dataclasses.replace(config, device_memory=int(1.15 * minimum)))
        row[f"{mode}_min_device_memory"] = minimum
        row[f"{mode}_host_model_bytes"] = engine.store.host_model_bytes()
        row[f"{mode}_model_data"] = sum(engine.model_data().values())
        engines[mode] = engine
    comp, fetches = engines["compiled"], []

    def compiled_step(b):
        loss = comp.step(b)
        fetches.append(comp.stats.num_fetches)
        assert comp.stats.peak_device_bytes <= comp.budget, "over the budget"
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
        for key in ("step_vs_plain", "loss_diff_vs_plain"):
            row[key]["DeepSpeed"] = ds[key]["DeepSpeed"]
    row["checkpoint_bytes"] = pscompile.save(comp, folder / f"{lora}.ckpt").stat().st_size
    row["checkpoint_with_base_bytes"] = pscompile.save(comp, folder / f"{lora}-base.ckpt",
                                                       frozen_weights=True).stat().st_size
    row["plain_checkpoint_bytes"] = plain_files(lora, data[0], folder / f"plain-{lora}")
    for e in engines.values():
        e.close()
    return row


def capacity() -> dict:
    """The largest GPT (d=512, by depth) each run fine-tunes on one machine, by the planner."""
    from pscompile.planner import LoRA, hardware_preset, search
    hw = dataclasses.replace(hardware_preset("yard"), gpus=1, gpu_memory=2**30 + 64 * 2**20, cpu_memory=250 * 10**6)
    cfg = gpt_config(1, 512, 256, 128)
    out = {}
    for name, lora in (("full fine-tuning", None), ("LoRA r=8 (c_attn)", LoRA(8, ("c_attn",)))):
        res = search(cfg, (2, 128), dimension="depth", hardware=hw, config=pscompile.Config(device="cpu"),
                     upper=64, lora=lora)
        out[name] = {"layers": res.value, "params": res.report.params if res.report else 0}
    return out


def main(argv=None) -> int:
    ap = parser(__doc__, "lora", quick="5 steps; no DeepSpeed, no capacity search")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    steps = 5 if args.quick else 12
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(lora, steps, Path(tmp), args.threads, not args.quick) for lora in (False, True)]
    mib = 2**20
    print(table([[r["run"], f"{r['trainable']:,} / {r['params']:,}",
                  " / ".join(f"{r[f'{m}_host_model_bytes'] / mib:.1f}" for m in ("hooks", "compiled"))
                  + f" ({r['compiled_host_model_bytes'] / r['target_host_bytes']:.2f})",
                  f"{r['hooks_min_device_memory'] / mib:.2f} / {r['compiled_min_device_memory'] / mib:.2f}",
                  f"{r['checkpoint_bytes'] / mib:.2f} ({r['checkpoint_bytes'] / r['plain_checkpoint_bytes']:.2f})"]
                 for r in rows],
                ["run", "trainable / params", "host model MiB hooks / compiled (/ target)",
                 "minimum MiB hooks / compiled", "checkpoint MiB (/ plain)"]))
    print()
    peers_ = ("hooks", "compiled", "FSDP2", "DeepSpeed")
    print(table([[r["run"], f"{r['step_ms'][PLAIN]:.0f}"] + [
        f"{r['step_vs_plain'][p]:.2f}" if p in r["step_vs_plain"] else "not run" for p in peers_] for r in rows],
                ["run", "plain step ms"] + [f"{p} / plain" for p in peers_]))
    for r in rows:
        if "deepspeed_unavailable" in r:
            print(f"DeepSpeed ({r['run']}): {r['deepspeed_unavailable']}")
    cap = None if args.quick else capacity()
    if cap is not None:
        print(table([[k, v["layers"], f"{v['params'] / 1e6:.1f}M"] for k, v in cap.items()],
                    ["on 64 MiB GPU + 250 MB CPU (planner)", "largest depth (d=512)", "parameters"]))
    write_json(args.out, {"rows": rows, "capacity": cap, "threads": args.threads, "torch": torch.__version__})
    return 0


if __name__ == "__main__":
    sys.exit(main())
