"""Run under torchrun (2 CPU processes): counts DDP gradient all-reduces during micro-batched steps.

`probe.py OUT`: 4 micro-batches a step. `probe.py OUT oom-in-backward`: tiny gradient buckets, and
process 1 runs out of memory in the middle of a backward (after some of its buckets were launched)
whenever a micro-batch holds more than 2 samples; both processes must retry and end as one would.
"""
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

oom_mode = sys.argv[2:] == ["oom-in-backward"]
step_start, launched_before_error = [0], []
if oom_mode:
    from vramfit import engine

    engine.BUCKET_BYTES = 4096  # many buckets, so some are in flight when the error strikes
    size = [0]
    net = acc.unwrap_model(model)
    net.register_forward_pre_hook(lambda _m, args: size.__setitem__(0, args[0].shape[0]))

    def fail_in_backward(grad):
        # Only in the last micro-batch (the 2nd of 4 samples each), whose buckets are being launched.
        if acc.process_index == 1 and size[0] > 2 and forwards[0] == 2:
            launched_before_error.append(len(grad_reduces) - step_start[0])
            raise torch.OutOfMemoryError("simulated, in the middle of backward")
        return grad
    net.layer1[0].conv1.weight.register_hook(fail_in_backward)
g = torch.Generator().manual_seed(1)
state = StepState(micro_batch=4 if oom_mode else 2, per_process_batch=8)
for _ in range(3):
    x, y = torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 5, (16,), generator=g)
    share = slice(acc.process_index * 8, (acc.process_index + 1) * 8)
    forwards[0], step_start[0] = 0, len(grad_reduces)
    train_step(acc, model, opt, x[share], y[share], 16, state, label_smoothing=0.0, clip_grad_norm=None)
weights = {k: v.sum().item() for k, v in acc.unwrap_model(model).state_dict().items()}
json.dump({"ddp_allreduce_calls": len(ddp_calls), "weights": weights, "grad_reduces": grad_reduces,
           "n_params": n_params, "oom_retries": state.oom_retries, "micro_batch": state.micro_batch,
           "launched_before_error": launched_before_error},
          open(f"{sys.argv[1]}.{acc.process_index}", "w"))
