"""A stand-in trainer process speaking SGLang's weight-sync protocol: forms the group as
rank 0 with SGLang's ``init_custom_process_group`` (a ``tcp://`` rendezvous it hosts),
broadcasts the tensors of a checkpoint in the order the spec lists them, then waits for
the engine's "done" file before leaving (it hosts the rendezvous store)."""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from safetensors.torch import load_file

from sglang.srt.utils import init_custom_process_group


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    tensors = load_file(spec["safetensors"])
    group = init_custom_process_group(
        backend="gloo",
        init_method=f"tcp://{spec['host']}:{spec['port']}",
        world_size=spec["world_size"],
        rank=0,
        group_name=spec["group_name"],
        timeout=timedelta(seconds=90),
    )
    print("trainer: group formed", flush=True)
    for name in spec["names"]:  # each waits for the engine's matching receive
        dist.broadcast(tensors[name].contiguous(), src=0, group=group)
    print("trainer: broadcast done", flush=True)
    done = Path(spec["done_file"])
    deadline = time.monotonic() + 90
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


if __name__ == "__main__":
    main()
