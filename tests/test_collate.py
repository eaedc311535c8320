"""Batches are stacked as NHWC (channels_last strides) for speed; the values, and the memory format
the model receives after the normalizer, are what they were."""

import numpy as np
import torch
import torchvision.transforms.functional as F
from PIL import Image

from helpers import MEAN_STD
from vramfit import data as D



def samples():
    rng = np.random.default_rng(0)
    images = [F.pil_to_tensor(Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))) for _ in range(3)]
    images.append(torch.zeros(3, 8, 8, dtype=torch.uint8))  # an unreadable image's placeholder (contiguous CHW)
    return [D.Sample(im, i, i, 4, "") for i, im in enumerate(images)], images


def test_collate_keeps_values_and_gives_channels_last_strides():
    items, images = samples()
    batch = D.collate(items, image_size=8)
    assert batch.images.shape == (4, 3, 8, 8) and batch.images.dtype == torch.uint8
    assert torch.equal(batch.images, torch.stack(images))
    assert batch.images.is_contiguous(memory_format=torch.channels_last)
    assert batch.labels.tolist() == [0, 1, 2, 3] and batch.step_samples == 4


def test_normalizer_gives_the_model_its_memory_format():
    """The NHWC batch normalises to what the plain CHW stack does, in the format the model asked
    for, and to the values (pixel / 255 - mean) / std written out here, not by the normalizer."""
    items, images = samples()
    batch = D.collate(items, image_size=8)
    mean = torch.tensor(MEAN_STD["mean"]).view(1, 3, 1, 1)
    std = torch.tensor(MEAN_STD["std"]).view(1, 3, 1, 1)
    reference = (torch.stack(images).float() / 255 - mean) / std
    for channels_last in (False, True):
        x = D.normalizer(MEAN_STD, "cpu", channels_last)(batch.images)
        expected = D.normalizer(MEAN_STD, "cpu", channels_last)(torch.stack(images))
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        assert x.is_contiguous(memory_format=fmt) and torch.equal(x, expected)
        torch.testing.assert_close(x, reference, rtol=0, atol=1e-5)
