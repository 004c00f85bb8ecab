"""Held out: Hugging Face causal LMs nobody here wrote, with the default backend at each budget.

Qwen2, Gemma, Phi-3, Falcon, BLOOM, Mixtral (4 experts, top-2), GPT-J (``rotary_dim=16``) and
StableLM, each built from its config class (``use_cache=False``, vocabulary 256, hidden 64, 2
layers, 4 heads, no dropout, intermediate 128 and 2 KV heads where the config has them), batches of
2 x 32 tokens with ``labels``, ``pscompile.AdamW(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)``,
compiled mode with Inductor, one thread, ``STEPS`` steps at ``min_device_memory(...)`` times each
factor, in the compute dtype of ``--dtype``. A cell gives the largest peak over the budget of every
step (it must stay at most 1), the share of compute operators that ran inside compiled code in
the last step, and the programs compiled (one runs; more were compiled and thrown away: their
buffers did not fit the plan). Every cell runs in its own process with an empty Inductor cache.

    python bench/held_out.py [--quick] [--dtype float32|bfloat16] [--factors 1.0 1.15 1.5 2.0] [--model NAME ...] [--markdown]
"""

from __future__ import annotations

import logging
import sys
import time

from harness.output import parser, table, write_json
from harness.runner import ChildFailed, child, run_fresh
from harness.runs import ProgramCount

MODELS = ("qwen2", "gemma", "phi3", "falcon", "bloom", "mixtral", "gptj", "stablelm")
STEPS = 6


def build(name: str):
    """The model ``name`` (see the module doc) and its batch."""
    import torch
    import transformers as tf
    torch.manual_seed(0)
    common = dict(use_cache=False, vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kv = dict(num_key_value_heads=2)
    configs = {
        "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, **kv, attention_dropout=0.0)),
        "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(**common, **kv, head_dim=16, attention_dropout=0.0)),
        "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**common, **kv, original_max_position_embeddings=64,
                                                          attention_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0)),
        "falcon": lambda: tf.FalconForCausalLM(tf.FalconConfig(
            use_cache=False, vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=1, eos_token_id=2)),
        "bloom": lambda: tf.BloomForCausalLM(tf.BloomConfig(
            use_cache=False, vocab_size=256, hidden_size=64, n_layer=2, n_head=4, hidden_dropout=0.0,
            attention_dropout=0.0, bos_token_id=1, eos_token_id=2)),
        "mixtral": lambda: tf.MixtralForCausalLM(tf.MixtralConfig(**common, **kv, num_local_experts=4,
                                                                  num_experts_per_tok=2, attention_dropout=0.0)),
        "gptj": lambda: tf.GPTJForCausalLM(tf.GPTJConfig(
            use_cache=False, vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_inner=128, rotary_dim=16,
            n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)),
        "stablelm": lambda: tf.StableLmForCausalLM(tf.StableLmConfig(**common, **kv, hidden_dropout=0.0,
                                                                     attention_dropout=0.0)),
    }
    model = configs[name]()
    ids = torch.randint(3, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def cell(spec: dict) -> dict:
    """One model at one budget factor, in this (fresh) process."""
    import torch
    import pscompile
    torch.set_num_threads(1)
    dtype = getattr(torch, spec["dtype"])

    def config(budget=None):
        return pscompile.Config(mode="compiled", backend="inductor", device="cpu", dtype=dtype, device_memory=budget)
    minimum = pscompile.min_device_memory(*build(spec["model"]), config())
    budget = int(minimum * spec["factor"])
    model, batch = build(spec["model"])
    programs = ProgramCount()
    logging.getLogger("pscompile").addHandler(programs)
    logging.getLogger("pscompile").setLevel(logging.INFO)
    t0 = time.perf_counter()
    engine = pscompile.compile(model, batch, optimizer=pscompile.AdamW(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1),
                               config=config(budget))
    peaks = []
    for _ in range(spec["steps"]):
        engine.step(batch)
        peaks.append(engine.stats.peak_device_bytes)
    share = engine.stats.compiled_share
    engine.close()
    return dict(model=spec["model"], factor=spec["factor"], minimum=minimum, budget=budget,
                peak=max(peaks) / budget, share=share, programs=programs.count, seconds=time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = parser(__doc__, "held_out", child=True, markdown=True)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--factors", type=float, nargs="+", default=[1.0, 1.15, 1.5, 2.0])
    ap.add_argument("--model", action="append", choices=MODELS, help="only this model (repeatable)")
    args = ap.parse_args(argv)
    if child(args.child, cell):
        return 0
    models = args.model or (("gemma",) if args.quick else MODELS)
    factors = args.factors[:1] if args.quick else args.factors
    steps = 3 if args.quick else STEPS
    t0, rows, failed = time.perf_counter(), [], []
    for name in models:
        row = [name]
        for f in factors:
            try:
                r = run_fresh(__file__, dict(model=name, factor=f, dtype=args.dtype, steps=steps),
                              cold_inductor=True, threads=1)
            except ChildFailed as e:
                failed.append(f"{name} {f}x: {e}")
                row.append("failed")
                continue
            if r["peak"] > 1.0:
                failed.append(f"{name} {f}x: peak {r['peak']:.3f} of the budget")
            rows.append(r)
            row.append(f"{r['peak']:.3f} {r['share']:.0%} {r['programs']}")
            print(f"[{time.perf_counter() - t0:6.0f} s] {name} {f}x: {row[-1]} ({r['seconds']:.0f} s)", flush=True)
        rows.append(dict(row=row))
    print(f"\nHeld-out models, {args.dtype}, compiled mode with Inductor at x the minimum min_device_memory "
          f"names, {steps} steps, a fresh process and Inductor cache per cell: the largest peak/budget over "
          f"every step, the share of compute in compiled code in the last step, the programs compiled "
          f"(one runs); {time.perf_counter() - t0:.0f} s")
    print(table([r["row"] for r in rows if "row" in r], ["model"] + [f"{f}x" for f in factors],
                markdown=args.markdown))
    for f in failed:
        print("FAILED", f)
    write_json(args.out, dict(dtype=args.dtype, factors=factors, steps=steps, cells=[r for r in rows if "row" not in r],
                              failed=failed, total_s=time.perf_counter() - t0))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
