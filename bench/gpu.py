"""The runs of a lent GPU, one command each (docs/gpu.md, whose sections say what each measures).

    python bench/gpu.py [--dry-run] [--quick] [--markdown] [--out bench/results/gpu.json] [--deadline-s 470]
    python bench/gpu.py --lease [...]      # a short lease's one command: bench/cudabench/lease.py
    python bench/gpu.py --peers [...]      # against FSDP2, DeepSpeed, torch.compile: bench/cudabench/versus.py

With neither flag, the acceptance run (bench/cudabench/acceptance.py): parity under a budget that
evicts every step, then the step time and overlap ratio of each system at no, a middle and a tight
budget. ``--dry-run`` runs any of them on the CPU with tiny shapes (the times mean nothing), so
they cannot rot while no GPU is lent. A failed row exits 1.
"""

from __future__ import annotations

import sys

from cudabench import acceptance, lease, versus


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--lease" in argv:
        return lease.main([a for a in argv if a != "--lease"])
    if "--peers" in argv:
        return versus.main([a for a in argv if a != "--peers"])
    return acceptance.main(argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
