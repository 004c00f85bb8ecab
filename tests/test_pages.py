"""Pages in compiled mode: a tensor larger than a chunk spans consecutive chunks (ANGEL-PTM's pages).

- ``flat_pieces`` covers any range of a strided tensor's flattening with views (no temporary);
- a compiled schedule fetches and evicts the pages of a tensor separately, gathers them for each
  reader, stores its gradient page by page, and trains in step with plain PyTorch (fp32, bf16,
  gradient accumulation) under budgets that evict, moving what it planned within the budget;
- ``verify_schedule`` refuses a schedule that reads a page from the wrong slot, gathers pages in
  the wrong order or forgets a page of a gradient;
- ``chunk_size="auto"`` is no longer bounded by the largest tensor in compiled mode, and both modes
  pick the same layout.
"""

from __future__ import annotations

import pytest
import torch

import pscompile
from pscompile.graph import meta as gmeta
from pscompile.graph.ops import flat_pieces
from pscompile.passes.verify_schedule import ScheduleError, verify_schedule
from pscompile.testing import ReferenceTrainer
from conftest import TRACKING_TOL, tracking_tol, fresh_masters, make_batches, make_model, worst_tracking

CHUNK = 4096          # elements: the tiny models' embeddings (256 x 64) and MLP weights span chunks


def _config(dtype=torch.float32, device_memory=None, **kw) -> pscompile.Config:
    return pscompile.Config(mode="compiled", backend="eager", device="cpu", dtype=dtype,
                            device_memory=device_memory, chunk_size=CHUNK, **kw)


def _tight(kind: str, dtype=torch.float32) -> int:
    """Two chunks above the measured minimum of the paged layout."""
    b = make_batches(kind, 1)[0]
    engine = pscompile.compile(make_model(kind), b, config=_config(dtype))
    engine.step(b)
    return engine.min_device_memory + 2 * CHUNK * dtype.itemsize


@pytest.mark.parametrize("shape", [(7, 5), (3, 4, 5), (10,), (6, 1, 3)])
def test_flat_pieces_cover_every_range_of_a_strided_tensor(shape):
    t = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    for x in (t, t.transpose(0, -1)):
        flat = x.reshape(-1)
        n = flat.numel()
        for start in range(n):
            for numel in range(n - start + 1):
                got = torch.full((numel,), -1.0)
                for view, at in flat_pieces(x, start, numel):
                    assert view.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()   # no copy
                    got[at:at + view.numel()] = view.reshape(-1)
                assert torch.equal(got, flat[start:start + numel]), (shape, start, numel)


@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_paged_layout_trains_in_step_with_plain_pytorch(kind):
    budget = _tight(kind)
    hp = pscompile.AdamW(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    batches = make_batches(kind, 6)
    ref = ReferenceTrainer(make_model(kind), optimizer=hp, dtype=torch.float32)
    engine = pscompile.compile(make_model(kind), batches[0], optimizer=hp, config=_config(device_memory=budget))
    spanning = [e for e in engine.layout.entries if e.spans]
    assert spanning, engine.layout.describe()
    text = str(engine.schedule)
    assert "aten.cat" in text and "pages of" in text        # readers of spanning tensors gather them
    for i, b in enumerate(batches):
        a, c = ref.step(b), engine.step(b)
        assert abs(a - c) <= 1e-5 * abs(a), f"step {i}: plain {a} vs paged {c}"
        s, plan = engine.stats, engine.last_plan
        assert (s.chunk_h2d_bytes, s.chunk_d2h_bytes) == (plan.h2d_bytes, plan.d2h_bytes)
        assert s.peak_device_bytes <= budget and s.num_evictions > 0
    assert worst_tracking(engine, ref, fresh_masters(kind, torch.float32))[0] <= TRACKING_TOL


@pytest.mark.parametrize("dtype,accumulate", [(torch.float32, True), (torch.bfloat16, False)],
                         ids=["fp32-accumulate", "bf16"])
def test_paged_layout_accumulates_and_trains_in_bf16(dtype, accumulate):
    kind = "gpt"
    budget = _tight(kind, dtype)
    hp = pscompile.AdamW(lr=1e-3)
    batches = make_batches(kind, 6)
    ref = ReferenceTrainer(make_model(kind), optimizer=hp, dtype=dtype)
    engine = pscompile.compile(make_model(kind), batches[0], optimizer=hp,
                               config=_config(dtype, device_memory=budget))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i in range(0, 6, 2):
        step = [batches[i], batches[i + 1]] if accumulate else batches[i]   # accumulate_grad page by page
        a, c = ref.step(step), engine.step(step)
        assert abs(a - c) <= tol * abs(a), f"step {i // 2}: plain {a} vs paged {c}"
        assert engine.stats.peak_device_bytes <= budget
    assert worst_tracking(engine, ref, fresh_masters(kind, dtype))[0] <= tracking_tol(dtype)


def _verify(engine, gm) -> None:
    sched = engine.schedule
    verify_schedule(gm, engine.layout, slot_bytes=engine.store.param_chunk_bytes, budget=engine.budget,
                    initial=dict(sched.plan.initial), os_device_chunks=frozenset(c for c, _ in sched.plan.initial),
                    os_device_bytes=engine.store.dev_os_pool.bytes_in_use, grad_fqns=sched.captured.grad_fqns)


def test_verify_refuses_a_wrong_page():
    b = make_batches("gpt", 1)[0]
    engine = pscompile.compile(make_model("gpt"), b, config=_config(device_memory=_tight("gpt")))
    _verify(engine, engine.schedule.gm)                         # as planned: fine
    gathers = [n for n in engine.schedule.gm.graph.nodes if gmeta.get(n, "gather") is not None]
    assert gathers

    def broken(edit):
        gm = torch.fx.GraphModule(engine.schedule.gm, engine.schedule.gm.graph.__deepcopy__())
        edit(gm)
        with pytest.raises(ScheduleError):
            _verify(engine, gm)

    def swap_pages(gm):                  # the pages of one tensor gathered in the wrong order
        cat = next(n for n in gm.graph.nodes if gmeta.get(n, "gather") is not None)
        cat.args = (list(reversed(cat.args[0])),)

    def shift_page(gm):                  # a page read at the wrong offset
        page = next(n for n in gm.graph.nodes if gmeta.get(n, "page") is not None)
        page.args = (page.args[0], 0, page.args[2] + 1, page.args[3] + 1)

    def forget_a_gradient_page(gm):      # one page of a spanning gradient never stored
        store = next(n for n in gm.graph.nodes if n.target is torch.ops.pscompile.store_grad.default
                     and len(n.args) == 5)
        gm.graph.erase_node(store)

    for edit in (swap_pages, shift_page, forget_a_gradient_page):
        broken(edit)


def test_auto_chunk_size_is_not_bounded_by_the_largest_tensor_and_moves_no_more_than_hooks():
    """With a budget an eighth of which is smaller than the embedding, "auto" gives chunks smaller
    than it in compiled mode too, and at the same budget with default settings compiled mode moves
    no more bytes per step than hooks mode (in its steady state: the second step, the first after
    measurement, runs the cold plan and fetches the third step's first chunks too)."""
    from pscompile.models.gpt import GPT, GPTConfig
    cfg = GPTConfig(n_layer=1, n_head=2, d_model=128, vocab_size=2048, seq_len=32)
    ids = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    batch = (ids, torch.roll(ids, -1, dims=1))
    budget = 4 << 20
    engines = {}
    for mode in ("compiled", "hooks"):
        torch.manual_seed(0)
        engines[mode] = pscompile.compile(GPT(cfg), batch, config=pscompile.Config(
            mode=mode, backend="eager", device="cpu", device_memory=budget))
        for _ in range(3):
            engines[mode].step(batch)
        assert engines[mode].stats.peak_device_bytes <= budget
    layout = engines["compiled"].layout
    largest = max(e.numel for e in layout.entries)
    assert layout.chunk_size < largest and any(e.spans for e in layout.entries), layout.describe()
    assert engines["compiled"].stats.bytes_moved <= engines["hooks"].stats.bytes_moved
    for e in engines.values():
        e.close()
