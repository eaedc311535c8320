"""The optimizer step: batch splits give the same maths; an OOM only changes the split."""
import copy

import pytest
import torch
from accelerate import Accelerator

from vramfit.config import ModelConfig, OptimConfig
from vramfit.engine import MicroBatchExhausted, StepState, train_step
from vramfit.models import create_model
from vramfit.optim import create_optimizer


def _setup(opt="adamw", seed=0):
    torch.manual_seed(seed)
    model = create_model(ModelConfig(name="test_resnet", bn="freeze"), num_classes=5, load_weights=False)
    return model, OptimConfig(name=opt, lr=1e-3 if opt == "adamw" else 0.05, weight_decay=0.05)


def _data(steps, batch, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 5, (batch,), generator=g))
            for _ in range(steps)]


def _train(model, ocfg, batches, micro, oom_above=None):
    acc = Accelerator(cpu=True)
    model = copy.deepcopy(model)
    if oom_above is not None:
        def hook(_m, args):
            if args[0].shape[0] > oom_above:
                raise torch.OutOfMemoryError("simulated")
        model.register_forward_pre_hook(hook)
    opt = create_optimizer(model, ocfg)
    model, opt = acc.prepare(model, opt)
    state = StepState(micro_batch=micro, per_process_batch=batches[0][0].shape[0])
    losses = []
    for x, y in batches:
        r = train_step(acc, model, opt, x, y, x.shape[0], state, label_smoothing=0.1, clip_grad_norm=1.0)
        losses.append(r.loss)
    return acc.unwrap_model(model), losses, state


def _max_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_batch_splits_give_same_weights(opt):
    model, ocfg = _setup(opt)
    batches = _data(3, 16)
    ref, ref_losses, _ = _train(model, ocfg, batches, micro=16)
    for micro in (4, 5, 1):  # 4 x 4; 5 + 5 + 5 + 1 (uneven); 16 x 1
        got, losses, _ = _train(model, ocfg, batches, micro=micro)
        assert _max_diff(ref, got) <= 1e-6, f"micro {micro}"
        assert losses == pytest.approx(ref_losses, rel=1e-6)
    assert _max_diff(ref, model) > 1e-4  # it did train


def test_short_last_batch_is_weighted_by_samples():
    """A 10-sample batch in micro-batches of 4 (4+4+2) gives the mean over 10, not over 3 chunks."""
    model, ocfg = _setup("sgd")
    batches = _data(1, 10)
    ref, _, _ = _train(model, ocfg, batches, micro=10)
    got, _, _ = _train(model, ocfg, batches, micro=4)
    assert _max_diff(ref, got) <= 1e-6


def test_oom_recovery_keeps_the_maths():
    model, ocfg = _setup("adamw")
    batches = _data(3, 32)
    ref, ref_losses, _ = _train(model, ocfg, batches, micro=8)
    got, losses, state = _train(model, ocfg, batches, micro=32, oom_above=8)
    assert state.micro_batch == 8 and state.oom_retries == 2  # 32 -> 16 -> 8, then it stays
    assert [h["to"] for h in state.history] == [16, 8]
    assert _max_diff(ref, got) <= 1e-6
    assert losses == pytest.approx(ref_losses, rel=1e-6)


def test_oom_at_micro_batch_one_is_an_error():
    model, ocfg = _setup("sgd")
    with pytest.raises(MicroBatchExhausted):
        _train(model, ocfg, _data(1, 4), micro=4, oom_above=0)


def test_oom_late_in_the_forward_leaves_no_trace():
    """Train-mode BatchNorm and dropout; the OOM strikes at the head, after every BatchNorm layer
    has updated its running statistics. The retry restores them (and the RNG), so the run equals one
    that started at the micro-batch that fits: buffers included."""
    torch.manual_seed(0)
    model = create_model(ModelConfig(name="test_resnet", drop_rate=0.3), num_classes=5, load_weights=False)
    ocfg = OptimConfig(name="adamw", lr=1e-3)
    batches = _data(3, 32)
    torch.manual_seed(5)
    ref, ref_losses, _ = _train(model, ocfg, batches, micro=8)

    late = copy.deepcopy(model)

    def hook(_m, args):
        if args[0].shape[0] > 8:
            raise torch.OutOfMemoryError("simulated, in the head")
    late.get_classifier().register_forward_pre_hook(hook)
    torch.manual_seed(5)
    got, losses, state = _train(late, ocfg, batches, micro=32)
    assert state.oom_retries == 2
    assert _max_diff(ref, got) <= 1e-6  # state_dict: weights and BatchNorm running statistics
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    assert ref.state_dict()["bn1.num_batches_tracked"] == 12  # 3 steps x 4 micro-batches, no more


def test_grad_reducer_buckets_order_and_unused_parameters(monkeypatch):
    """GradReducer against a fake 2-process group that sums two identical processes: buckets are
    launched during backward, in order; every gradient is doubled; a parameter no process used
    keeps grad None (so the optimizer skips it, as without the reducer)."""
    from vramfit import engine

    launched = []

    class Work:
        def wait(self):
            pass

    def fake_all_reduce(flat, async_op=False):
        launched.append(flat.numel())
        flat.mul_(2)
        return Work()

    monkeypatch.setattr(engine.dist, "is_available", lambda: True)
    monkeypatch.setattr(engine.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(engine.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(engine.dist, "all_reduce", fake_all_reduce)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    unused = torch.nn.Parameter(torch.ones(3))
    params = [unused, *net.parameters()]  # reversed into the last bucket: it cannot hold up the others
    reducer = engine.GradReducer(params, bucket_bytes=64 * 4)  # buckets of >= 64 floats
    x = torch.randn(5, 8)
    reducer.arm()
    net(x).sum().backward()
    during_backward = len(launched)
    reducer.launch_rest()
    expected = [p.grad.clone() * 2 for p in net.parameters()]
    reducer.finish(apply=True)
    assert during_backward >= 1 and len(launched) == len(reducer.buckets)
    assert sum(launched) == sum(p.numel() for p in params)
    for p, e in zip(net.parameters(), expected):
        torch.testing.assert_close(p.grad, e)
    assert unused.grad is None
    assert not reducer.hooks  # nothing left attached for the next step
