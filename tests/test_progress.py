"""Progress lines inside an epoch: at log points, at least every 30 s on long steps, in the log."""
import logging
import os
import re
import time

import pytest
import torch

from conftest import ROOT
from test_training import TINY_VIT, run_dir, tb_scalars, train
from train import Trainer
from settings.parse import build_config
from observe.memory import NullProbe
from observe.logging_utils import duration
from observe.run_log import DataWait, Progress
from engine.runtime import setup_runtime


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_lines_at_log_points_and_every_30_s_with_rate_and_eta(caplog):
    clock = Clock()
    p = Progress(steps_per_epoch=100, global_batch=8, enabled=True, clock=clock)
    p.start_epoch(1, 20, last=100)  # resumed at step 20 of epoch 2
    with caplog.at_level(logging.INFO, logger="train"):
        clock.t += 10
        p.step(21)  # 10 s: no line yet
        clock.t += 10
        p.step(22, loss=0.5, lr=1e-3)  # a log point: a line
        clock.t += 25
        p.step(23)  # 25 s after the last line: none
        clock.t += 6
        p.step(24, lr=9e-4)  # 31 s: a line, with the log point's loss and the current rate
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    # 2 steps x 8 samples in 20 s; 78 steps left at 10 s each
    assert lines[0] == ("Epoch 2 step 22/100 (22%): 0.8 samples/s, train loss 0.5, lr 0.001, "
                        "epoch ETA 13m00s")
    assert lines[1].startswith("Epoch 2 step 24/100 (24%): 0.6 samples/s, "
                               "train loss 0.5 (at step 22), lr 0.0009,")
    assert lines[1].endswith("epoch ETA 17m19s")  # 41 s for the 3 steps after the first, 76 left


def test_a_loss_from_the_epoch_before_says_so(caplog):
    clock = Clock()
    p = Progress(steps_per_epoch=10, global_batch=8, enabled=True, clock=clock)
    with caplog.at_level(logging.INFO, logger="train"):
        p.start_epoch(0, 0, last=10)
        p.step(10, loss=0.5, lr=1e-3)
        p.start_epoch(1, 0, last=10)
        clock.t += 31
        p.step(1, lr=8e-4)
    first, line = [r.getMessage() for r in caplog.records]
    assert first.startswith("Epoch 1 step 10/10") and "train loss 0.5, lr 0.001, " in first
    assert line.startswith("Epoch 2 step 1/10")
    assert "train loss 0.5 (at epoch 1 step 10), lr 0.0008, " in line


def test_the_eta_leaves_out_the_epochs_first_step(caplog):
    """A first step of 60 s (a compile) and then 1 s a step: the ETA is the steps' pace."""
    clock = Clock()
    p = Progress(steps_per_epoch=100, global_batch=8, enabled=True, clock=clock)
    p.start_epoch(0, 0, last=100)
    with caplog.at_level(logging.INFO, logger="train"):
        clock.t += 60
        p.step(1)
        for step in range(2, 11):
            clock.t += 1
            p.step(step, loss=0.5, lr=1e-3) if step == 10 else p.step(step)
    first, line = [r.getMessage() for r in caplog.records]  # (the first: 30 s had passed)
    assert first.endswith("epoch ETA 1h39m")  # 60 s a step is all it knows then
    assert line.startswith("Epoch 1 step 10/100 (10%): 1.2 samples/s,")  # 80 samples in 69 s
    assert line.endswith("epoch ETA 1m30s")  # 90 steps left at 1 s


def test_only_the_main_rank_prints_and_durations_read_well(caplog):
    p = Progress(10, 4, enabled=False, clock=Clock())
    p.start_epoch(0, 0, last=10)
    with caplog.at_level(logging.INFO, logger="train"):
        p.step(1, loss=1.0, lr=0.1)
    assert not caplog.records
    assert [duration(s) for s in (0.4, 59, 61, 3599, 7500)] == ["0s", "59s", "1m01s", "59m59s",
                                                               "2h05m"]


def test_a_run_shows_its_progress_in_the_log_and_tensorboard(tmp_path, era5_root):
    exp = str(tmp_path / "logs")
    r = train(TINY_VIT + ["--data_root", era5_root, "--expdir", exp, "--num_epochs", "2"])
    lines = [line for line in r.stdout.splitlines() if " step " in line and "ETA" in line]
    steps = [line.split(" step ")[1].split(" ")[0] for line in lines]
    # log points every 2 steps of the run (iterations 2, 4, 6, 8, 10) and the end of epoch 1
    assert steps == ["2/5", "4/5", "5/5", "1/5", "3/5", "5/5"], lines
    assert all("samples/s, train loss " in line for line in lines)
    log = open(os.path.join(run_dir(exp), "out.log")).read()
    assert lines[0].split(" - ")[-1] in log
    # how many threads and loader workers each rank has, and how to change them
    assert re.search(r"Per rank: \d+ intra-op threads \(OMP_NUM_THREADS\), 0 loader workers "
                     r"\(num_data_workers\)", log)
    acc = tb_scalars(os.path.join(run_dir(exp), "tensorboard"))
    assert [e.step for e in acc.Scalars("Performance/samples per sec (epoch so far)")] == \
        [2, 4, 5, 6, 8, 10]


# ------------------------------------------------------------------ the epoch's figures

def test_no_placeholder_loss_before_the_first_log_point(caplog):
    clock = Clock()
    p = Progress(steps_per_epoch=100, global_batch=8, enabled=True, every_s=30, clock=clock)
    p.start_epoch(0, 0, last=100)
    with caplog.at_level(logging.INFO, logger="train"):
        clock.t += 31
        p.step(1)  # a timed line before any log point
        clock.t += 1
        p.step(10, loss=0.25, lr=1e-3)
        clock.t += 31
        p.step(11)  # the log point's loss is carried
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "Epoch 1 step 1/100 (1%): 0.3 samples/s, epoch ETA 51m09s"
    assert "train loss 0.25, lr 0.001" in lines[1]
    assert "train loss 0.25 (at step 10), lr 0.001" in lines[2]
    assert not any("nan" in line for line in lines)


class SlowStart(Trainer):
    """The first step of each epoch takes 1.5 s more (as a first step after validation does)."""

    def train_step(self, x, y, probe=NullProbe()):
        if self.state.step_in_epoch == 0:
            time.sleep(1.5)
        return super().train_step(x, y, probe)


class SlowLoader:
    """Every batch of ``loader`` comes 0.15 s late (the batches themselves are cached);
    ``slept``: the delays as they were (a busy machine oversleeps)."""

    def __init__(self, loader, delay_s=0.15):
        self.batches, self.delay_s, self.slept = list(loader), delay_s, 0.0

    def __iter__(self):
        for b in self.batches:
            t0 = time.monotonic()
            time.sleep(self.delay_s)
            self.slept += time.monotonic() - t0
            yield b


def _trainer(cls, tmp_path, era5_root, **kw):
    ov = {k.lstrip("-"): v for k, v in zip(TINY_VIT[::2], TINY_VIT[1::2])}
    ov.update(data_root=era5_root, expdir=str(tmp_path), num_epochs="1", log_every="100")
    ov.update(kw)
    cfg = build_config(f"{ROOT}/config/ViT.yaml", "quickstart", ov)
    return cls(cfg, setup_runtime(cfg))


def test_the_epoch_figure_is_its_samples_over_its_wall_time_first_step_included(
        tmp_path, era5_root):
    tr = _trainer(SlowStart, tmp_path, era5_root)
    t0 = time.monotonic()
    stats = tr.train_epoch()
    wall = time.monotonic() - t0
    samples = stats.steps * tr.rt.global_batch
    assert stats.elapsed_s > 1.5 and stats.samples_per_s == pytest.approx(samples / wall, rel=0.01)
    assert stats.steady_samples_per_s > 1.5 * stats.samples_per_s  # the slow first step left out
    tr.run_log.epoch(stats, tr.validate(), 0.1, tr.state.epoch, tr.iteration)
    tr.loaders.close()
    text = open(os.path.join(tr.run_dir, "out.log")).read()
    assert f"{stats.samples_per_s:.2f} samples/s" in text
    assert f"steady state (after step 1) {stats.steady_samples_per_s:.2f} samples/s" in text
    flops = tr.task.flops_per_sample(tr.state.epoch)
    sps = f"{flops * stats.samples_per_s / 1e12:.3g} TFLOP/s"
    assert sps in text  # TFLOP/s from the same figure


def test_a_slow_loader_shows_its_share_of_the_epoch(tmp_path, era5_root):
    tr = _trainer(Trainer, tmp_path, era5_root)
    tr.loaders.train = SlowLoader(tr.loaders.train)
    stats = tr.train_epoch()
    true_share = tr.loaders.train.slept / stats.elapsed_s
    assert true_share > 0.2 and stats.data_wait == pytest.approx(true_share, abs=0.05)
    tr.run_log.epoch(stats, tr.validate(), 0.1, tr.state.epoch, tr.iteration)
    tr.loaders.close()
    assert f"Waited for data {100 * stats.data_wait:.0f}% of the epoch (fetching batches)" \
        in open(os.path.join(tr.run_dir, "out.log")).read()


def test_a_timed_line_shows_the_learning_rate_of_the_step_to_come(tmp_path, era5_root):
    """Between log points a line comes every 30 s (here: after every step); its rate is the
    optimizer's for the next step, computed on the host, the loss that of the last log point."""
    tr = _trainer(Trainer, tmp_path, era5_root, log_every="3", warmup_steps="2")
    tr.run_log.progress.every_s = 0
    rates = []
    step = tr.run_log.progress.step
    tr.run_log.progress.step = lambda *a, **kw: (rates.append(tr.optimizer.param_groups[0]["lr"]),
                                         step(*a, **kw))
    tr.train_epoch()
    tr.loaders.close()
    log = open(os.path.join(tr.run_dir, "out.log")).read()
    lines = [line for line in log.splitlines() if " step " in line and "ETA" in line]
    assert len(lines) == len(rates) == tr.steps_per_epoch >= 5  # one line a step, no repeat
    for i, (line, rate) in enumerate(zip(lines, rates), start=1):
        assert f"lr {rate:.3g}, " in line, (line, rate)
        if 3 < i < len(lines) and i % 3:  # between log points (the last: the epoch's window)
            assert f" (at step {i - i % 3}), " in line, line
    assert len(set(rates)) >= len(rates) - 1  # warm-up, then the cosine


class Event:
    """A CUDA event on a fake device clock: ``record()`` takes the clock's time."""

    def __init__(self, clock):
        self.clock, self.t = clock, None

    def record(self):
        self.t = self.clock.t

    def elapsed_time(self, end):
        return 1e3 * (end.t - self.t)  # ms, as torch.cuda.Event gives it


def test_device_idle_share_from_events_around_each_steps_work():
    clock = Clock()
    idle = DataWait(torch.device("cuda"), event=lambda: Event(clock))
    for epoch in range(2):  # the events are made once and reused
        idle.start_epoch()
        for step in range(4):
            clock.t += 0.5  # the device waits for the batch
            idle.step_begins()
            clock.t += 1.5  # the step's kernels
            idle.step_ends()
        assert idle.share(8.0) == pytest.approx(0.25)
    assert len(idle.pairs) == 4
    assert DataWait(torch.device("cpu")).label == "fetching batches"
