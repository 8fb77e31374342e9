"""GPU pinning check for `vlmbatch worker` (run on a machine with GPUs; needs only torch).

Starts one process per GPU slot exactly as the supervisor does and checks that each sees
one GPU, a different one each. Run: `python -m vlmbatch.workers.gpu_check [--gpus all|0,1]`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from vlmbatch.workers.supervisor import gpu_slots, pinned_env

PROBE = "import torch; print(torch.cuda.device_count(), torch.cuda.get_device_properties(0).uuid)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="all")
    slots = gpu_slots(parser.parse_args().gpus)
    seen = {}
    for slot in slots:
        out = subprocess.run([sys.executable, "-c", PROBE], env=pinned_env(slot), capture_output=True, text=True, check=True)
        count, uuid = out.stdout.split(maxsplit=1)
        print(f"slot {slot}: sees {count} GPU(s), {uuid.strip()}")
        assert count == "1", f"slot {slot} sees {count} GPUs"
        seen[slot] = uuid.strip()
    assert len(set(seen.values())) == len(slots), "two slots share a GPU"
    print(f"ok: {len(slots)} worker processes, one GPU each")


if __name__ == "__main__":
    main()
