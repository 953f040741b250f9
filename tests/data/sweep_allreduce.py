"""A sweep trial of several ranks: an all_reduce over its own rendezvous (gloo)."""

import sys

import torch
import torch.distributed as dist

scale = float(sys.argv[1])
dist.init_process_group("gloo")
value = torch.tensor([(dist.get_rank() + 1) * scale])
dist.all_reduce(value)
if dist.get_rank() == 0:
    print(f"metric: total={value.item():g} world={dist.get_world_size()}", flush=True)
dist.destroy_process_group()
