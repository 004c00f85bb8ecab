"""What a user sees without configuring logging (``pscompile/runtime/notices.py``): a fall-back at WARNING
and a notice when one of a shape's first steps is slow, one line each on stderr; nothing else, and
nothing when the steps are quick; once the process configures logging, its handlers alone print.
Each case runs in a fresh process, as a user's script would."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

SCRIPT = """
import logging, sys, torch, pscompile
from pscompile.models.gpt import GPT, gpt_config
{setup}
pscompile.runtime.notices.SLOW_S = {slow}
torch.manual_seed(0)
model = GPT(gpt_config("gpt-tiny"))
idx = torch.randint(0, 64, (2, 16))
engine = pscompile.compile(model, config=pscompile.Config(device="cpu", dtype=torch.float32, backend="eager",
                                                          device_memory="4MiB"))
for _ in range(5):
    engine.step((idx, idx))
logging.getLogger("pscompile").warning("pscompile: a fall-back")
print("done", file=sys.stderr)
"""


def _run(slow: float, setup: str = "") -> list[str]:
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(slow=slow, setup=setup)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return [line for line in out.stderr.splitlines() if line.strip()]


def test_a_slow_setup_step_and_a_fall_back_reach_a_user_who_configured_nothing():
    lines = _run(slow=0.0)
    notices = [x for x in lines if "so far" in x]
    # the first SETUP_STEPS steps of the shape, each said with its time; the steady steps say nothing
    assert [x.split(":")[1].strip() for x in notices] == ["step 1 of batch shapes [(2, 16), (2, 16)]",
                                                          "step 2 of batch shapes [(2, 16), (2, 16)]",
                                                          "step 3 of batch shapes [(2, 16), (2, 16)]"], lines
    assert sum(" took " in x for x in lines) == 3
    assert lines[-2:] == ["pscompile: a fall-back", "done"]
    assert len(lines) == 8, lines          # no INFO detail (plans, captures) on the way


def test_quick_steps_say_nothing():
    assert _run(slow=60.0) == ["pscompile: a fall-back", "done"]


def test_a_process_that_configured_logging_prints_each_line_once():
    lines = _run(slow=0.0, setup="logging.basicConfig(level=logging.WARNING, format='%(levelname)s %(message)s')")
    assert lines.count("WARNING pscompile: a fall-back") == 1 and "pscompile: a fall-back" not in lines, lines
    notices = [x for x in lines if "so far" in x]      # (the notices' logger is at INFO unless set otherwise)
    assert len(notices) == 3 and all(x.startswith("INFO pscompile: step ") for x in notices), lines


def test_a_notice_ends_with_its_time_only_when_it_was_said(caplog):
    import logging
    from pscompile.runtime.notices import NOTICE, slow_notice
    with caplog.at_level(logging.INFO, logger=NOTICE):
        with slow_notice("quick", after=30.0):
            pass
        with slow_notice("slow", after=0.01):
            time.sleep(0.2)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and said[0].startswith("pscompile: slow: 0 s so far") and " took " in said[1], said
    assert not [t for t in threading.enumerate() if isinstance(t, threading.Timer) and t.is_alive()]
