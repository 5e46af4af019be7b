"""One-rank group creation and an all_reduce: the quickest check that the built extension
loads and runs against the installed torch (used under a debugger on the GPU machine)."""

import datetime

import torch
import torch.distributed as dist

import resident_pg

store = dist.HashStore()
dist.init_process_group("resident", store=store, rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=10))
x = torch.arange(4.0)
dist.all_reduce(x)
print("ok", x, resident_pg.describe())
dist.destroy_process_group()
