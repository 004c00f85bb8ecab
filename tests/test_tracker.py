"""NonModelTracker: live storages by serial number, views not double counted, model buffers skipped."""

import torch

from pscompile.memory.tracker import NonModelTracker

CPU = torch.device("cpu")


def make(model_ptrs=(), model_bytes=0, exact=True):
    return NonModelTracker(CPU, lambda p: p in model_ptrs, lambda: model_bytes, exact_windows=exact)


def test_counts_outputs_and_forgets_dead_storages():
    tr = make()
    with tr:
        a = torch.empty(1000, dtype=torch.float32)      # 4000 bytes
        b = torch.empty(500, dtype=torch.float64)       # 4000 bytes
        assert tr.current() == 8000
        v = a[10:20].view(2, 5)                         # a view: no new storage
        assert tr.current() == 8000
        del a
        assert tr.current() == 8000                     # the view keeps the storage alive
        del v
        assert tr.current() == 4000
        del b
        assert tr.current() == 0
    assert tr.peak_nonmodel == 8000


def test_reused_addresses_do_not_corrupt_the_count():
    tr = make()
    with tr:
        for _ in range(50):
            t = torch.empty(4096)
            del t
        keep = [torch.empty(256) for _ in range(4)]
        assert tr.current() == 4 * 256 * 4
    assert tr.peak_nonmodel == 4096 * 4 + 0 or tr.peak_nonmodel >= 4096 * 4
    del keep


def test_model_storage_is_skipped_and_added_to_total():
    slot = torch.empty(1000)
    ptr = slot.untyped_storage().data_ptr()
    tr = make(model_ptrs={ptr}, model_bytes=4000)
    with tr:
        view = slot[:10]
        y = view * 2                                   # 40 bytes of non-model output
        assert tr.current() == 40
    assert tr.peak_total == 4040
    assert tr.peak_model == 4000
    del y


def test_window_peak_and_pause():
    tr = make()
    with tr:
        tr.start_window()
        x = torch.empty(1000)
        del x
        assert tr.window_peak == 4000
        tr.start_window()
        assert tr.window_peak == 0
        with tr.paused():
            y = torch.empty(5000)
        assert tr.current() == 0                         # not seen while paused
        del y


def test_lazy_sweep_still_finds_the_true_peak():
    exact, lazy = make(exact=True), make(exact=False)
    for tr in (exact, lazy):
        with tr:
            xs = []
            for i in range(20):
                xs.append(torch.empty(100 * (i % 5 + 1)))
                if len(xs) > 3:
                    xs.pop(0)
            del xs
    assert exact.peak_nonmodel == lazy.peak_nonmodel
