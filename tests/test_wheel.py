"""A built wheel installs and works outside the checkout.

``python -m build`` makes an sdist, then the wheel from that sdist (so the sdist is proven to carry
everything the wheel needs); no network: the build runs in this environment (``--no-isolation``)
and the wheel installs with ``--no-index --no-deps`` into a fresh virtual environment that sees
this one's torch (``system_site_packages``). From a folder outside the checkout, that environment's
``pscompile --version`` names ``pscompile.__version__``, a compiled-mode step trains under a
budget that evicts, and the host AdamW kernel builds from the ``.cpp`` the wheel shipped.

The fresh environment sees the *running* environment's packages (torch above all), whether that is
the system Python, a virtual environment or a conda environment: a ``.pth`` file names the running
interpreter's site-packages folders. ``venv``'s ``system_site_packages`` would give it the *base*
interpreter's instead, which lacks torch whenever the suite runs inside a virtual environment. A
folder named in a ``.pth`` joins ``sys.path`` without its own ``.pth`` files being run, so an editable
install of the checkout there stays invisible: the wheel is the only pscompile the environment has."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest

import pscompile

ROOT = Path(__file__).resolve().parents[1]

STEP = """
import pathlib, sys, torch, pscompile
from pscompile.models.gpt import GPT, GPTConfig
from pscompile.optim import native_kernel
assert pathlib.Path(pscompile.__file__).is_relative_to(pathlib.Path(sys.prefix)), pscompile.__file__
torch.manual_seed(0)
model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=64, vocab_size=256, seq_len=32))
batch = (torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32)))
config = pscompile.Config(mode="compiled", backend="eager", device="cpu", dtype=torch.float32)
budget = pscompile.min_device_memory(model, batch, config)
engine = pscompile.compile(model, batch, config=pscompile.Config(
    mode="compiled", backend="eager", device="cpu", dtype=torch.float32, device_memory=budget))
losses = [engine.step(batch) for _ in range(2)]
assert losses[1] < losses[0] and engine.stats.peak_device_bytes <= budget and engine.stats.h2d_bytes > 0
reason = native_kernel.unavailable_reason()
kernel = native_kernel.load(cache=pathlib.Path(sys.argv[1])) if reason is None else None
print("kernel", "skipped: " + reason if kernel is None else kernel.path)
print("losses", losses)
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """The sdist and wheel, built from a copy of the checkout without what earlier builds left
    (an ``*.egg-info`` lists files an sdist then takes, whatever ``pyproject.toml`` says) and
    without a virtual environment made inside it (CI's ``.venv``)."""
    src, out = tmp_path_factory.mktemp("src") / "pscompile", tmp_path_factory.mktemp("dist")
    def left(folder: str, names: list[str]) -> set[str]:
        top = {".git", ".pytest_cache", "build", "dist", ".wheels", "out"} if Path(folder) == ROOT else \
            {"results"} if Path(folder) == ROOT / "bench" else set()
        return {n for n in names if n in top or n == "__pycache__" or n.endswith(".egg-info")
                or (Path(folder) / n / "pyvenv.cfg").exists()}          # a virtual environment (.venv)
    shutil.copytree(ROOT, src, ignore=left)
    proc = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_the_sdist_and_the_wheel_carry_the_sources_the_kernel_and_the_script(built):
    (wheel,) = built.glob("pscompile-*.whl")
    (sdist,) = built.glob("pscompile-*.tar.gz")
    assert wheel.name.startswith(f"pscompile-{pscompile.__version__}-") and \
        sdist.name == f"pscompile-{pscompile.__version__}.tar.gz"
    names = set(zipfile.ZipFile(wheel).namelist())
    for need in ("pscompile/py.typed", "pscompile/optim/host_adamw.cpp", "pscompile/passes/__init__.py",
                 "pscompile/models/__init__.py", "pscompile/saving.py", "pscompile/cli/main.py"):
        assert need in names, f"the wheel lacks {need}"
    sources = {p.relative_to(ROOT).as_posix() for d in ("pscompile", "passes", "models") for p in (ROOT / d).rglob("*.py")}
    shipped = {n.replace("pscompile/passes/", "passes/").replace("pscompile/models/", "models/") for n in names}
    assert sources <= shipped, f"sources the wheel lacks: {sorted(sources - shipped)[:5]}"
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "pscompile = pscompile.cli.main:main" in zipfile.ZipFile(wheel).read(entry).decode()
    in_sdist = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
    assert {"pscompile/optim/host_adamw.cpp", "pscompile/py.typed", "README.md", "LICENSE"} <= in_sdist


def running_site_packages() -> list[str]:
    """The folders this interpreter imports installed packages from (its site-packages, those of
    the base interpreter when this is a venv made with system site packages, and the user's)."""
    folders = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        folders.append(site.getusersitepackages())
    return [f for f in dict.fromkeys(folders) if os.path.isdir(f)]


def environment_seeing_this_one(env: Path) -> Path:
    """A new virtual environment (no pip of its own, no download) that imports this environment's
    installed packages after its own; returns its python."""
    venv.create(env, system_site_packages=False, with_pip=False)
    python = env / "bin" / "python"
    own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    (Path(own) / "running-environment.pth").write_text("\n".join(running_site_packages()) + "\n")
    return python


def test_the_new_environment_sees_this_ones_torch_and_not_the_checkout(tmp_path):
    python = environment_seeing_this_one(tmp_path / "venv")
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    probe = ("import importlib.util, torch; print(torch.__file__); "
             "print(importlib.util.find_spec('pscompile') is None)")
    proc = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, env=clean, cwd=tmp_path,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    torch_file, no_pscompile = proc.stdout.split()
    import torch
    assert Path(torch_file).resolve() == Path(torch.__file__).resolve()
    assert no_pscompile == "True", "the checkout's pscompile leaked into the fresh environment"


def test_the_wheel_installs_and_trains_outside_the_checkout(built, tmp_path):
    (wheel,) = built.glob("pscompile-*.whl")
    env = tmp_path / "venv"
    python = environment_seeing_this_one(env)
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run([str(python), "-m", "pip", "install", "--no-index", "--no-deps", "--quiet", str(wheel)],
                          capture_output=True, text=True, timeout=300, env=clean, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    version = subprocess.run([str(env / "bin" / "pscompile"), "--version"], capture_output=True, text=True,
                             timeout=120, env=clean, cwd=tmp_path)
    assert version.returncode == 0 and f"pscompile {pscompile.__version__} " in version.stdout, version
    script = tmp_path / "step.py"
    script.write_text(STEP)
    proc = subprocess.run([str(python), str(script), str(tmp_path / "kernels")], capture_output=True, text=True,
                          timeout=600, env=clean, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "losses" in proc.stdout and "kernel" in proc.stdout, proc.stdout
    if "kernel skipped" not in proc.stdout:
        assert list((tmp_path / "kernels" / "pscompile").glob("host_adamw-*.so")), "the kernel was not built"
