"""A run is never quiet for long: each setup stage says itself, and a job log gets a line at least
every few seconds within an epoch, by the clock rather than by the step count."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_args

from vramfit.train import progress


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _piped(clock, log_every: int = 1000) -> progress.Progress:
    return progress.Progress(True, 2, 50, log_every, torch.device("cpu"), None, first_step=0, terminal=False,
                             clock=clock)


def test_a_job_log_gets_a_line_every_few_seconds_of_slow_steps(caplog):
    clock = Clock()
    p = _piped(clock)
    with caplog.at_level(logging.INFO, logger="vramfit"):
        p.step(1, 0, 1, 1.0, 16, 1.0, 16)  # the first step always says itself
        for step in range(2, 8):  # 2 s a step: a line every PIPED_SECONDS, not every step
            clock.now += 2.0
            p.step(step, 0, step, 1.0, 16, 2.0, 16)
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(" |")[0] for line in lines] == ["epoch 1/2 step 1/50", "epoch 1/2 step 4/50",
                                                       "epoch 1/2 step 7/50"], lines
    assert not any("\r" in line for line in lines)


def test_a_long_step_keeps_the_job_log_moving(caplog):
    clock = Clock()
    p = _piped(clock)
    with caplog.at_level(logging.INFO, logger="vramfit"):
        p.step(1, 0, 1, 1.0, 16, 1.0, 16)
        for _ in range(10):  # the heartbeat's ticks through one 10 s step
            clock.now += 1.0
            p.beat()
    said = [r.getMessage() for r in caplog.records][1:]
    assert said == ["epoch 1/2 step 2/50 running (5 s so far)", "epoch 1/2 step 2/50 running (10 s so far)"]


def test_a_stage_says_itself_and_keeps_saying_while_it_lasts(caplog):
    import time

    with caplog.at_level(logging.INFO, logger="vramfit"):
        with progress.stage("reading the data (digits)", tick=0.01):
            pass
        clock = Clock()
        with progress.stage("tracing", clock=clock, tick=0.01):
            clock.now += progress.HEARTBEAT_SECONDS + 1
            deadline = time.monotonic() + 5
            while "still" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.01)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:3] == ["reading the data (digits) ...", "tracing ...", "  ... still tracing (6 s)"]
    assert lines[-1] == "  tracing: 6 s"


def test_every_setup_stage_says_itself(train_cli, caplog):
    with caplog.at_level(logging.INFO):
        _, code = train_cli(*tiny_args(), run_name="said")
    assert code == 0
    text = caplog.text
    for stage in ("reading the data (", "building test_resnet (", "planning memory (", "epoch 1/1: validating ("):
        assert stage in text, stage


@pytest.mark.slow  # wall-clock: a run piped to a file, its longest silence measured
def test_a_piped_run_is_never_quiet_for_10_seconds(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from log_gaps import watch

    gaps = watch([sys.executable, "-m", "vramfit.cli", "train", *tiny_args("--epochs", "2"), "--output",
                  str(tmp_path), "--run-name", "gaps"], str(tmp_path / "stamped.log"))
    gap, _ = gaps.longest()
    assert gaps.returncode == 0 and gap <= 10.0, (tmp_path / "stamped.log").read_text()
