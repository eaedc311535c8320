"""The optimizer step: batch splits give the same maths; an OOM only changes the split."""
import copy

import pytest
import torch
from accelerate import Accelerator

from helpers import HostReads

from vramfit import batching
from vramfit.config import ModelConfig, OptimConfig
from vramfit.models.create import create_model
from vramfit.store.resume import ResumePoint, resumed_micro_batch
from vramfit.train.optim import create_optimizer
from vramfit.train.state import TrainerState
from vramfit.train.step import MicroBatchExhausted, TrainStep


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
    step = TrainStep(acc, model, opt, micro, label_smoothing=0.1, clip_grad_norm=1.0)
    losses = [step(x, y, x.shape[0]).loss for x, y in batches]
    return acc.unwrap_model(model), losses, step.state


def _max_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_batch_splits_give_same_weights(opt):
    model, ocfg = _setup(opt)
    batches = _data(3, 16)
    ref, ref_losses, _ = _train(model, ocfg, batches, micro=16)
    for micro in (4, 7, 3, 1):  # 4 x 4; 6 + 5 + 5 and 3 x 4 + 2 x 2 (uneven, near-equal); 16 x 1
        got, losses, _ = _train(model, ocfg, batches, micro=micro)
        assert _max_diff(ref, got) <= 1e-6, f"micro {micro}"
        assert losses == pytest.approx(ref_losses, rel=1e-6)
    assert _max_diff(ref, model) > 1e-4  # it did train


def test_short_last_batch_is_weighted_by_samples():
    """A 10-sample batch in micro-batches of 4 (4+3+3) gives the mean over 10, not over 3 chunks."""
    model, ocfg = _setup("sgd")
    batches = _data(1, 10)
    ref, _, _ = _train(model, ocfg, batches, micro=10)
    got, _, _ = _train(model, ocfg, batches, micro=4)
    assert _max_diff(ref, got) <= 1e-6
    assert _max_diff(ref, model) > 1e-4  # it did train (two untouched models are equal too)


def test_oom_recovery_keeps_the_maths():
    model, ocfg = _setup("adamw")
    batches = _data(3, 32)
    ref, ref_losses, _ = _train(model, ocfg, batches, micro=8)
    got, losses, state = _train(model, ocfg, batches, micro=32, oom_above=8)
    assert state.micro_batch == 8 and state.oom_retries == 2  # 32 -> 16 -> 8, then it stays
    assert [h["to"] for h in state.history] == [16, 8]
    assert _max_diff(ref, got) <= 1e-6
    assert losses == pytest.approx(ref_losses, rel=1e-6)


def test_an_oom_lowers_the_one_micro_batch_the_step_the_checkpoint_and_the_plans_read():
    """The micro-batch in effect is one object: lowered once by the retry, the step splits by it,
    the checkpoint saves it, a resume starts under it, and the next plan (a larger image size) or a
    resumed fit's choice stays under it; a new phase's plan starts afresh."""
    model, ocfg = _setup("sgd")
    in_effect = batching.MicroBatch(32, 32, "configured").in_effect()
    state = TrainerState(in_effect=in_effect, world_size=1)
    _, _, step_state = _train(model, ocfg, _data(1, 32), micro=in_effect, oom_above=8)
    assert step_state is in_effect and in_effect.micro_batch == 8
    saved = state.state_dict()
    assert (saved["micro_batch"], saved["oom_retries"]) == (8, 2) and "in_effect" not in saved
    point = ResumePoint(None, TrainerState.from_saved(saved, "step-1"))
    resumed = batching.resolve_micro_batch(32, 32, resumed=resumed_micro_batch(point, 1, False)).in_effect(2)
    assert (resumed.micro_batch, resumed.capped(32), resumed.oom_retries) == (8, 8, 2)
    assert in_effect.enter(16, fresh=False) == 8 and in_effect.capped(32) == 8 and saved == state.state_dict()
    assert in_effect.enter(16, fresh=True) == 16 and in_effect.capped(32) == 32


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
    keeps grad None (so the optimizer skips it, as without the reducer); the flat buffers are
    allocated once and reused by every step."""
    from vramfit.runtime import collectives

    launched = []

    class Work:
        def wait(self):
            pass

    def fake_all_reduce(flat, async_op=False):
        launched.append((flat.numel(), flat.data_ptr()))
        flat.mul_(2)
        return Work()

    monkeypatch.setattr(collectives, "world_size", lambda: 2)
    monkeypatch.setattr(collectives.dist, "all_reduce", fake_all_reduce)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    unused = torch.nn.Parameter(torch.ones(3))
    params = [unused, *net.parameters()]  # reversed into the last bucket: it cannot hold up the others
    reducer = collectives.GradReducer(params, bucket_bytes=64 * 4)  # buckets of >= 64 floats
    buffers = [f.data_ptr() for f in reducer.flats]
    for _ in range(2):
        launched.clear()
        for p in params:
            p.grad = None
        reducer.arm()
        net(torch.randn(5, 8)).sum().backward()
        during_backward = len(launched)
        reducer.launch_rest()
        expected = [p.grad.clone() * 2 for p in net.parameters()]
        reducer.finish(apply=True)
        assert during_backward >= 1 and len(launched) == len(reducer.buckets)
        assert sum(n for n, _ in launched) == sum(p.numel() for p in params)
        assert sorted(ptr for _, ptr in launched) == sorted(buffers)  # the same buffers every step
        for p, e in zip(net.parameters(), expected):
            torch.testing.assert_close(p.grad, e)
        assert unused.grad is None
        assert not reducer.hooks  # nothing left attached for the next step
    assert reducer.buffer_bytes == collectives.reducer_buffer_bytes(
        [(p.numel() * p.element_size(), p.dtype) for p in params], 64 * 4)


def test_no_micro_batch_holds_a_single_sample():
    """Train-mode BatchNorm cannot normalise one sample (test_resnet's head BN sees a 1x1 map): a
    short last batch of 29 at micro-batch 4 splits 4+4+4+4+4+3+3+3, an odd share at micro-batch 2
    takes a chunk of 3, and the step trains instead of dying."""
    from vramfit import batching

    assert [e - s for s, e in batching.chunk_bounds(29, batching.num_chunks([29], 4))] == [4] * 5 + [3] * 3
    assert [e - s for s, e in batching.chunk_bounds(7, batching.num_chunks([7], 2))] == [3, 2, 2]
    for share in range(2, 70):
        for micro in range(1, share + 1):
            sizes = [e - s for s, e in batching.chunk_bounds(share, batching.num_chunks([share], micro))]
            assert sum(sizes) == share and max(sizes) - min(sizes) <= 1
            assert micro == 1 or min(sizes) >= 2, (share, micro)
            assert micro < 2 or max(sizes) <= max(micro, 3), (share, micro)
    torch.manual_seed(0)
    model = create_model(ModelConfig(name="test_resnet"), num_classes=5, load_weights=False)
    _, losses, state = _train(model, OptimConfig(), _data(1, 29), micro=4)
    assert state.oom_retries == 0 and losses[0] > 0


def test_steps_per_epoch_and_shares_do_not_depend_on_the_process_count():
    """66 images at global batch 16: 5 steps (the last of 2 images) on 1, 2 or 8 processes; every
    share holds 0 or >= 2 samples and the shares add up to the batch."""
    from vramfit import batching

    assert batching.steps_per_epoch(66, 16) == 5 and batching.steps_per_epoch(65, 16) == 4
    for world in (1, 2, 3, 8):
        for n in range(2, 40):
            shares = batching.rank_shares(n, world)
            assert sum(shares) == n and all(s == 0 or s >= 2 for s in shares)
    assert batching.rank_shares(2, 2) == [2, 0] and batching.rank_shares(16, 2) == [8, 8]


def test_micro_batch_rule(caplog):
    from vramfit.batching import resolve_micro_batch

    assert resolve_micro_batch(None, 32).size == 32
    assert resolve_micro_batch("auto", 32).size == 32  # nothing to size against
    assert resolve_micro_batch("auto", 32, pick=lambda share: 12).grad_accum_steps == 3
    big = resolve_micro_batch(64, 8)
    assert big.size == 8 and "larger than this process's share" in big.note
    assert resolve_micro_batch(10, 30).grad_accum_steps == 3  # no longer has to divide
    back = resolve_micro_batch(16, 32, resumed=4)
    assert (back.size, back.source) == (4, "resumed") and ("came" in back.note or "come" in back.note)


def test_thrashing_shrinks_but_never_fails_a_finished_step(monkeypatch, caplog):
    """The allocator had to free its cache to fit: the next step splits smaller; at micro-batch 1
    there is nothing smaller, so a warning, and the finished step stands."""
    from vramfit.train import step as train_step

    retries = iter(range(0, 1000, 1))
    monkeypatch.setattr(train_step, "_alloc_retries", lambda device: next(retries))
    model, ocfg = _setup("sgd")
    _, losses, state = _train(model, ocfg, _data(4, 4), micro=2)
    assert [h["to"] for h in state.history] == [1] and state.micro_batch == 1
    assert len(losses) == 4 and "allocator had to free its cache" in caplog.text


def test_gradient_checkpointing_counts_each_batch_once_in_batchnorm():
    """Backward re-runs checkpointed forwards; their BatchNorm updates are put back, so with
    checkpointing the running statistics (and weights) equal a run without it."""
    torch.manual_seed(0)
    plain = create_model(ModelConfig(name="test_resnet"), num_classes=5, load_weights=False)
    ckpt = copy.deepcopy(plain)
    ckpt.set_grad_checkpointing(True)
    batches = _data(2, 8)
    results = []
    for model, recomputes in ((plain, False), (ckpt, True)):
        acc = Accelerator(cpu=True)
        opt = create_optimizer(model, OptimConfig())
        step = TrainStep(acc, model, opt, 4, label_smoothing=0.0, clip_grad_norm=None, recomputes=recomputes)
        for x, y in batches:
            step(x, y, 8)
        results.append(model.state_dict())
    tracked = {k: v.item() for k, v in results[1].items() if k.endswith("num_batches_tracked")}
    assert set(tracked.values()) == {4}  # 2 steps x 2 micro-batches, not twice that
    assert _max_diff_sd(results[0], results[1]) <= 1e-6


def _max_diff_sd(a, b):
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_a_step_waits_for_the_device_twice_whatever_the_micro_batch_count(monkeypatch):
    """Host synchronisations of one step (device -> host reads), counted on a CPU by watching the
    tensor methods that read a value back (on a GPU `torch.cuda.set_sync_debug_mode` shows the
    same): the vote and the gradient norm, for 1 or 8 micro-batches; none per micro-batch. The
    optimizer's own step is left out (AdamW reads its step counter, a CPU tensor)."""
    reads = HostReads(monkeypatch)
    model, ocfg = _setup("adamw")
    acc = Accelerator(cpu=True)
    opt = create_optimizer(model, ocfg)
    model, opt = acc.prepare(model, opt)
    real_step = opt.step

    def quiet_step(*a, **k):
        reads.on = False
        try:
            return real_step(*a, **k)
        finally:
            reads.on = True
    opt.step = quiet_step
    for micro in (16, 2):
        step = TrainStep(acc, model, opt, micro, label_smoothing=0.1, clip_grad_norm=1.0)
        x, y = _data(1, 16)[0]
        reads.seen.clear()
        reads.on = True
        step(x, y, 16)
        reads.on = False
        assert sorted(reads.seen) == ["__float__", "tolist"], (micro, reads.seen)


@pytest.mark.parametrize("per_step", [True, False])
def test_running_statistics_move_per_step_however_the_step_is_split(per_step):
    """`model.bn_momentum_per: step`: four micro-batches of 8 with the same statistics leave BatchNorm's
    running mean and variance where one forward of 32 leaves them (the momentum per forward is the
    4th root); `micro_batch` updates them four times at the full momentum. The momentum is put
    back for a step taken whole."""
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(3)
    model = torch.nn.Sequential(bn, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(3, 5))
    chunk = torch.randn(8, 3, 6, 6) * 3 + 2
    images, labels = chunk.repeat(4, 1, 1, 1), torch.randint(0, 5, (32,))
    acc = Accelerator(cpu=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = acc.prepare(model, opt)
    whole = copy.deepcopy(bn)
    whole(images)  # one forward of the whole batch, momentum 0.1
    step = TrainStep(acc, model, opt, 8, bn_momentum_per_step=per_step)
    step(images, labels, 32)
    assert torch.allclose(bn.running_mean, whole.running_mean, atol=1e-6) is per_step
    # The variance each forward brings is unbiased over its own 8 samples (n - 1 = 7), so it is
    # compared with one update by that variance.
    chunk_var = chunk.transpose(0, 1).reshape(3, -1).var(dim=1, unbiased=True)
    assert torch.allclose(bn.running_var, 0.9 + 0.1 * chunk_var, rtol=1e-5) is per_step
    if per_step:
        assert bn.momentum == pytest.approx(1 - 0.9 ** 0.25)
        step.state.micro_batch = 32
        step(images, labels, 32)
        assert bn.momentum == 0.1


def test_evaluation_reports_the_loss_of_the_step_maths_unsmoothed():
    """One definition of the loss of a batch (train.step.StepMaths.loss): evaluation reports it without
    label smoothing, lr-find's criterion is its mean, and a loss changed there changes both."""
    from dataclasses import replace
    from types import SimpleNamespace

    from vramfit.train.step import cross_entropy_sum, step_maths
    from vramfit.train.validation import EvalState, evaluate

    model, _ = _setup()
    x, y = _data(1, 12)[0]
    loader = [SimpleNamespace(images=x, labels=y, indices=torch.arange(12), bad=[])]
    maths = step_maths(SimpleNamespace(label_smoothing=0.1, clip_grad_norm=None))

    def loss_of(m):
        return evaluate(Accelerator(cpu=True), model, loader, 5, lambda t: t, EvalState(4), maths=m).loss

    with torch.no_grad():
        expected = float(cross_entropy_sum(model(x), y, 0.0)) / 12
        assert float(maths.mean_loss(model(x), y)) == pytest.approx(float(cross_entropy_sum(model(x), y, 0.1)) / 12)
    assert loss_of(maths) == pytest.approx(expected, rel=1e-6)
    doubled = replace(maths, loss_fn=lambda logits, t, s: 2 * cross_entropy_sum(logits, t, s))
    assert loss_of(doubled) == pytest.approx(2 * expected, rel=1e-6)
