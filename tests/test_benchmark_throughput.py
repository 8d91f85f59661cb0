"""benchmarks/throughput.py on tiny data: every loader row (the device loader's one row, DALI's
where installed), the main process's CPU time per batch, and the goals."""
import pytest

from benchmarks import throughput as tp
from conftest import write_cosmo_pair, write_era5

ERA5_SAMPLE = 2 * 20 * 16 * 32 * 4  # bytes of an input + target pair, float32
CROP_SAMPLE = (4 + 5) * 32**3 * 4


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    era5 = write_era5(str(d / "era5"))
    cosmo = write_cosmo_pair(d / "cosmo", side=40)
    return tp.loader_cases(era5, cosmo, img_size=(16, 32), era5_batch=4, crop=32, crop_batch=4,
                           unet_config="quickstart")


def test_loader_rows_cover_every_setting_and_worker_count(cases, capsys):
    rows = tp.loader_rows(cases, [0, 1], n_batches=2, rounds=2, settings=("lowmem", "inmem", "device"))
    got = [(r["data"], r["setting"], r["workers"]) for r in rows]
    era5, crops = cases[0].label, cases[1].label
    assert got == [(era5, "lowmem", 0), (era5, "lowmem", 1), (era5, "inmem", 0), (era5, "inmem", 1),
                   (crops, "lowmem", 0), (crops, "lowmem", 1), (crops, "inmem", 0), (crops, "inmem", 1),
                   (crops, "device", 0)]  # the device loader: one row, no workers
    for r in rows:
        assert r["raw"]["rate"] > 0 and r["now"]["rate"] > 0
        assert r["now"]["cpu_ms"] >= 0 and r["main_share"] == pytest.approx(
            r["now"]["cpu_ms"] / (1e3 * r["batch"] / r["raw"]["rate"]))
        per_sample = ERA5_SAMPLE if r["data"] == era5 else CROP_SAMPLE
        assert r["now"]["gbs"] * 1e9 / r["now"]["rate"] == pytest.approx(per_sample)
        assert r["raw"]["gbs"] * 1e9 / r["raw"]["rate"] == pytest.approx(per_sample)
    out = capsys.readouterr().out.splitlines()
    device = [line for line in out if "| device |" in line]
    assert len(device) == 1 and device[0].startswith(f"| {crops} | device | – |")
    header = tp.table_header().splitlines()[0]
    assert "now, main CPU ms/batch" in header and "now, GB/s" in header
    assert all(line.count("|") == header.count("|") for line in out if line.startswith("| "))
    lines = tp.goal_lines(rows)
    assert any("the device loader" in line for line in lines)
    assert sum("of the raw read" in line for line in lines) == 8  # lowmem, inmem x 0, 1 workers
    assert sum("the main process" in line for line in lines) == 4  # the rows with workers


def test_goals_met_and_not_met():
    def row(setting, workers, ratio, share, rate=100.0):
        return {"data": "d", "setting": setting, "workers": workers, "ratio": ratio,
                "main_share": share, "now": {"rate": rate, "cpu_ms": 1.0}}

    lines = tp.goal_lines([row("lowmem", 0, 0.95, 1.0), row("lowmem", 2, 0.5, 0.01),
                           row("inmem", 1, 0.2, 0.2, rate=40.0), row("inmem", 2, 1.2, 0.08, rate=50.0),
                           row("device", 0, 0.4, 1.0, rate=60.0)])
    assert lines[0].startswith("- met: d, lowmem, 0 workers: 0.95")
    assert lines[1].startswith("- NOT met: d, lowmem, 2 workers: 0.50")
    assert lines[2].startswith("- met: d, lowmem, 2 workers: the main process")
    assert lines[3].startswith("- NOT met: d, inmem, 1 workers: the main process")  # 1 worker: 20%
    assert lines[4].startswith("- met: d, inmem, 2 workers: 1.20")
    assert lines[5].startswith("- NOT met: d, inmem, 2 workers: the main process")
    assert lines[6].startswith("- met: d: the device loader 60.0 samples/s, the fastest inmem 50.0")
    assert len(lines) == 7


def test_dali_rows(cases):
    pytest.importorskip("nvidia.dali")
    rows = tp.loader_rows(cases, [0], n_batches=2, rounds=1, settings=("dali-lowmem", "dali-inmem"))
    assert [(r["setting"], r["workers"]) for r in rows] == [("dali-lowmem", 0), ("dali-inmem", 0)] * 2
    assert all(r["now"]["rate"] > 0 for r in rows)
