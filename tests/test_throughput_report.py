"""The IO / SYNTHETIC / FULL throughput report (--throughput_report, alias --enable_benchy).

End to end through train.py (tiny ViT and U-Net): the summary lines, throughput.json and the
TensorBoard scalars, and the final checkpoint equal to that of the same run without the report.
In process: the trials take real optimizer steps (the FULL trial trains) and the trainer's state
is put back afterwards. On 2 gloo ranks: per-rank and aggregate numbers.
"""
import json
import math
import os
import re
import time

import pytest
import torch

from conftest import ROOT, write_cosmo_pair, write_era5
from distributed_harness import run_ranks
from test_training import TINY_UNET, TINY_VIT, run_dir, tb_scalars, train
from engine import throughput_report as tp
from observe.logging_utils import over_ranks
from settings.parse import build_config
from engine.runtime import setup_runtime
from train import Trainer

SUMMARY = re.compile(r"Throughput \((all \d+ ranks, )?samples/s, mean \+/- std of 3 rounds of "
                     r"(\d+) batches\): IO ([0-9.]+) \+/- ([0-9.]+), SYNTHETIC ([0-9.]+) \+/- "
                     r"([0-9.]+), FULL ([0-9.]+) \+/- ([0-9.]+)")


def tiny_vit_cfg(data, expdir, **kw):
    ov = dict(img_size="[16,32]", patch_size="4", embed_dim="32", depth="1", num_heads="2",
              global_batch_size="4", base_batch_size="4", synthesize_if_missing="false",
              num_data_workers="0", data_root=data, expdir=expdir, log_every="2")
    ov.update({k: str(v) for k, v in kw.items()})
    return build_config(os.path.join(ROOT, "config", "ViT.yaml"), "quickstart", ov)


def check_report(d, world_size=1):
    report = json.load(open(os.path.join(d, "throughput.json")))
    assert report["modes"] == ["IO", "SYNTHETIC", "FULL"] and report["rounds"] == 3
    assert report["world_size"] == world_size and len(report["per_rank"]) == world_size
    for m in tp.MODES:
        mean = report["aggregate"][m]["mean"]
        assert math.isfinite(mean) and mean > 0, (m, report["aggregate"])
        for entry in report["per_rank"]:
            assert len(entry[m]["rounds"]) == 3 and min(entry[m]["rounds"]) > 0
    log = open(os.path.join(d, "out.log")).read()
    found = SUMMARY.search(log)
    assert found, log[-2000:]
    assert int(found.group(2)) == report["timed_batches"]
    for i, m in enumerate(tp.MODES):  # the printed line is the aggregate of the file
        assert float(found.group(3 + 2 * i)) == pytest.approx(report["aggregate"][m]["mean"],
                                                              abs=0.051)
    assert "Bottleneck: " in log and report["bottleneck"] in log
    scalars = tb_scalars(os.path.join(d, "tensorboard"))
    for m in tp.MODES:
        (event,) = scalars.Scalars(f"Throughput/{m}")
        assert event.value == pytest.approx(report["aggregate"][m]["mean"], rel=1e-5)
    return report


# ----------------------------------------------------------------------------- rules


def test_trial_sizes_fit_in_one_pass_of_the_loader_short_of_its_lookahead():
    assert tp.trial_sizes(100) == (2, 20)
    assert tp.trial_sizes(19) == (2, 16)
    assert tp.trial_sizes(19, lag=2) == (2, 15)
    assert tp.trial_sizes(3) == (1, 1)
    assert tp.trial_sizes(2) == (0, 1)
    assert tp.trial_sizes(1) == (0, 1)


class SlowBatches:
    """The batches of ``loader``, each fetched ``delay_s`` late."""

    def __init__(self, loader, delay_s):
        self.batches, self.delay_s = list(loader), delay_s

    def __iter__(self):
        for b in self.batches:
            time.sleep(self.delay_s)
            yield b


@pytest.mark.parametrize("steps", [2, 4])
def test_io_counts_only_batches_fetched_inside_its_window(tmp_path, era5, steps):
    """Batches are fetched a step ahead: in a short epoch a window reaching the pass's end
    would hold fewer fetches than batches (an epoch of 4 steps: IO at 2x the loader's rate,
    of 2 steps: no fetch timed at all)."""
    cfg = tiny_vit_cfg(era5, str(tmp_path), num_iters=1, limit_nsamples=4 * steps)
    tr = Trainer(cfg, setup_runtime(cfg))
    try:
        assert tr.steps_per_epoch == steps
        tr.loaders.train = SlowBatches(tr.loaders.train, delay_s=0.1)
        loader_rate = tr.rt.local_batch / 0.1
        io = tp.measure(tr)["IO"]
    finally:
        tr.loaders.close()
    # each timed fetch sleeps 0.1 s, so a window that times its fetches cannot beat the loader's
    # rate on any machine (a slower machine only lowers the figure)
    assert all(0 < r < 1.2 * loader_rate for r in io), (io, loader_rate)


def test_aggregate_sums_ranks_and_counts_a_model_replica_once():
    per_rank = [{"IO": [1.0, 2.0, 3.0], "SYNTHETIC": [4.0, 4.0, 4.0], "FULL": [1.0, 1.0, 1.0]},
                {"IO": [3.0, 2.0, 1.0], "SYNTHETIC": [2.0, 4.0, 6.0], "FULL": [1.0, 1.0, 1.0]}]
    dp = tp.summarise(per_rank, replica_ranks=1)
    assert dp["IO"] == {"mean": 4.0, "std": 0.0}  # every round sums to 4
    assert dp["SYNTHETIC"]["mean"] == 8.0 and dp["SYNTHETIC"]["std"] == pytest.approx(
        math.sqrt(8 / 3))
    tp2 = tp.summarise(per_rank, replica_ranks=2)  # one replica over both ranks
    assert tp2["FULL"] == {"mean": 1.0, "std": 0.0}


def test_per_rank_figures_list_every_rank_up_to_8_and_the_spread_beyond():
    assert over_ranks([1.0, 2.5, 0.25], ".2f") == "1.00, 2.50, 0.25"
    assert over_ranks([float(r) for r in range(8)], ".0f") == "0, 1, 2, 3, 4, 5, 6, 7"
    values = [5.0] * 12
    values[7], values[3], values[10] = 1.0, 9.0, 6.0
    assert over_ranks(values, ".1f") == "min 1.0 (rank 7), median 5.0, max 9.0 (rank 3) of 12 ranks"


def test_beyond_8_ranks_the_report_logs_each_trials_spread_not_every_rank():
    entry = lambda r: {"rank": r, **{m: {"mean": 10.0 + r + k, "std": 0.5}  # noqa: E731
                                     for k, m in enumerate(tp.MODES)}}
    two = tp.rank_lines([entry(0), entry(1)])
    assert two == ["  rank 0: IO 10.0 +/- 0.5, SYNTHETIC 11.0 +/- 0.5, FULL 12.0 +/- 0.5",
                   "  rank 1: IO 11.0 +/- 0.5, SYNTHETIC 12.0 +/- 0.5, FULL 13.0 +/- 0.5"]
    many = tp.rank_lines([entry(r) for r in range(16)])
    assert many == [f"  {m} per rank (mean of the rounds): min {10 + k:.1f} (rank 0), median "
                    f"{17.5 + k:.1f}, max {25 + k:.1f} (rank 15) of 16 ranks"
                    for k, m in enumerate(tp.MODES)]


def test_bottleneck_rule():
    assert "the loader is the bottleneck" in tp.bottleneck_line(50, 200, 48)
    assert "not hidden" not in tp.bottleneck_line(50, 200, 48)
    keeps_up = tp.bottleneck_line(500, 200, 190)
    assert "the loader keeps up" in keeps_up and "not hidden" not in keeps_up
    serial = tp.bottleneck_line(300, 200, 120)  # loading and compute one after the other
    assert "the loader keeps up" in serial and "60% of the slower one" in serial
    assert "no loader workers: try --num_data_workers" in serial
    one = tp.bottleneck_line(300, 200, 120, workers=1)  # the advice fits the run
    assert "1 loader worker and the model share too few cores" in one and "no loader" not in one
    steady = tp.bottleneck_line(1964.6, 200, 150, std={"IO": 300, "SYNTHETIC": 5, "FULL": 2})
    assert "the loader keeps up" in steady


def test_no_verdict_from_rounds_that_disagree_more_than_they_agree():
    line = tp.bottleneck_line(1964.6, 200, 150, std={"IO": 2109.8, "SYNTHETIC": 5, "FULL": 2})
    assert line.startswith("Bottleneck: none named, the measurement is too noisy (IO 1964.6 "
                           "+/- 2109.8 samples/s): ")
    assert "loader" not in line.split("): ")[0] and "keeps up" not in line
    assert "more steps per epoch" in line and "fewer threads" in line and "idle machine" in line


# ----------------------------------------------------------------------------- train.py runs


@pytest.fixture(scope="module")
def era5(tmp_path_factory):
    return write_era5(str(tmp_path_factory.mktemp("tp") / "era5"), steps=20)  # 9 steps of 4


def test_report_leaves_the_checkpoint_as_without_it(tmp_path, era5):
    common = TINY_VIT + ["--data_root", era5, "--num_epochs", "2", "--dropout", "0.1"]
    train(common + ["--expdir", str(tmp_path / "plain")])
    r = train(common + ["--expdir", str(tmp_path / "report"), "--throughput_report"])
    report = check_report(run_dir(str(tmp_path / "report")))
    # 9 steps an epoch: 2 warm-up + 6 timed, short of the batch fetched a step ahead
    assert (report["warmup_batches"], report["timed_batches"]) == (2, 6)
    assert "Throughput (samples/s" in r.stdout
    assert not os.path.exists(os.path.join(run_dir(str(tmp_path / "plain")), "throughput.json"))
    a, b = (torch.load(os.path.join(run_dir(str(tmp_path / d)), "checkpoints",
                                    "ckpt_00000018.pt"), weights_only=True)
            for d in ("plain", "report"))
    assert sorted(os.listdir(os.path.join(run_dir(str(tmp_path / "report")), "checkpoints"))) \
        == ["ckpt_00000018.pt"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for k, v in a["optimizer"]["state"].items():
        assert torch.equal(v["exp_avg"], b["optimizer"]["state"][k]["exp_avg"])
    assert torch.equal(a["rng"][0]["torch"], b["rng"][0]["torch"])


def test_enable_benchy_reports_for_the_unet(tmp_path):
    root = write_cosmo_pair(tmp_path / "cosmo", side=32)
    exp = str(tmp_path / "logs")
    train(TINY_UNET + ["--data_root", root, "--expdir", exp, "--num_iters", "2", "--Nsamples", "20",
                       "--Nsamples_val", "4", "--data_size", "32", "--global_batch_size", "4",
                       "--base_batch_size", "4", "--num_data_workers", "1", "--enable_benchy"])
    report = check_report(run_dir(exp))
    assert report["num_data_workers"] == 1 and report["timed_batches"] == 2


# ----------------------------------------------------------------------------- in process


class Counting(Trainer):
    """Notes every optimizer step's weights once training has ended (the trials' steps)."""

    trial_steps = 0
    trial_weights = None

    def train_step(self, x, y, *args, **kwargs):
        out = super().train_step(x, y, *args, **kwargs)
        if self.iteration >= self.total_steps:
            self.trial_steps += 1
            self.trial_weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return out


def test_trials_train_and_the_state_is_put_back(tmp_path, era5):
    cfg = tiny_vit_cfg(era5, str(tmp_path), num_iters=5, dropout=0.1, throughput_report="true")
    tr = Counting(cfg, setup_runtime(cfg))
    tr.fit()
    warmup, timed = tp.trial_sizes(tr.steps_per_epoch, tr.stopper.lag)
    assert tr.trial_steps == 2 * tp.ROUNDS * (warmup + timed)  # SYNTHETIC and FULL
    final = torch.load(os.path.join(tr.ckpt_dir, "ckpt_00000005.pt"), weights_only=True)
    after = tr.model.state_dict()
    assert any(not torch.equal(tr.trial_weights[k], final["model"][k]) for k in after), \
        "the trials did not change the weights: FULL and SYNTHETIC did not train"
    for k, v in after.items():
        assert torch.equal(v, final["model"][k]), k
    state = tr.sharding.optimizer_state(tr.model, tr.optimizer)["state"]  # checkpoint layout
    for k, v in final["optimizer"]["state"].items():
        assert torch.equal(state[k]["exp_avg_sq"], v["exp_avg_sq"])
        assert float(state[k]["step"]) == 5
    assert tr.scheduler.last_epoch == 5
    assert torch.equal(torch.get_rng_state(), final["rng"][0]["torch"])
    assert tr.loaders.train_sampler.epoch == tr.state.epoch


def test_the_summarys_seconds_leave_the_report_out(tmp_path, era5, monkeypatch):
    """The closing line's "s of training and validation" ends before the report's passes."""
    monkeypatch.setattr(tp, "run", lambda trainer: time.sleep(2.0))  # a report of 2 s
    cfg = tiny_vit_cfg(era5, str(tmp_path), num_iters=2, throughput_report="true")
    tr = Trainer(cfg, setup_runtime(cfg))
    t0 = time.time()
    tr.fit()
    whole = time.time() - t0
    log = open(os.path.join(tr.run_dir, "out.log")).read()
    (said,) = re.findall(r"Summary: .*, ([0-9.]+) s of training and validation", log)
    assert float(said) <= whole - 2.0 + 0.05, (said, whole)  # (0.05: the line's rounding)


# ----------------------------------------------------------------------------- 2 ranks


def report_on_ranks(data, expdir):
    import torch.distributed as dist

    cfg = tiny_vit_cfg(data, expdir, num_iters=3, global_batch_size=8, base_batch_size=8,
                       throughput_report="true")
    tr = Trainer(cfg, setup_runtime(cfg))
    tr.fit()
    weights = {k: v.detach().clone() for k, v in tr.model.state_dict().items()}
    return dict(rank=dist.get_rank(), run_dir=tr.run_dir, weights=weights)


def test_two_ranks_report_per_rank_and_aggregate(tmp_path, era5):
    ranks = run_ranks(report_on_ranks, 2, era5, str(tmp_path), timeout=180)
    d = ranks[0]["run_dir"]
    report = check_report(d, world_size=2)
    assert report["data_parallel"] == 2 and report["local_batch_size"] == 4
    for m in tp.MODES:  # the aggregate of each round is the sum of the ranks' rates
        rounds = [a + b for a, b in zip(*(e[m]["rounds"] for e in report["per_rank"]))]
        assert report["aggregate"][m]["mean"] == pytest.approx(sum(rounds) / 3)
    log = open(os.path.join(d, "out.log")).read()
    assert "Throughput (all 2 ranks, samples/s" in log
    assert "  rank 0: IO " in log and "  rank 1: IO " in log
    final = torch.load(os.path.join(d, "checkpoints", "ckpt_00000003.pt"), weights_only=True)
    for r in ranks:  # every replica put back to the checkpointed weights
        for k, v in r["weights"].items():
            assert torch.equal(v, final["model"][k]), (r["rank"], k)


@pytest.mark.parametrize("loader", ["lowmem", "synthetic"])
def test_the_reports_passes_agree_on_stopping_as_training_does(tmp_path, era5, loader):
    """After each fetch of a pass (its batches and its end) with a loader that reads; after
    every log_every (2) fetches with one that never waits (the cached synthetic batch)."""
    cfg = tiny_vit_cfg(era5, str(tmp_path), num_iters=1, data_loader_config=loader)
    tr = Trainer(cfg, setup_runtime(cfg))
    asked = []
    propose = tr.stopper.propose
    tr.stopper.propose = lambda *a, **kw: (asked.append(1), propose(*a, **kw))
    try:
        fetches = len(list(tp._loader_pass(tr, 5))) + 1
        assert fetches == tr.steps_per_epoch + 1 > 2
        assert len(asked) == (fetches if loader == "lowmem" else (fetches + 1) // 2)
    finally:
        tr.loaders.close()
