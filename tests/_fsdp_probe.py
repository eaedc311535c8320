"""Run under torchrun (2 CPU processes, gloo): the optimizer step on an FSDP2 (`fully_shard`) model.

Accelerate does not shard on a CPU, so the model is sharded here with torch's own `fully_shard`,
as Accelerate's FSDP2 plugin does on GPUs. Three steps of 8 samples a process in micro-batches of
3 (3 + 3 + 2: gradient sync only on the last), then a short batch of 3 samples that only process 0
takes (process 1 joins FSDP's collectives with weightless forwards). Writes the gathered full state
dict's sums from process 0.
"""
import json
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from vramfit import batching
from vramfit.config import ModelConfig, OptimConfig
from vramfit.models.create import create_model
from vramfit.runtime.collectives import full_state_dict
from vramfit.train.optim import create_optimizer
from vramfit.train.step import TrainStep, is_fsdp

acc = Accelerator(cpu=True)
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
model = create_model(ModelConfig(name="test_resnet", bn="freeze"), num_classes=5, load_weights=False)
for block in [*model.layer1, *model.layer2, *model.layer3, *model.layer4]:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = acc.prepare_optimizer(create_optimizer(model, OptimConfig(lr=1e-3)))
syncs = []
model.set_requires_gradient_sync = (lambda f: lambda on, **kw: (syncs.append(on), f(on, **kw))[1])(
    model.set_requires_gradient_sync)
step = TrainStep(acc, model, opt, 3, label_smoothing=0.0, clip_grad_norm=None)
g = torch.Generator().manual_seed(1)
losses = []
for n in (16, 16, 16, 3):
    x, y = torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 5, (n,), generator=g)
    shares = batching.rank_shares(n, dist.get_world_size())
    start = sum(shares[:acc.process_index])
    share = slice(start, start + shares[acc.process_index])
    losses.append(step(x[share], y[share], n).loss)
full = full_state_dict(model)
if acc.process_index == 0:
    json.dump({"fsdp": is_fsdp(model), "syncs": syncs, "losses": losses,
               "weights": {k: v.sum().item() for k, v in full.items()}}, open(sys.argv[1], "w"))
dist.barrier()
