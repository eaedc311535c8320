"""What the input pipeline holds in memory: host RAM of a run's loader with 0, 2 and 4 workers, and
on a GPU the device memory a pinned loader takes (docs/faq.md, "pin_memory / num_workers eat GPU
memory"). Each configuration runs in a fresh process: the run's own loader (ImageDataset,
StepBatchSampler, make_loader: persistent workers, prefetch 4, uint8 batches) over generated
500x375 JPEGs at 224 px; after a few batches, with every worker's prefetched batches in flight, the
proportional set size (PSS: shared pages split between the processes that share them) of the
process and its workers, plus the machine's shared memory (/proc/meminfo: batches waiting in the
queue are mapped by no process), is read against the same figures before the loader existed.

    python bench/loader_memory.py                      # ~1 minute on 2 CPU cores
    python bench/loader_memory.py --batch 256 --workers 0 4 8
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MiB = 2**20
PREFETCH = 4  # make_loader's prefetch_factor


def pss_bytes(pid: int | str = "self") -> int:
    """Proportional set size of one process (Linux) less its shared memory (Pss_Shmem, counted once
    for the machine by shmem_bytes); its resident size where smaps_rollup is missing."""
    try:
        fields = {line.split(":")[0]: int(line.split()[1]) * 1024
                  for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]}
        return fields["Pss"] - fields.get("Pss_Shmem", 0)
    except (OSError, KeyError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def shmem_bytes() -> int:
    """Shared memory of the whole machine (/proc/meminfo): batches a worker has sent but nobody has
    mapped yet (waiting in the queue as file descriptors) are counted here and in no process."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1]) * 1024
    return 0


def measure_one(folder: str, workers: int, batch: int, size: int, batches: int) -> dict:
    """One configuration, in this (fresh) process: host PSS added by the loader, and the device
    memory it took where there is a GPU (pinned batches live in host memory)."""
    import multiprocessing

    import torch

    from vramfit import data as D
    from vramfit.config import DataConfig

    from data_throughput import data_cfg_at  # bench/ is on the path: this file runs as a script

    cuda = torch.cuda.is_available()
    device_type = "cuda" if cuda else "cpu"
    cfg = DataConfig(source=folder, image_size=size, num_workers=workers)
    src = D.load_source(cfg)
    train_tf, _ = D.build_transforms(cfg, data_cfg_at(size), device_type)
    ds = D.ImageDataset(src.train, src.image_column, src.label_column, train_tf, size, 0, True,
                        device_jitter=D.device_jitter(cfg, device_type))
    sampler = D.StepBatchSampler(len(ds), batch, 0, 1, seed=0)
    if cuda:
        torch.cuda.init()
        free_before = torch.cuda.mem_get_info()[0]
    base, base_shm = pss_bytes(), shmem_bytes()
    loader = D.make_loader(ds, batch_sampler=sampler, workers=workers, pin=cuda)
    it = iter(loader)
    first = next(it)
    for _ in range(batches - 1):
        next(it)
    children = multiprocessing.active_children()
    total, deadline = 0, time.time() + 90
    while time.time() < deadline:  # until every worker's prefetch slots are full: no more growth
        time.sleep(2.0)
        now = pss_bytes() + sum(pss_bytes(p.pid) for p in children) + shmem_bytes() - base_shm
        if now - total < MiB:
            break
        total = now
    out = {"workers": workers, "pinned": bool(cuda and first.images.is_pinned()), "batch_bytes": first.images.nbytes,
           "host_added_bytes": total - base, "shmem_added_bytes": shmem_bytes() - base_shm,
           "worker_processes": len(children)}
    if cuda:
        out["device_free_drop_bytes"] = free_before - torch.cuda.mem_get_info()[0]
        out["device_allocated_bytes"] = torch.cuda.memory_allocated()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 2, 4])
    ap.add_argument("--batch", type=int, default=128, help="per-process batch (the rtx3060 recipe: 128 on 1 GPU)")
    ap.add_argument("--images", type=int, help="default: enough for every worker's prefetch slots")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--batches", type=int, default=3, help="batches taken before measuring")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child: measure this worker count
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one is not None:
        print(json.dumps(measure_one(args.folder, args.one, args.batch, args.image_size, args.batches)))
        return 0

    sys.path.insert(0, str(Path(__file__).parent))
    from data_throughput import make_folder

    t0 = time.time()
    args.images = args.images or (max(args.workers) * PREFETCH + args.batches + 1) * args.batch
    work = Path(tempfile.mkdtemp(prefix="vramfit-loader-mem-"))
    try:
        mb = make_folder(work / "imgs", args.images, (500, 375), 10, 12, max(1, len(os.sched_getaffinity(0))))
        rows = []
        for w in args.workers:
            cmd = [sys.executable, __file__, "--one", str(w), "--folder", str(work / "imgs"), "--batch",
                   str(args.batch), "--image-size", str(args.image_size), "--batches", str(args.batches)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 1
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(rows, args, mb)
    print(f"({time.time() - t0:.0f} s)")
    return 0


def report(rows: list[dict], args, mb: float) -> None:
    batch = rows[0]["batch_bytes"]
    print(f"{args.images} JPEGs of 500x375 ({mb * 1e3:.0f} KB), batches of {args.batch} at {args.image_size} px "
          f"(uint8: {batch / MiB:.1f} MiB a batch), prefetch {PREFETCH} per worker")
    gpu = "device_free_drop_bytes" in rows[0]
    head = ("| workers | host memory added | of it, shared memory (batches sent) | batches in flight "
            "(w x prefetch x batch) |")
    print(head + (" pinned | device memory taken |" if gpu else ""))
    print("|---|---|---|---|" + ("---|---|" if gpu else ""))
    for r in rows:
        flight = r["workers"] * PREFETCH * r["batch_bytes"]
        line = (f"| {r['workers']} | {r['host_added_bytes'] / MiB:.0f} MiB | {r['shmem_added_bytes'] / MiB:.0f} MiB "
                f"| {flight / MiB:.0f} MiB |")
        if gpu:
            line += f" {r['pinned']} | {r['device_free_drop_bytes'] / MiB:.0f} MiB ({r['device_allocated_bytes']} B allocated) |"
        print(line)
    if not gpu:
        print("(no GPU here: pinned memory and device memory are measured when the command runs on one)")


if __name__ == "__main__":
    sys.exit(main())
