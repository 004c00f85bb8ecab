"""ChunkLayout packing and the chunk-size search, as small tables fed to one invariant checker."""

from __future__ import annotations


import pytest

from pscompile.memory.layout import build_layout, padding_waste, search_chunk_size


def check_layout(layout, shapes):
    """Every element of every tensor sits in exactly one chunk slot; no two tensors overlap;
    a tensor that fits in a chunk is never split; pieces cover the tensor in order."""
    used = {}
    for (fqn, shape), e in zip(shapes, layout.entries):
        assert e.fqn == fqn and e.shape == tuple(shape)
        assert sum(p.numel for p in e.pieces) == e.numel
        offset = 0
        for p in e.pieces:
            assert p.tensor_offset == offset
            offset += p.numel
            assert 0 <= p.chunk_offset and p.chunk_offset + p.numel <= layout.chunk_size
            assert p.chunk < layout.num_chunks
            for k in range(p.chunk_offset, p.chunk_offset + p.numel):
                assert (p.chunk, k) not in used, f"{fqn} overlaps {used[(p.chunk, k)]}"
                used[(p.chunk, k)] = fqn
        if e.numel <= layout.chunk_size:
            assert len(e.pieces) == 1, f"{fqn} fits in a chunk but was split"
        chunks = [p.chunk for p in e.pieces]
        assert chunks == list(range(chunks[0], chunks[0] + len(chunks))), "pieces must be consecutive"
    assert len(used) == layout.total_numel


CASES = [
    # (chunk_size, shapes, expected num_chunks)
    (4, [("a", (3,)), ("b", (1,))], 1),
    (4, [("a", (3,)), ("b", (2,))], 2),
    (4, [("a", (3,)), ("b", (10,)), ("c", (2,)), ("d", (4,))], 5),
    (4, [("a", (4,)), ("b", (4,))], 2),
    (4, [("a", (8,))], 2),
    (6, [("w", (2, 3)), ("b", (3,)), ("v", (3, 4)), ("x", (1,))], 4),
]


@pytest.mark.parametrize("chunk_size,shapes,num_chunks", CASES)
def test_packing(chunk_size, shapes, num_chunks):
    layout = build_layout(shapes, chunk_size)
    check_layout(layout, shapes)
    assert layout.num_chunks == num_chunks


def test_lookup_and_aliases():
    layout = build_layout([("wte.weight", (4, 2)), ("ln.bias", (2,))], 8, aliases={"lm_head.weight": "wte.weight"})
    assert layout.entry("lm_head.weight") is layout.entry("wte.weight")
    assert len(layout.entries) == 2  # tied parameter appears once
    assert layout.entry_at(0, 3).fqn == "wte.weight"
    assert layout.entry_at(1, 1).fqn == "ln.bias"
    assert layout.entry_at(1, 5) is None  # padding
    with pytest.raises(KeyError, match="nope"):
        layout.entry("nope")
    assert layout.utilisation == pytest.approx(10 / 16)


def test_bad_chunk_size():
    with pytest.raises(ValueError, match="chunk_size"):
        build_layout([("a", (2,))], 0)


@pytest.mark.parametrize("numels", [[100, 30, 70, 12, 1, 99], [5000, 3000, 2000, 1000, 17], [65536, 4096, 4096, 300]])
def test_search_finds_least_waste_in_its_range(numels):
    choice = search_chunk_size(numels, step=4, min_chunks=1, max_candidates=10_000)
    hi = -(-max(numels) // 4) * 4
    lo = max(4, (hi // 2) // 4 * 4)
    brute = min(padding_waste(numels, s) for s in range(lo, hi + 1, 4))
    assert padding_waste(numels, choice.chunk_size) == brute
    assert choice.utilisation == pytest.approx(sum(numels) / (choice.num_chunks * choice.chunk_size))


def test_search_respects_caps():
    numels = [50_000, 10_000] * 4
    choice = search_chunk_size(numels, max_chunk_size=8192)
    assert choice.chunk_size <= 8192
    layout = build_layout([(str(i), (n,)) for i, n in enumerate(numels)], choice.chunk_size)
    check_layout(layout, [(str(i), (n,)) for i, n in enumerate(numels)])
    assert any(e.spans for e in layout.entries)
    assert search_chunk_size([1000] * 8, min_chunks=4).num_chunks >= 4


def test_search_is_fast_for_big_models():
    numels = [50257 * 2048] + [2048 * 8192, 8192 * 2048, 2048 * 6144, 2048 * 2048] * 40 + [2048] * 400
    choice = search_chunk_size(numels)
    assert choice.candidates <= 512
    assert choice.utilisation > 0.9
