"""Run under torchrun (2 CPU processes): what one optimizer step says between processes.

`probe.py OUT`: 4 micro-batches a step; records every gradient all-reduce and which micro-batch
was running when it started. `probe.py OUT oom-in-backward`: tiny gradient buckets, and process 1
runs out of memory in the middle of a backward (after some of its buckets were launched) whenever
a micro-batch holds more than 2 samples; both processes must retry and end as one would.
"""
import json
import sys

import torch
from accelerate import Accelerator

from vramfit.config import ModelConfig, OptimConfig
from vramfit.models.create import create_model
from vramfit.runtime import collectives
from vramfit.runtime.collectives import broadcast_module
from vramfit.train.optim import create_optimizer
from vramfit.train.step import TrainStep

oom_mode = sys.argv[2:] == ["oom-in-backward"]
if oom_mode:
    collectives.BUCKET_BYTES = 4096  # many buckets, so some are in flight when the error strikes

acc = Accelerator(cpu=True)
torch.manual_seed(0)
model = create_model(ModelConfig(name="test_resnet", bn="freeze"), num_classes=5, load_weights=False)
opt = create_optimizer(model, OptimConfig(lr=1e-3))
model = acc.prepare_model(model, evaluation_mode=True)  # as the trainer does: no DDP wrapper
opt = acc.prepare_optimizer(opt)
broadcast_module(model)

# Record which micro-batch of the step was running when each gradient sum started.
forwards = [0]
model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
grad_reduces = []  # (micro-batch index, elements) of every all-reduce of gradients (float32)
n_params = sum(p.numel() for p in model.parameters())
_all_reduce = torch.distributed.all_reduce


def recording_all_reduce(tensor, *args, **kwargs):
    if tensor.dtype == torch.float32:
        grad_reduces.append((forwards[0], tensor.numel()))
    return _all_reduce(tensor, *args, **kwargs)


collectives.dist.all_reduce = recording_all_reduce

step_start, launched_before_error = [0], []
if oom_mode:
    size = [0]
    model.register_forward_pre_hook(lambda _m, args: size.__setitem__(0, args[0].shape[0]))

    def fail_in_backward(grad):
        # Only in the last micro-batch (the 2nd of 4 samples each), whose buckets are being launched.
        if acc.process_index == 1 and size[0] > 2 and forwards[0] == 2:
            launched_before_error.append(len(grad_reduces) - step_start[0])
            raise torch.OutOfMemoryError("simulated, in the middle of backward")
        return grad
    model.layer1[0].conv1.weight.register_hook(fail_in_backward)
step = TrainStep(acc, model, opt, 4 if oom_mode else 2, label_smoothing=0.0, clip_grad_norm=None)
buffers = [f.data_ptr() for f in step.reducer.flats]
g = torch.Generator().manual_seed(1)
for _ in range(3):
    x, y = torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 5, (16,), generator=g)
    share = slice(acc.process_index * 8, (acc.process_index + 1) * 8)
    forwards[0], step_start[0] = 0, len(grad_reduces)
    step(x[share], y[share], 16)
weights = {k: v.sum().item() for k, v in acc.unwrap_model(model).state_dict().items()}
json.dump({"wrapped": type(model).__name__, "weights": weights, "grad_reduces": grad_reduces,
           "n_params": n_params, "oom_retries": step.state.oom_retries, "micro_batch": step.state.micro_batch,
           "launched_before_error": launched_before_error,
           "buffers_reused": buffers == [f.data_ptr() for f in step.reducer.flats]},
          open(f"{sys.argv[1]}.{acc.process_index}", "w"))
