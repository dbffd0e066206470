"""Several eaglet commands in one torchrun job, so a test pays for starting the process group once.

    torchrun --standalone --nproc-per-node 2 tests/torchrun_steps.py \
        run a.yaml --until train --- cp run other --- rm other/extract/index.json --- bench --device cpu ...

Groups are separated by `---`. A group is `eaglet` CLI arguments, `cp SRC DST` (a folder
copied), `rm PATH...` (files deleted, as a kill would have left them), or `bench ARGS`
(bench/scaling.py). Rank 0 copies and deletes while the others wait. The job stops at the
first group that fails.
"""

import runpy
import shutil
import sys
from pathlib import Path

from eaglet import cli
from eaglet.distributed import barrier, dist_env, init_distributed

BENCH = Path(__file__).resolve().parent.parent / "bench" / "scaling.py"


def main(argv: list[str]) -> int:
    groups: list[list[str]] = [[]]
    for arg in argv:
        if arg == "---":
            groups.append([])
        else:
            groups[-1].append(arg)
    init_distributed()
    for group in groups:
        if group[0] in ("cp", "rm"):
            if dist_env().is_main and group[0] == "cp":
                shutil.copytree(group[1], group[2])
            elif dist_env().is_main:
                for path in group[1:]:
                    Path(path).unlink()
            barrier()
        elif group[0] == "bench":
            sys.argv = [str(BENCH), *group[1:]]
            runpy.run_path(str(BENCH), run_name="__main__")
        elif cli.main(group):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
