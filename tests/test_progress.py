"""Progress lines inside an epoch: at log points, at least every 30 s on long steps, in the log."""
import logging
import os

from test_training import TINY_VIT, run_dir, tb_scalars, train
from utils.progress import Progress, duration


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
        p.step(24)  # 31 s: a line, with the log point's loss
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    # 2 steps x 8 samples in 20 s; 78 steps left at 10 s each
    assert lines[0] == ("Epoch 2 step 22/100 (22%): 0.8 samples/s, train loss 0.5, lr 0.001, "
                        "epoch ETA 13m00s")
    assert lines[1].startswith("Epoch 2 step 24/100 (24%): 0.6 samples/s, train loss 0.5,")
    assert lines[1].endswith("epoch ETA 16m09s")  # 51 s for 4 steps, 76 left


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
    acc = tb_scalars(os.path.join(run_dir(exp), "tensorboard"))
    assert [e.step for e in acc.Scalars("Performance/samples per sec (epoch so far)")] == \
        [2, 4, 5, 6, 8, 10]
