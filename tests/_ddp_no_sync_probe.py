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

# vramfit's own gradient sums: record which micro-batch of the step was running when each started.
forwards = [0]
acc.unwrap_model(model).register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
grad_reduces = []  # (micro-batch index, elements) of every all-reduce larger than a status flag
n_params = sum(p.numel() for p in model.parameters())
_all_reduce = torch.distributed.all_reduce


def recording_all_reduce(tensor, *args, **kwargs):
    if tensor.numel() > 2:
        grad_reduces.append((forwards[0], tensor.numel()))
    return _all_reduce(tensor, *args, **kwargs)


torch.distributed.all_reduce = recording_all_reduce
g = torch.Generator().manual_seed(1)
state = StepState(micro_batch=2, per_process_batch=8)
for _ in range(3):
    x, y = torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 5, (16,), generator=g)
    share = slice(acc.process_index * 8, (acc.process_index + 1) * 8)
    forwards[0] = 0
    train_step(acc, model, opt, x[share], y[share], 16, state, label_smoothing=0.0, clip_grad_norm=None)
weights = {k: v.sum().item() for k, v in acc.unwrap_model(model).state_dict().items()}
if acc.is_main_process:
    json.dump({"ddp_allreduce_calls": len(ddp_calls), "weights": weights, "grad_reduces": grad_reduces,
               "n_params": n_params}, open(sys.argv[1], "w"))
