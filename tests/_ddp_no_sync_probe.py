"""Run under torchrun (2 CPU processes): counts DDP gradient all-reduces during micro-batched steps."""
import json
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs

from vramfit.config import ModelConfig, OptimConfig
from vramfit.engine import StepState, train_step
from vramfit.models import create_model
from vramfit.optim import create_optimizer

acc = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])
torch.manual_seed(0)
model = create_model(ModelConfig(name="test_resnet", bn="freeze"), num_classes=5, load_weights=False)
opt = create_optimizer(model, OptimConfig(lr=1e-3))
model, opt = acc.prepare(model, opt)
ddp_calls = []


def counting_hook(state, bucket):
    ddp_calls.append(bucket.buffer().numel())
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


model.register_comm_hook(None, counting_hook)
g = torch.Generator().manual_seed(1)
state = StepState(micro_batch=2, per_process_batch=8)
for _ in range(3):
    x, y = torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 5, (16,), generator=g)
    share = slice(acc.process_index * 8, (acc.process_index + 1) * 8)
    train_step(acc, model, opt, x[share], y[share], 16, state, label_smoothing=0.0, clip_grad_norm=None)
weights = {k: v.sum().item() for k, v in acc.unwrap_model(model).state_dict().items()}
if acc.is_main_process:
    json.dump({"ddp_allreduce_calls": len(ddp_calls), "weights": weights}, open(sys.argv[1], "w"))
