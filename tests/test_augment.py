"""On-device batch augmentation: normalisation, colour jitter, random erasing, mixup/cutmix; seeded by
position."""
import json

import pytest
import torch

from helpers import HOST_READS, MEAN_STD, HostReads, last_weights, same_weights, tiny_args
from vramfit import data as D
from vramfit.config import DataConfig
from vramfit.data.augment import DeviceAugment



def device_augment(cfg: DataConfig, num_classes=5, label_smoothing=0.0, seed=0, rank=0, device_type="cuda"):
    """The run's DeviceAugment; `device_type` is the run's (where `auto` puts the colour jitter)."""
    return DeviceAugment(cfg, num_classes, label_smoothing, seed, rank, **MEAN_STD, device_type=device_type)


def batch(n=6, size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=g),
            torch.randint(0, 5, (n,), generator=g))


def test_normalizer_matches_the_reference_and_keeps_the_input():
    x, _ = batch()
    keep = x.clone()
    out = D.normalizer(MEAN_STD, "cpu", channels_last=True)(x)
    mean = torch.tensor(MEAN_STD["mean"]).view(1, 3, 1, 1)
    std = torch.tensor(MEAN_STD["std"]).view(1, 3, 1, 1)
    torch.testing.assert_close(out, (x.float() / 255 - mean) / std, rtol=0, atol=1e-5)
    assert out.dtype == torch.float32 and out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(x, keep)


def test_no_augmentation_is_the_identity():
    aug = device_augment(DataConfig(color_jitter=0.0), label_smoothing=0.1)
    x, y = batch()
    xf = x.float()
    out, t = aug(xf.clone(), y, epoch=0, step=3)
    assert torch.equal(out, xf) and torch.equal(t, y) and not aug.soft_targets


def test_random_erasing_is_seeded_by_position():
    aug = device_augment(DataConfig(reprob=1.0, color_jitter=0.0), seed=1)
    x = torch.zeros(4, 3, 32, 32)
    a, _ = aug(x.clone(), torch.zeros(4, dtype=torch.long), epoch=0, step=5)
    b, _ = aug(x.clone(), torch.zeros(4, dtype=torch.long), epoch=0, step=5)
    c, _ = aug(x.clone(), torch.zeros(4, dtype=torch.long), epoch=0, step=6)
    d, _ = aug(x.clone(), torch.zeros(4, dtype=torch.long), epoch=1, step=5)
    assert all(bool((a[i] != 0).any()) for i in range(4))  # probability 1: every sample erased
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, d)
    # The caller's RNG streams are untouched (dropout after the step draws as without erasing).
    torch.manual_seed(3)
    before = torch.rand(3)
    torch.manual_seed(3)
    aug(x.clone(), torch.zeros(4, dtype=torch.long), epoch=0, step=5)
    assert torch.equal(torch.rand(3), before)


def _torchvision_jitter(pixels, factors, order):
    """torchvision's own ColorJitter operations, one image at a time, in the drawn order."""
    import torchvision.transforms.functional as F

    ops = (F.adjust_brightness, F.adjust_contrast, F.adjust_saturation)
    out = []
    for img, f, o in zip(pixels, factors, order):
        for k in o.tolist():
            img = ops[k](img, float(f[k]))
        out.append(img)
    return torch.stack(out)


def test_color_jitter_is_torchvisions_per_sample():
    """Each sample gets its own factors and its own order of brightness, contrast and saturation
    (drawn by torchvision's get_params), and the result is torchvision's ColorJitter with those
    draws (in pixel values, then normalised), for either memory format."""
    from vramfit.data.augment import ColorJitter

    x, _ = batch(n=12, size=20, seed=4)
    torch.manual_seed(0)
    params = torch.stack([D.jitter_params(0.4) for _ in range(12)])
    factors, order = params[:, :3], params[:, 3:].long()
    assert ((0.6 <= factors) & (factors <= 1.4)).all()
    assert all(sorted(o) == [0, 1, 2] for o in order.tolist())
    assert len({tuple(o) for o in order.tolist()}) > 1  # orders differ between samples
    for layout in (True, False):
        norm = D.normalizer(MEAN_STD, "cpu", channels_last=layout)
        images = norm(x)
        jitter = ColorJitter(**MEAN_STD)
        jitter.apply(images, params)
        expected = norm((_torchvision_jitter(x.float() / 255, factors, order) * 255))
        torch.testing.assert_close(images, expected, rtol=0, atol=1e-4)
        again = norm(x)  # NO_JITTER changes nothing
        jitter.apply(again, D.NO_JITTER.expand(12, 6))
        torch.testing.assert_close(again, norm(x), rtol=0, atol=1e-5)


def test_color_jitter_is_placed_where_it_is_cheapest_and_needs_the_samples_parameters():
    """`auto` puts it on the device on an accelerator and in the loader (timm's own transform) on
    the CPU; an auto-augment policy turns it off unless it is a '3a' one, as in timm. On the device
    it takes each sample's parameters from the batch."""
    import torchvision.transforms as T

    on = D.color_jitter_on
    assert (on(DataConfig(), "cuda"), on(DataConfig(), "cpu")) == ("device", "loader")
    assert on(DataConfig(color_jitter_on="device"), "cpu") == "device"
    assert on(DataConfig(color_jitter=0.0), "cuda") is None
    assert on(DataConfig(auto_augment="rand-m9-mstd0.5"), "cuda") is None
    assert on(DataConfig(auto_augment="3a"), "cuda") == "device"
    assert device_augment(DataConfig(), device_type="cpu").jitter is None
    data_cfg = {**MEAN_STD, "input_size": (3, 32, 32)}

    def jitters(device_type):
        train, _ = D.build_transforms(DataConfig(image_size=32), data_cfg, device_type)
        return any(isinstance(t, T.ColorJitter) for t in train.transforms)

    assert jitters("cpu") and not jitters("cuda")
    aug = device_augment(DataConfig())  # the default, 0.4, on the device
    images = D.normalizer(MEAN_STD, "cpu", channels_last=False)(batch(n=4)[0])
    params = torch.stack([D.jitter_params(0.4) for _ in range(4)])
    out, _ = aug(images.clone(), torch.zeros(4, dtype=torch.long), epoch=0, step=1, jitter=params)
    assert not torch.equal(out, images)
    with pytest.raises(ValueError, match="no jitter parameters"):
        aug(images.clone(), torch.zeros(4, dtype=torch.long), epoch=0, step=1)
    empty = torch.empty(0, 3, 32, 32)  # a process whose share of a step is empty
    assert aug(empty, torch.empty(0, dtype=torch.long), epoch=0, step=1)[0].shape == (0, 3, 32, 32)


def test_device_augmentation_never_waits_for_the_device(monkeypatch):
    """Jitter, erasing, mixup and cutmix read nothing back from the batch (counted on a CPU by
    watching the tensor methods that would wait for a GPU) and make the erasing noise on the
    batch's device (a patch made on the host is a copy, and a wait, per erased sample)."""
    import timm.data.random_erasing as RE

    made_on = []
    real_pixels = RE._get_pixels
    monkeypatch.setattr(RE, "_get_pixels", lambda *a, **k: (made_on.append(k["device"]), real_pixels(*a, **k))[1])
    params = torch.stack([D.jitter_params(0.4) for _ in range(8)])  # drawn in the loader workers
    reads = HostReads(monkeypatch, (*HOST_READS, "cpu", "numpy"), on=True)
    aug = device_augment(DataConfig(reprob=1.0, mixup=0.8, cutmix=1.0))
    for step in range(4):  # mixup on some steps, cutmix on others
        aug(torch.randn(8, 3, 16, 16), torch.arange(8) % 5, epoch=0, step=step, jitter=params)
    assert reads.seen == [] and made_on
    # On a device that is not the host ("meta" stands in for a GPU here), the noise is made there.
    made_on.clear()
    aug = device_augment(DataConfig(reprob=1.0, mixup=0.8, color_jitter=0.0))
    aug(torch.empty(8, 3, 16, 16, device="meta"), torch.arange(8, device="meta") % 5, epoch=0, step=1)
    assert made_on and all(torch.device(d).type == "meta" for d in made_on)


@pytest.mark.parametrize("n", [6, 5, 1])
def test_mixup_mixes_pairs_and_targets_sum_to_one(n):
    aug = device_augment(DataConfig(mixup=0.8, color_jitter=0.0), label_smoothing=0.1)
    x, y = batch(n)
    xf = x.float()
    out, t = aug(xf.clone(), y, epoch=0, step=1)
    assert aug.soft_targets and t.shape == (n, 5)
    torch.testing.assert_close(t.sum(1), torch.ones(n))
    even = n - n % 2
    if even:
        lam = float(t[0, y[0]] - (0.1 / 5)) if y[0] != y[even - 1] else None
        if lam is not None:  # image = lam * x + (1 - lam) * partner, target the same mixture
            lam = lam / 0.9
            torch.testing.assert_close(out[0], lam * xf[0] + (1 - lam) * xf[even - 1], rtol=1e-5, atol=1e-3)
    if n % 2:  # the odd sample out stays as it was, with a smoothed one-hot target
        assert torch.equal(out[-1], xf[-1])
        assert float(t[-1, y[-1]]) == pytest.approx(0.9 + 0.1 / 5)


def test_cutmix_pastes_a_box_and_is_seeded():
    aug = device_augment(DataConfig(cutmix=1.0, color_jitter=0.0))
    x = torch.stack([torch.full((3, 16, 16), float(i)) for i in range(4)])
    y = torch.tensor([0, 1, 2, 3])
    a, ta = aug(x.clone(), y, epoch=0, step=2)
    b, tb = aug(x.clone(), y, epoch=0, step=2)
    assert torch.equal(a, b) and torch.equal(ta, tb)
    pasted = (a[0] == 3.0).float().mean()  # sample 0's partner is sample 3
    assert 0 < float(pasted) < 1
    assert float(ta[0, 3]) == pytest.approx(float(pasted), abs=1e-6)  # lambda corrected to the box
    r1, _ = device_augment(DataConfig(cutmix=1.0, color_jitter=0.0), rank=1)(x.clone(), y, epoch=0, step=2)
    assert not torch.equal(a, r1)  # ranks draw their own boxes


def test_soft_target_loss_equals_hard_loss_on_one_hot():
    from vramfit.train.step import cross_entropy_sum, hits

    logits = torch.randn(4, 5)
    y = torch.tensor([0, 3, 1, 4])
    onehot = torch.nn.functional.one_hot(y, 5).float()
    torch.testing.assert_close(cross_entropy_sum(logits, onehot, 0.0), cross_entropy_sum(logits, y, 0.0))
    assert hits(logits, onehot) == hits(logits, y)


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_training_with_every_device_augmentation_and_exact_resume(train_cli, tmp_path):
    """The full train path with every device augmentation on; an interrupted and resumed run ends
    with the same weights as an uninterrupted one (augmentation is a function of the position)."""
    aug = ("--set", "data.reprob=0.5", "--set", "data.mixup=0.8", "--set", "data.cutmix=1.0",
           "--set", "data.color_jitter_on=device",
           "--set", "data.limit_train_samples=160", "--set", "train.log_every_steps=1")
    full, code = train_cli(*tiny_args(*aug), run_name="full")
    assert code == 0
    losses = [m["train/loss"] for m in _metrics(full) if m["kind"] == "train"]
    assert len(losses) == 10 and all(0 < v < 10 for v in losses)
    part, code = train_cli(*tiny_args(*aug, "--set", "debug.signal_at_step=4"), run_name="part")
    assert code == 143
    part, code = train_cli(*tiny_args(*aug), run_name="part")
    assert code == 0

    assert same_weights(last_weights(full), last_weights(part))
