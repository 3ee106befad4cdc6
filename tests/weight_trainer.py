"""A stand-in trainer process: joins the weights update group as rank 0 and broadcasts
the tensors of a checkpoint, in the order the spec file lists them."""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from safetensors.torch import load_file


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    time.sleep(float(spec.get("delay_s", 0)))
    tensors = load_file(spec["safetensors"])
    timeout = timedelta(seconds=60)
    store = dist.TCPStore(spec["host"], spec["port"], spec["world_size"], is_master=True, timeout=timeout)
    group = dist.ProcessGroupGloo(dist.PrefixStore(spec["group_name"], store), 0, spec["world_size"], timeout)
    group.barrier().wait()
    print("trainer: group formed", flush=True)
    # wait for the engine to ask (it sends a key once it is ready to receive)
    store.wait(["ready"], timeout)
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    for name in spec["names"]:
        group.broadcast([tensors[name].contiguous()], opts).wait()
    print("trainer: broadcast done", flush=True)
    store.wait(["done"], timeout)


if __name__ == "__main__":
    main()
