"""vramfit.data, commands/scan_data.py, commands/prepare.py: every source kind, bad files counted
exactly, every mode to RGB uint8, deterministic batches, scan-data and prepare end to end. All data is generated here (no Hub)."""
import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import (BAD_KINDS, DATA_CFG_32, bad_file, cfg, class_tree, encode, metrics, picture, save,
                     train_args, transforms_32, write_bytes)
from vramfit import data as D
from vramfit.config import DataConfig
from vramfit.errors import VramfitError

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"


# ---- image folders ------------------------------------------------------------------------------


def test_split_folders(tmp_path):
    class_tree(tmp_path / "train", {"cat": 5, "dog": 4})
    class_tree(tmp_path / "val", {"cat": 2, "dog": 1}, seed=1)
    class_tree(tmp_path / "test", {"cat": 1, "dog": 1}, seed=2)
    s = D.load_splits(cfg(tmp_path))
    assert (len(s.train), len(s.val)) == (9, 3)
    assert s.class_names == ["cat", "dog"] and (s.image_column, s.label_column) == ("image", "label")
    assert sorted(s.val["label"]) == [0, 0, 1]
    assert not any("held out" in n for n in s.notes)
    assert any("test split left for `vramfit eval --split test`" in n for n in s.notes)
    # data.val_split picks another split folder
    assert len(D.load_splits(cfg(tmp_path, val_split="test")).val) == 2


def test_single_folder_is_split_by_seeded_stratified_holdout(tmp_path):
    class_tree(tmp_path, {"a": 10, "b": 20, "c": 1})  # c: one image, stays in train
    s = D.load_splits(cfg(tmp_path, val_fraction=0.2, split_seed=3))
    val_labels = sorted(s.val["label"])
    # ceil(0.2 * 31) = 7 held out (the library's rounding), in proportion, never c's only image
    assert len(val_labels) == 7 and val_labels.count(0) >= 2 and val_labels.count(1) >= 4
    assert 2 not in val_labels
    assert len(s.train) + len(s.val) == 31 and any("held out 20%" in n for n in s.notes)
    same = D.load_splits(cfg(tmp_path, val_fraction=0.2, split_seed=3))
    other = D.load_splits(cfg(tmp_path, val_fraction=0.2, split_seed=4))
    paths = lambda ds: sorted(r["path"] for r in ds["image"])  # noqa: E731
    assert paths(same.val) == paths(s.val) and paths(other.val) != paths(s.val)


def test_nested_classes_use_the_first_level_folder(tmp_path):
    # A wrapper folder (as unzipped), then classes with sub-folders of any depth.
    root = tmp_path / "data"
    class_tree(root / "animals" / "cat", {"indoor": 3, "outdoor": 2})
    class_tree(root / "animals", {"dog": 4})
    class_tree(root / "animals" / "dog" / "puppies", {"small": 2}, seed=5)
    src = D.load_source(cfg(root))
    assert src.class_names == ["cat", "dog"]
    labels = src.train["label"]
    assert list(labels).count(0) == 5 and list(labels).count(1) == 6
    assert any("first-level folder" in n for n in src.notes) and any("animals" in n for n in src.notes)
    # Two top-level groups: they are the classes (first level), not cat/dog/car.
    class_tree(tmp_path / "two" / "vehicles", {"car": 2})
    class_tree(tmp_path / "two" / "animals", {"cat": 2, "dog": 2})
    assert D.load_source(cfg(tmp_path / "two")).class_names == ["animals", "vehicles"]


def test_mixed_extensions_load_and_non_images_are_counted(tmp_path):
    exts = {".jpg": "JPEG", ".JPG": "JPEG", ".jpeg": "JPEG", ".png": "PNG", ".webp": "WEBP",
            ".bmp": "BMP", ".tif": "TIFF", ".TIFF": "TIFF", ".gif": "GIF"}
    for i, (ext, fmt) in enumerate(exts.items()):
        for c in ("x", "y"):
            save(tmp_path / c / f"img{i}{ext}", picture(20, 16, i), fmt)
    write_bytes(tmp_path / "x" / "notes.txt", b"hello")
    write_bytes(tmp_path / "x" / ".DS_Store", b"\0" * 10)
    write_bytes(tmp_path / "y" / "Thumbs.db", b"\0" * 10)
    write_bytes(tmp_path / "y" / "._img0.jpg", b"\0" * 10)  # macOS AppleDouble: not an image
    write_bytes(tmp_path / "README.md", b"# data")
    src = D.load_source(cfg(tmp_path))
    assert len(src.train) == 2 * len(exts)
    (note,) = [n for n in src.notes if "not images" in n]
    assert note.startswith("ignored 5 file(s)")
    for kind in (".txt 1", ".DS_Store 1", "Thumbs.db 1", ".md 1", "._* (macOS) 1"):
        assert kind in note
    ds = D.ImageDataset(src.train, "image", "label", lambda im: np.asarray(im), 16, 0, train=False)
    assert all(ds[i].bad == "" and ds[i].image.shape == (16, 20, 3) for i in range(len(ds)))


# ---- Arrow / parquet / Hub-style sources --------------------------------------------------------


def hub_style(n=12, string_labels=False):
    """CIFAR-100-like columns: `img` (Image), `fine_label` and `coarse_label` (ClassLabel)."""
    import datasets

    imgs = [{"bytes": encode(picture(16, 16, i), "PNG"), "path": f"{i}.png"} for i in range(n)]
    fine = [i % 3 for i in range(n)]
    if string_labels:
        return datasets.Dataset.from_dict({"img": imgs, "fine_label": [["owl", "cat", "bee"][f] for f in fine]},
                                          features=datasets.Features({"img": datasets.Image(),
                                                                      "fine_label": datasets.Value("string")}))
    return datasets.Dataset.from_dict(
        {"img": imgs, "coarse_label": [i % 2 for i in range(n)], "fine_label": fine},
        features=datasets.Features({"img": datasets.Image(),
                                    "coarse_label": datasets.ClassLabel(names=["animal", "thing"]),
                                    "fine_label": datasets.ClassLabel(names=["apple", "bee", "cat"])}))


def check_hub_columns(src, n_train, n_val):
    assert (src.image_column, src.label_column) == ("img", "fine_label")
    assert src.class_names == ["apple", "bee", "cat"]
    assert len(src.train) == n_train and (src.val is None if n_val is None else len(src.val) == n_val)
    item = src.train[0]["img"]
    assert isinstance(item, dict) and item["bytes"]  # undecoded: workers decode
    ds = D.ImageDataset(src.train, src.image_column, src.label_column, lambda im: np.asarray(im), 16, 0, False)
    assert ds[0].image.shape == (16, 16, 3) and ds[0].label == src.train[0]["fine_label"]


def test_save_to_disk_with_hub_style_columns(tmp_path):
    import datasets

    datasets.DatasetDict({"train": hub_style(12), "validation": hub_style(6)}).save_to_disk(str(tmp_path / "dd"))
    check_hub_columns(D.load_source(cfg(tmp_path / "dd")), 12, 6)
    hub_style(9).save_to_disk(str(tmp_path / "one"))  # a single Dataset: held out at load_splits
    check_hub_columns(D.load_source(cfg(tmp_path / "one")), 9, None)
    s = D.load_splits(cfg(tmp_path / "one", val_fraction=0.34))
    assert len(s.val) == 4 and len(s.train) == 5


def test_parquet_file_and_folder(tmp_path):
    hub_style(12).to_parquet(str(tmp_path / "one.parquet"))
    check_hub_columns(D.load_source(cfg(tmp_path / "one.parquet", cache_dir=str(tmp_path))), 12, None)
    folder = tmp_path / "pq" / "data"
    folder.mkdir(parents=True)
    hub_style(12).to_parquet(str(folder / "train-00000-of-00001.parquet"))
    hub_style(6).to_parquet(str(folder / "validation-00000-of-00001.parquet"))
    check_hub_columns(D.load_source(cfg(tmp_path / "pq", cache_dir=str(tmp_path))), 12, 6)


def test_parquet_without_hf_metadata_and_string_labels(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    imgs = [{"bytes": encode(picture(16, 16, i), "JPEG"), "path": None} for i in range(8)]
    table = pa.table({"image": imgs, "label": ["dog", "cat", "ant", "dog"] * 2})
    pq.write_table(table, tmp_path / "plain.parquet")  # no HF features metadata at all
    src = D.load_source(cfg(tmp_path / "plain.parquet", cache_dir=str(tmp_path)))
    assert (src.image_column, src.label_column) == ("image", "label")
    assert src.class_names == ["ant", "cat", "dog"] and list(src.train["label"])[:4] == [2, 1, 0, 2]


def test_arrow_file_and_folder(tmp_path):
    import datasets

    hub_style(12).save_to_disk(str(tmp_path / "saved"))
    (arrow,) = (tmp_path / "saved").glob("*.arrow")
    check_hub_columns(D.load_source(cfg(arrow, cache_dir=str(tmp_path))), 12, None)
    folder = tmp_path / "arrows"
    folder.mkdir()
    for split, n in (("train", 12), ("validation", 6)):
        ds = hub_style(n)
        ds.save_to_disk(str(tmp_path / split))
        (f,) = (tmp_path / split).glob("*.arrow")
        f.rename(folder / f"mydata-{split}.arrow")
    src = D.load_source(cfg(folder, cache_dir=str(tmp_path)))  # HF's cache kept out of ~/.cache
    check_hub_columns(src, 12, 6)
    assert isinstance(src.train.features["fine_label"], datasets.ClassLabel)


def test_string_and_sparse_int_labels_map_to_sorted_classes(tmp_path):
    hub_style(9, string_labels=True).save_to_disk(str(tmp_path / "s"))
    src = D.load_source(cfg(tmp_path / "s"))
    assert src.class_names == ["bee", "cat", "owl"] and list(src.train["fine_label"])[:3] == [2, 1, 0]
    import datasets

    imgs = [{"bytes": encode(picture(8, 8, i), "PNG"), "path": None} for i in range(4)]
    datasets.Dataset.from_dict({"image": imgs, "target": [10, 2, 10, 7]},
                               features=datasets.Features({"image": datasets.Image(),
                                                           "target": datasets.Value("int64")})
                               ).save_to_disk(str(tmp_path / "sparse"))
    src = D.load_source(cfg(tmp_path / "sparse"))
    assert src.class_names == ["2", "7", "10"] and list(src.train["target"]) == [2, 0, 2, 1]


def test_column_overrides(tmp_path):
    hub_style(6).save_to_disk(str(tmp_path / "d"))
    src = D.load_source(cfg(tmp_path / "d", label_column="coarse_label"))
    assert src.label_column == "coarse_label" and src.class_names == ["animal", "thing"]
    with pytest.raises(VramfitError, match="not a column") as e:
        D.load_source(cfg(tmp_path / "d", image_column="picture"))
    assert "img" in e.value.hint


# ---- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("case,needle", [
    ("missing", "no such file or folder"), ("empty", "empty folder"), ("one", "only one class"),
    ("no-images", "no images in class folders"), ("remote-code", "trust_remote_code"),
    ("flat", "no images in class folders"), ("empty-parquet", "empty-00000.parquet (an empty file)"),
    ("cut-parquet", "cut-00000.parquet (ArrowInvalid"),
])
def test_bad_input_raises_with_a_hint(tmp_path, case, needle):
    kw = {}
    if case.endswith("parquet"):  # one good file, one bad: the bad one is named, not the folder
        src = tmp_path / "pq"
        src.mkdir()
        hub_style(6).to_parquet(str(src / "train-00000.parquet"))
        good = (src / "train-00000.parquet").read_bytes()
        (src / f"{case.split('-')[0]}-00000.parquet").write_bytes(b"" if case == "empty-parquet" else good[:len(good) // 2])
    elif case == "missing":
        src = tmp_path / "nope"
    elif case == "empty":
        src = tmp_path / "e"
        src.mkdir()
    elif case == "one":
        src = class_tree(tmp_path / "o", {"cats": 4})
    elif case == "no-images":
        src = tmp_path / "n"
        write_bytes(src / "a" / "x.txt", b"x")
    elif case == "flat":  # images, but no class folders
        src = tmp_path / "f"
        for i in range(3):
            save(src / f"{i}.png", picture(8, 8, i))
    else:
        src, kw = "someone/some-dataset", {"trust_remote_code": True}
    with pytest.raises(VramfitError) as e:
        D.load_splits(cfg(src, **kw))
    assert needle in e.value.message and e.value.hint


# ---- decoding through ImageDataset + transforms -----------------------------------------------

MODE_FILES = [("1", "PNG"), ("L", "PNG"), ("LA", "PNG"), ("P", "PNG"), ("RGBA", "PNG"), ("I;16", "PNG"),
              ("L", "JPEG"), ("CMYK", "JPEG"), ("RGB", "JPEG"), ("CMYK", "TIFF"), ("YCbCr", "TIFF"),
              ("LAB", "TIFF"), ("I", "TIFF"), ("F", "TIFF"), ("RGBA", "WEBP"), ("P", "GIF"), ("RGB", "BMP")]


@pytest.fixture(scope="module")
def transforms():
    return transforms_32()


def test_every_mode_comes_out_3_channel_uint8(transforms):
    import datasets

    items = []
    for i, (mode, fmt) in enumerate(MODE_FILES):
        img = picture(37, 23, i).convert("L").convert(mode) if mode in ("I;16", "I", "F") else picture(37, 23, i, mode)
        items.append({"bytes": encode(img, fmt), "path": f"{mode}.{fmt.lower()}"})
    items.append({"bytes": encode(picture(1, 1, 0), "PNG"), "path": "1x1.png"})
    items.append({"bytes": encode(picture(2, 100, 0), "JPEG"), "path": "1to50.jpg"})
    hf = datasets.Dataset.from_dict({"image": items, "label": list(range(len(items)))},
                                    features=datasets.Features({"image": datasets.Image(decode=False),
                                                                "label": datasets.Value("int64")}))
    train_tf, val_tf = transforms
    for tf, train in ((train_tf, True), (val_tf, False)):
        ds = D.ImageDataset(hf, "image", "label", tf, 32, 0, train=train)
        for i in range(len(ds)):
            sample = ds[(i, 0, len(ds)) if train else i]
            assert sample.bad == "" and sample.label == i, items[i]["path"]
            assert sample.image.dtype == torch.uint8 and tuple(sample.image.shape) == (3, 32, 32), items[i]["path"]


def test_draft_size_follows_the_transform():
    from timm.data import create_transform

    train = create_transform(224, is_training=True, scale=(0.08, 1.0), use_prefetcher=True)
    val = create_transform(224, is_training=False, crop_pct=0.875, use_prefetcher=True)
    mild = create_transform(224, is_training=True, scale=(0.9, 1.0), use_prefetcher=True)
    assert D.draft_size(train, 224) == 336  # capped at 1.5x (1 / sqrt(0.08) would be 3.5x)
    assert D.draft_size(val, 224) == 256  # exactly what Resize needs
    assert D.draft_size(mild, 224) == 237  # ceil(224 / sqrt(0.9))
    assert D.draft_size(lambda im: im, 224) == 258


# ---- determinism --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("small")
    class_tree(root, {"a": 12, "b": 12}, size=(48, 40), ext=".jpg")
    return root


def batches(folder, transforms, seed, epoch, workers):
    s = D.load_splits(cfg(folder, val_fraction=0.25))
    ds = D.ImageDataset(s.train, s.image_column, s.label_column, transforms[0], 32, seed, train=True)
    sampler = D.StepBatchSampler(len(ds), 8, 0, 1, seed)
    sampler.set_epoch(epoch)
    return [(b.images.clone(), b.labels.clone(), b.indices.clone())
            for b in D.make_loader(ds, batch_sampler=sampler, workers=workers)]


def same(a, b) -> bool:
    return len(a) == len(b) and all(all(torch.equal(x, y) for x, y in zip(p, q)) for p, q in zip(a, b))


def test_same_seed_same_batches_other_epoch_other_batches(small_folder, transforms):
    ref = batches(small_folder, transforms, 0, 0, 0)
    assert ref[0][0].dtype == torch.uint8 and ref[0][0].shape == (8, 3, 32, 32)
    assert same(ref, batches(small_folder, transforms, 0, 0, 0))
    other = batches(small_folder, transforms, 0, 1, 0)
    assert not torch.equal(ref[0][2], other[0][2])  # another order
    # The same sample in another epoch gets another augmentation.
    i = int(ref[0][2][0])
    pos = [(b, k) for b, (_, _, idx) in enumerate(other) for k, j in enumerate(idx.tolist()) if j == i][0]
    assert not torch.equal(ref[0][0][0], other[pos[0]][0][pos[1]])
    assert not same(ref, batches(small_folder, transforms, 1, 0, 0))  # another seed


def test_two_workers_give_identical_batches(small_folder, transforms):
    assert same(batches(small_folder, transforms, 5, 2, 0), batches(small_folder, transforms, 5, 2, 2))


def test_device_jitter_parameters_belong_to_the_sample(small_folder, transforms):
    """With the colour jitter on the device, each sample's parameters are drawn with it in the
    worker: the same for the same sample and epoch wherever it lands (batch, position, worker),
    others another epoch; the image itself is the same as without them; the batch carries them."""
    s = D.load_splits(cfg(small_folder, val_fraction=0.25))
    args = (s.train, s.image_column, s.label_column, transforms[0], 32, 0)
    ds, plain = D.ImageDataset(*args, train=True, device_jitter=0.4), D.ImageDataset(*args, train=True)
    a, b, c = ds[(3, 0, 8)], ds[(3, 0, 16)], ds[(3, 1, 8)]
    assert torch.equal(a.jitter, b.jitter) and not torch.equal(a.jitter, c.jitter)
    assert ((0.6 <= a.jitter[:3]) & (a.jitter[:3] <= 1.4)).all() and sorted(a.jitter[3:].tolist()) == [0, 1, 2]
    assert plain[(3, 0, 8)].jitter is None and torch.equal(plain[(3, 0, 8)].image, a.image)
    sampler = D.StepBatchSampler(len(ds), 8, 0, 1, 0)
    for workers in (0, 2):
        got = [(bt.indices, bt.jitter) for bt in D.make_loader(ds, batch_sampler=sampler, workers=workers)]
        assert all(j.shape == (len(i), 6) for i, j in got)
        assert all(torch.equal(j[k], ds[(int(i[k]), 0, 8)].jitter) for i, j in got for k in range(len(i)))


def test_every_process_runs_every_step_even_with_an_empty_share(small_folder, transforms):
    """19 samples at global batch 8 on 4 processes: 3 steps everywhere (as on 1 process); the short
    last batch of 3 goes to one process, the others get an empty batch that still says 3."""
    s = D.load_splits(cfg(small_folder, val_fraction=0.2, limit_train_samples=19))
    ds = D.ImageDataset(s.train, s.image_column, s.label_column, transforms[0], 32, 0, train=True)
    seen, per_rank = [], []
    for rank in range(4):
        sampler = D.StepBatchSampler(len(ds), 8, rank, 4, seed=0)
        got = list(D.make_loader(ds, batch_sampler=sampler))
        assert len(sampler) == len(got) == 3
        per_rank.append([(len(b.indices), b.step_samples) for b in got])
        seen += [i for b in got for i in b.indices.tolist()]
        assert all(b.images.dtype == torch.uint8 and b.images.shape[1:] == (3, 32, 32) for b in got)
    assert sorted(seen) == list(range(19))
    assert [r[2] for r in per_rank] == [(3, 3), (0, 3), (0, 3), (0, 3)]
    assert all(r[:2] == [(2, 8), (2, 8)] for r in per_rank)
    empty = D.collate([], image_size=32)
    assert empty.images.shape == (0, 3, 32, 32) and empty.images.dtype == torch.uint8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_batches_arrive_in_pinned_memory(small_folder, transforms):
    s = D.load_splits(cfg(small_folder, val_fraction=0.25))
    ds = D.ImageDataset(s.train, s.image_column, s.label_column, transforms[0], 32, 0, train=True)
    batch = next(iter(D.make_loader(ds, batch_sampler=D.StepBatchSampler(len(ds), 8, 0, 1, 0), pin=True)))
    assert batch.images.is_pinned() and batch.labels.is_pinned()


def test_build_loaders_gives_the_run_its_loaders(small_folder):
    from accelerate import Accelerator

    from vramfit.config import build_config

    c = build_config(None, ["data.num_workers=0", "model.channels_last=true"],
                     {"data.source": str(small_folder), "data.image_size": 32, "train.global_batch": 8})
    splits = D.load_splits(c.data)
    loaders = D.build_loaders(c, splits, DATA_CFG_32, Accelerator(cpu=True), eval_batch=5)
    assert loaders.workers == 0 and len(loaders.train) == len(loaders.sampler) == 3  # 21 train images: 8 + 8 + 5
    batch = next(iter(loaders.train))
    assert batch.step_samples == 8 and batch.images.shape == (8, 3, 32, 32)
    x = loaders.normalize(batch.images)
    assert x.dtype == torch.float32 and x.is_contiguous(memory_format=torch.channels_last)
    assert abs(float(x.mean())) < 3
    assert [len(b.indices) for b in loaders.val] == [3]  # the 3 held-out images, in one eval batch


def test_cpu_loader_workers_follow_what_loading_and_computing_cost():
    """On the CPU a worker takes a core from the model's kernels: it is worth it only when loading
    is dear next to computing, and the cost model says how many."""
    from vramfit.data.workers import pick_cpu_workers, predicted_seconds

    assert pick_cpu_workers(0.001, 0.020, cpus=2) == 0  # digits-like: loading is cheap
    assert pick_cpu_workers(0.020, 0.020, cpus=2) == 0  # overlapped, the model would run on 1 core
    assert pick_cpu_workers(0.050, 0.020, cpus=2) == 1  # loading dominates: overlap it
    assert pick_cpu_workers(0.050, 0.020, cpus=16) == 2  # a third would save under 5%
    assert pick_cpu_workers(1.0, 0.001, cpus=64) == 8  # never more than 8
    assert pick_cpu_workers(1.0, 0.001, cpus=1) == 0  # no core to spare
    assert predicted_seconds(0, 0.05, 0.02, 2) == pytest.approx(0.07)
    assert predicted_seconds(1, 0.05, 0.02, 2) == pytest.approx(0.05)


def test_num_workers_auto_is_measured_on_a_cpu_run(small_folder, monkeypatch):
    """`auto`: a fixed count is kept; an accelerator gets its CPUs less one; a CPU run measures
    loading (the run's own first samples) against the compute time it is given, and says so."""
    from accelerate import Accelerator

    from vramfit.config import build_config
    from vramfit.data import workers as W

    monkeypatch.setattr(W.os, "sched_getaffinity", lambda _pid: set(range(4)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert W.resolve_workers(DataConfig(num_workers=3), "cpu", 1) == (3, "data.num_workers")
    assert W.resolve_workers(DataConfig(), "cuda", 1)[0] == 3
    assert W.resolve_workers(DataConfig(), "cuda", 4)[0] == 0  # 4 processes share the 4 CPUs
    assert W.resolve_workers(DataConfig(), "cpu", 1)[0] == 0  # nothing measured
    assert W.measures_workers(DataConfig(), "cpu", 1) and not W.measures_workers(DataConfig(), "cuda", 1)
    assert not W.measures_workers(DataConfig(), "cpu", 4)  # 4 processes on 4 CPUs: none to spare
    assert not W.measures_workers(DataConfig(num_workers=2), "cpu", 1)
    c = build_config(None, [], {"data.source": str(small_folder), "data.image_size": 32, "train.global_batch": 8})
    data_cfg = DATA_CFG_32
    splits = D.load_splits(c.data)
    rng = torch.get_rng_state()
    cheap = D.build_loaders(c, splits, data_cfg, Accelerator(cpu=True), eval_batch=5, compute_seconds=10.0)
    assert torch.equal(torch.get_rng_state(), rng)  # loading the samples left the RNGs alone
    assert cheap.workers == 0 and cheap.workers_why.startswith("auto, measured: loading ")
    dear = D.build_loaders(c, splits, data_cfg, Accelerator(cpu=True), eval_batch=5, compute_seconds=1e-6)
    assert dear.workers == 3 and "computing 0.00 ms a sample on 4 CPUs" in dear.workers_why


# ---- end to end: bad files, prepare, scan-data ----------------------------------------------------


@pytest.fixture(scope="module")
def messy(tmp_path_factory):
    """Split folders; nested classes; mixed extensions; non-image files; 4 unreadable train files
    (one of each kind) and 1 unreadable val file; a 1x1 image and a 1:50 one."""
    root = tmp_path_factory.mktemp("messy") / "photos"
    class_tree(root / "train", {"cat": 8, "dog": 7}, size=(40, 30), ext=".jpg")
    class_tree(root / "train" / "cat", {"indoor": 3}, size=(30, 40), seed=3, ext=".png")
    save(root / "train" / "dog" / "tiny.png", picture(1, 1, 9))
    save(root / "train" / "dog" / "strip.JPG", picture(2, 100, 9), "JPEG")
    bad = [bad_file(root / "train" / ("cat" if i % 2 else "dog"), k) for i, k in enumerate(BAD_KINDS)]
    class_tree(root / "val", {"cat": 4, "dog": 3}, size=(40, 30), seed=7, ext=".webp")
    bad.append(bad_file(root / "val" / "cat", "zero-byte"))
    write_bytes(root / "train" / "cat" / "labels.txt", b"x")
    write_bytes(root / "val" / ".DS_Store", b"x")
    return root, bad  # train: 15 + 3 + 2 + 4 = 24 = 3 batches of 8; val: 8


def test_bad_files_are_skipped_and_counted_exactly(messy, train_cli):
    root, bad = messy
    src = D.load_source(cfg(root))
    assert (len(src.train), len(src.val)) == (24, 8)
    run_dir, code = train_cli(*train_args(root, None, "--set", "data.max_bad_fraction=0.2",
                                          "--set", "train.log_every_steps=1"))
    assert code == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["skipped_samples"] == 4 and summary["global_step"] == 3
    assert sorted(f.split(":")[0] for f in summary["unreadable_files"]) == sorted(str(p) for p in bad[:4])
    (ev,) = [m for m in metrics(run_dir) if m["kind"] == "eval"]
    assert ev["val/unreadable"] == 1 and ev["val/samples"] == 7
    # Both splits counted apart: validation's unreadable file is in summary.json too.
    assert summary["val_skipped_samples"] == 1
    assert [f.split(":")[0] for f in summary["val_unreadable_files"]] == [str(bad[4])]


def test_too_many_bad_files_stop_the_run_with_their_names(messy, train_cli):
    root, bad = messy
    with pytest.raises(VramfitError) as e:  # default data.max_bad_fraction: 1%
        train_cli(*train_args(root, None))
    listed = [line.strip() for line in e.value.message.splitlines()[1:]]
    assert listed and all(any(line.startswith(str(p)) for p in bad[:4]) for line in listed)
    assert "max_bad_fraction" in e.value.message and "scan-data" in e.value.hint


def test_scan_data_lists_unreadable_files_and_exits_non_zero(messy, tmp_path, capsys):
    from vramfit.cli import run

    root, bad = messy
    assert run(["scan-data", "--data", str(root)]) == 1
    out = capsys.readouterr().out
    for p in bad:
        assert str(p.relative_to(root)) in out
    assert "UNREADABLE: zero-byte file" in out and "UNREADABLE: truncated" in out
    assert "tiny" in out and "extreme aspect" in out and "alpha" not in out
    assert "32 images (train 24 / val 8)" in out
    assert "5 unreadable" in out
    clean = class_tree(tmp_path / "clean", {"a": 3, "b": 3})
    save(clean / "a" / "alpha.png", picture(40, 40, 1, "RGBA"))
    assert run(["scan-data", "--data", str(clean)]) == 0
    out = capsys.readouterr().out
    assert "0 unreadable, 7 unusual" in out and "alpha" in out


def test_prepare_keeps_labels_and_splits_and_the_output_trains(messy, tmp_path, train_cli, capsys,
                                                             monkeypatch):
    from vramfit.commands.prepare import prepare

    root, bad = messy
    dst = tmp_path / "prepared"
    monkeypatch.chdir(root)  # `--data .`, where the stored relative file names also resolve
    report = prepare(cfg("."), str(dst), max_side=24, quality=90, workers=2)
    assert report["written"] == {"train": 20, "validation": 7}
    assert sorted(d["file"] for d in report["dropped"]) == sorted(str(p) for p in bad)
    assert "dropped 5 unreadable" in capsys.readouterr().out
    src = D.load_source(cfg(dst))
    orig = D.load_source(cfg(root))
    assert src.class_names == orig.class_names == ["cat", "dog"] and src.val_name == "validation"
    # Same label per file, every image shrunk to <= 24 px on its longer side, as JPEG.
    import datasets

    by_file = {str(Path(r["path"]).relative_to(root)): lab
               for r, lab in zip(orig.train["image"], orig.train["label"])}
    written = datasets.load_from_disk(str(dst))["train"].cast_column("image", datasets.Image(decode=False))
    assert len(written) == 20
    for row in written:
        assert by_file[row["file"]] == row["label"]
        img = Image.open(io.BytesIO(row["image"]["bytes"]))
        assert img.format == "JPEG" and max(img.size) <= 24
    with pytest.raises(VramfitError, match="not empty"):
        prepare(cfg(root), str(dst), max_side=24)
    run_dir, code = train_cli(*train_args(dst, None))
    assert code == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["skipped_samples"] == 0 and summary["global_step"] == 3  # 20 images: 2 + short one


# ---- every source kind trains; guards before and at step 1 ---------------------------------------


@pytest.mark.parametrize("kind", ["save_to_disk", "parquet_folder", "arrow_file", "hub"])
def test_each_source_kind_trains_a_few_steps(kind, tmp_path, train_cli, monkeypatch):
    import datasets

    train, val = hub_style(16), hub_style(6)
    extra: list[str] = []
    if kind == "save_to_disk":
        data = tmp_path / "saved"
        datasets.DatasetDict({"train": train, "validation": val}).save_to_disk(str(data))
    elif kind == "parquet_folder":
        data = tmp_path / "pq"
        data.mkdir()
        train.to_parquet(str(data / "train-00000-of-00001.parquet"))
        val.to_parquet(str(data / "validation-00000-of-00001.parquet"))
    elif kind == "arrow_file":  # no validation split: a quarter of train is held out
        train.save_to_disk(str(tmp_path / "one"))
        (data,) = (tmp_path / "one").glob("*.arrow")
        extra = ["--set", "data.val_fraction=0.25"]
    else:
        calls = []

        def fake_load_dataset(path, name=None, **kwargs):
            calls.append((path, name, kwargs))
            return datasets.DatasetDict({"train": train, "validation": val})

        monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
        data, extra = "someone/tiny-cifar", ["--set", "data.config=plain"]
    run_dir, code = train_cli(*train_args(data, None, "--set", f"data.cache_dir={tmp_path / 'cache'}", *extra))
    assert code == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["global_step"] == 2 and summary["final_accuracy"] is not None
    assert json.loads((run_dir / "model" / "class_names.json").read_text()) == ["apple", "bee", "cat"]
    if kind == "hub":  # the id and config reach datasets; no loading script is trusted unasked
        assert [(p, n) for p, n, _ in calls] == [("someone/tiny-cifar", "plain")]
        assert "trust_remote_code" not in calls[0][2]


def test_batches_of_the_wrong_shape_stop_at_step_1(tmp_path, train_cli, monkeypatch):
    """The 'resize written but never applied' bug: the guard names the transform, before any step."""
    root = class_tree(tmp_path / "photos", {"a": 8, "b": 8}, size=(20, 20))
    from vramfit.data import loader

    real = loader.build_transforms

    def no_resize(cfg, data_cfg, device_type):
        _, val_tf = real(cfg, data_cfg, device_type)
        return (lambda im: torch.from_numpy(np.array(im)).permute(2, 0, 1)), val_tf

    monkeypatch.setattr(loader, "build_transforms", no_resize)
    with pytest.raises(VramfitError, match=r"shape \(8, 3, 20, 20\), expected \(N, 3, 32, 32\)") as e:
        train_cli(*train_args(root, None))
    assert "transform is not being applied" in e.value.message


def test_resumed_head_must_match_the_dataset_classes(tmp_path, train_cli):
    root = class_tree(tmp_path / "photos", {"cat": 12, "dog": 12}, size=(20, 20))
    run_dir, code = train_cli(*train_args(root, None, "--set", "debug.signal_at_step=1"))
    assert code == 143 and (run_dir / "checkpoints").is_dir()
    (root / "dog").rename(root / "fox")
    with pytest.raises(VramfitError, match="differ from the checkpoint") as e:  # even when allowed
        train_cli(*train_args(root, None, "--set", "allow_resume_change=true"))
    assert "fox" in e.value.message and "dog" in e.value.message


def test_bad_file_counts_survive_a_resume(messy, train_cli):
    root, bad = messy
    args = train_args(root, None, "--set", "data.max_bad_fraction=0.2")
    run_dir, code = train_cli(*args, "--set", "debug.signal_at_step=2")
    assert code == 143
    seen = json.loads((run_dir / "summary.json").read_text())["skipped_samples"]
    assert 0 < seen < 4  # some met before the interruption, the rest after
    run_dir, code = train_cli(*args)
    assert code == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["skipped_samples"] == 4 and len(summary["unreadable_files"]) == 4
    (ev,) = [m for m in metrics(run_dir) if m["kind"] == "eval"]
    assert ev["epoch/skipped_samples"] == 4


def test_train_and_val_split_names_are_chosen_and_checked(tmp_path):
    import datasets

    datasets.DatasetDict({"train": hub_style(6), "full": hub_style(12), "holdout": hub_style(3),
                          "test": hub_style(4)}).save_to_disk(str(tmp_path / "dd"))
    src = D.load_source(cfg(tmp_path / "dd", train_split="full", val_split="holdout"))
    assert (len(src.train), len(src.val)) == (12, 3)
    assert any("unused split(s): train " in n for n in src.notes)
    assert any(n.startswith("test split left for `vramfit eval --split test`") for n in src.notes)
    default = D.load_source(cfg(tmp_path / "dd"))  # train; no validation-like name: held out later
    assert len(default.train) == 6 and default.val is None
    assert any("test split left for" in n for n in default.notes)
    assert len(D.load_source(cfg(tmp_path / "dd", val_split="test")).val) == 4  # on request
    for key in ("train_split", "val_split"):
        with pytest.raises(VramfitError, match=f"data.{key} `nope` is not a split") as e:
            D.load_source(cfg(tmp_path / "dd", **{key: "nope"}))
        assert "full" in e.value.message + (e.value.hint or "")
