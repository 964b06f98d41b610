"""``--nproc N``: dist_convert starts its own N local workers through torch's elastic launcher (what
``torchrun --standalone --nproc_per_node=N`` does), each running the same command line without
``--nproc``. The workers print their own output and one-line errors; the launcher adds nothing on failure."""
from __future__ import annotations

import logging
import sys
import uuid

from .errors import ConvertError


def without_nproc(argv: list[str]) -> list[str]:
    """Pure: ``argv`` without ``--nproc N`` / ``--nproc=N``."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = i + 1 < len(argv)
            continue
        if a.startswith("--nproc="):
            continue
        out.append(a)
    return out


def self_launch(nproc: int, argv: list[str]) -> int:
    """Run ``dist_convert argv`` (minus --nproc) in ``nproc`` local workers; the exit code is 0 when every
    worker succeeded, else the first failed worker's (its error line is already printed)."""
    if nproc < 1:
        print(f"dist_convert: error: --nproc {nproc} is not a positive number of processes; pass --nproc 1 or "
              "more", file=sys.stderr)
        return 2
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):  # its warnings repeat the workers'
        logging.getLogger(name).setLevel(logging.CRITICAL)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
                          start_method="spawn")
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "dist_convert", *without_nproc(argv))
    except ChildFailedError as e:
        codes = [f.exitcode for _, f in sorted(e.failures.items())]
        return next((c for c in codes if c > 0), 1)
    except (RuntimeError, ValueError, ConvertError) as e:
        print(f"dist_convert: error: cannot start {nproc} local workers ({e}); launch with torchrun instead",
              file=sys.stderr)
        return 2
    return 0
