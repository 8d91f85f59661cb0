"""python -m datapipe.convert_era5: WeatherBench 2-layout stores made here, converted, every value
checked against the store, the statistics against NumPy in float64, refusals, skip and redo, and a
training run on the result."""
import os
import sys
from types import SimpleNamespace

import h5py
import numpy as np
import pytest

import preloaded
from conftest import ROOT, file_digests

xr = pytest.importorskip("xarray")  # requirements-era5.txt, installed with the tests

from datapipe import convert_era5  # noqa: E402
from datapipe.era5_data import raw_layout  # noqa: E402
from datapipe.formats import ERA5_CHANNELS  # noqa: E402

LEVELS = [50, 500, 850, 1000]
SURFACE = ["10m_u_component_of_wind", "10m_v_component_of_wind", "2m_temperature",
           "surface_pressure", "mean_sea_level_pressure", "total_column_water_vapour"]
UPPER = ["u_component_of_wind", "v_component_of_wind", "geopotential", "temperature",
         "relative_humidity", "specific_humidity"]
YEARS = {"train": [2016, 2017], "valid": [2018], "test": [2019]}


def year_times(years, steps, hours=6):
    """``steps`` times ``hours`` apart from 1 January of each year."""
    return np.concatenate([np.datetime64(f"{y}-01-01T00", "ns") + np.arange(steps)
                           * np.timedelta64(hours, "h") for y in years])


def wb2_dataset(h, w, times, lon_first=False, levels=LEVELS, drop=(), seed=0):
    """A store in WeatherBench 2's layout: long names, levels in hPa, latitude ascending, each
    variable of its own offset and scale (geopotential ~5e4, pressure ~1e5) in float32."""
    rng = np.random.default_rng(seed)
    lat = np.linspace(-90, 90, h) if h % 2 else np.linspace(-90, 90, h + 1)[:-1] + 90 / h
    space = ("longitude", "latitude") if lon_first else ("latitude", "longitude")
    shape = (w, h) if lon_first else (h, w)
    data = {}
    for i, name in enumerate(SURFACE + UPPER):
        if name in drop:
            continue
        dims = ("time",) + (("level",) if name in UPPER else ()) + space
        size = (len(times),) + ((len(levels),) if name in UPPER else ()) + shape
        values = 10.0 ** (i % 6) * (1 + i + rng.standard_normal(size) * 0.1)
        data[name] = (dims, values.astype(np.float32))
    return xr.Dataset(data, coords={"time": times, "level": np.array(levels, np.int64),
                                    "latitude": lat, "longitude": np.arange(w) * 360.0 / w})


def convert(*args):
    """The command in a process of its own (forked from the preloaded server: torch loaded)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return preloaded.run([sys.executable, "-m", "datapipe.convert_era5", *map(str, args)],
                          cwd=ROOT, capture_output=True, text=True, env=env)


@pytest.fixture
def main(capsys):
    """The command in this process (its imports made once): (exit code, stdout, stderr)."""
    def run(*args):
        capsys.readouterr()
        try:
            convert_era5.main([str(a) for a in args])
            code = 0
        except SystemExit as e:
            code = e.code
        out, err = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out, stderr=err)
    return run


def year_args(years=YEARS, comma=False):
    out = []
    for split, ys in years.items():
        out += [f"--{split}_years={','.join(map(str, ys))}"] if comma else [f"--{split}_years", *ys]
    return out


def expected(ds, year):
    """(T, 20, H, W) float32 of ``year`` at 00/06/12/18 UTC, picked from the store by hand:
    channel by name and level, rows north to south."""
    t = ds["time"].values
    steps = (t.astype("datetime64[Y]").astype(int) + 1970 == year) & \
        ((t - t.astype("datetime64[D]")) % np.timedelta64(6, "h") == np.timedelta64(0))
    out = []
    for channel in ERA5_CHANNELS:
        name, level = convert_era5.CHANNELS[channel]
        da = ds[name] if level is None else ds[name].isel(level=LEVELS.index(level))
        a = da.transpose("time", "latitude", "longitude").values[steps]
        out.append(a[:, ::-1])  # the store's latitudes ascend
    return np.stack(out, axis=1)


def check_output(out, ds, years=YEARS):
    train = []
    for split, ys in years.items():
        for y in ys:
            path = os.path.join(out, split, f"{y}.h5")
            with h5py.File(path, "r") as f:
                fields = f["fields"]
                assert fields.dtype == np.float32 and fields.chunks is None
                assert fields.compression is None and raw_layout(path, fields) is not None
                np.testing.assert_array_equal(fields[...], expected(ds, y))
                if split == "train":
                    train.append(fields[...].astype(np.float64))
    x = np.concatenate(train)
    stats = {n: np.load(os.path.join(out, "stats", f"{n}.npy")) for n in convert_era5.STATS}
    c, h, w = x.shape[1:]
    assert stats["global_means"].shape == (1, c, 1, 1) == stats["global_stds"].shape
    assert stats["time_means"].shape == (1, c, h, w)
    assert all(s.dtype == np.float64 for s in stats.values())
    np.testing.assert_allclose(stats["global_means"].ravel(), x.mean(axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(stats["global_stds"].ravel(), x.std(axis=(0, 2, 3)), rtol=1e-9)
    np.testing.assert_allclose(stats["time_means"][0], x.mean(axis=0), rtol=1e-12)


@pytest.fixture(scope="module")
def zarr_store(tmp_path_factory):
    """8 x 16 without pole rows, (time, level, latitude, longitude), six-hourly."""
    path = str(tmp_path_factory.mktemp("wb2") / "era5.zarr")
    ds = wb2_dataset(8, 16, year_times(sum(YEARS.values(), []), 6))
    ds.to_zarr(path, zarr_format=2)
    return path, ds


def test_zarr_store_converts_trains_and_reads_back(tmp_path, zarr_store, monkeypatch, capsys):
    source, ds = zarr_store
    out = tmp_path / "out"
    r = convert(source, out, *year_args(comma=True))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("steps of 8x16") == 4 and "stats/" in r.stdout
    check_output(out, ds)
    # a training run reads the result
    run = preloaded.run(
        [sys.executable, "train.py", "--img_size", "[8,16]", "--patch_size", "4", "--embed_dim",
         "32", "--depth", "1", "--num_heads", "2", "--global_batch_size", "2",
         "--base_batch_size", "2", "--synthesize_if_missing", "false", "--num_iters", "2",
         "--data_root", str(out), "--expdir", str(tmp_path / "runs")],
        cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "Avg val loss" in run.stdout + run.stderr
    # and scores it, with the converted climatology: in this process, and without matplotlib (its
    # documented fallback: the tables, not the plots, which test_scoring draws); the climatology
    # read from the converted stats is in the numbers, not in the plots
    import score
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    capsys.readouterr()
    score.main(["--run", str(tmp_path / "runs" / "quickstart" / "1" / "0"), "--n_init", "2",
                "--lead_steps", "2"])
    said = capsys.readouterr().out
    assert "model / persistence / climatology" in said, said[-2000:]  # its forecast scored
    assert "RMSE" in said and "matplotlib is not installed" in said, said[-2000:]


def test_netcdf_hourly_with_poles_in_parallel(tmp_path):
    """9 x 18 with both poles, WeatherBench 2's (time, level, longitude, latitude) order, hourly
    steps (every sixth kept), one NetCDF file per variable; two years at a time."""
    ds = wb2_dataset(9, 18, year_times(sum(YEARS.values(), []), 25, hours=1), lon_first=True,
                     seed=1)
    src = tmp_path / "nc"
    src.mkdir()
    for name in ds.data_vars:
        ds[[name]].to_netcdf(src / f"{name}.nc", engine="h5netcdf")
    r = convert(src, tmp_path / "out", *year_args(), "--workers", "2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("5 steps of 9x18") == 4
    check_output(tmp_path / "out", ds)


def test_channel_override(tmp_path, zarr_store, main):
    source, ds = zarr_store
    years = {"train": [2016], "valid": [], "test": []}
    r = main(source, tmp_path / "out", *year_args(years), "--channel",
                "r500=specific_humidity@500", "--channel", "tcwv=2m_temperature")
    assert r.returncode == 0, r.stderr
    with h5py.File(tmp_path / "out" / "train" / "2016.h5", "r") as f:
        t = ds["time"].values.astype("datetime64[Y]").astype(int) == 2016 - 1970
        q = ds["specific_humidity"].sel(level=500).values[t][:, ::-1]
        np.testing.assert_array_equal(f["fields"][:, ERA5_CHANNELS.index("r500")], q)
        np.testing.assert_array_equal(f["fields"][:, ERA5_CHANNELS.index("tcwv")],
                                      f["fields"][:, ERA5_CHANNELS.index("t2m")])


def _refused(r, *words):
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.parametrize("case", ["variable", "level", "coarse", "gap"])
def test_refusals_write_nothing(tmp_path, case, main):
    times = year_times([2016, 2017], 6)
    if case == "coarse":
        times = year_times([2016, 2017], 6, hours=12)
    if case == "gap":
        times = np.delete(times, 3)
    ds = wb2_dataset(8, 16, times, drop=["relative_humidity"] if case == "variable" else (),
                     levels=[100, 500, 850, 1000] if case == "level" else LEVELS)
    ds.to_zarr(tmp_path / "s.zarr", zarr_format=2)
    out = tmp_path / "out"
    r = main(tmp_path / "s.zarr", out, "--train_years", 2016, 2017)
    want = {"variable": ["relative_humidity", "r500", "specific_humidity"],
            "level": ["level 50 of geopotential", "z50", "[100, 500, 850, 1000]"],
            "coarse": ["not six-hourly", "2016-01-01T12"],
            "gap": ["not six-hourly", "2016-01-01T12:00 is followed by 2016-01-02T00:00"]}[case]
    _refused(r, *want)
    assert not out.exists()


def test_output_folder_with_other_data_refused(tmp_path, zarr_store, main):
    source, _ = zarr_store
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    _refused(main(source, out, "--train_years", 2016), "no CONVERTED.txt")
    assert file_digests(out) == {"notes.txt": file_digests(out)["notes.txt"]}
    # a folder this command wrote, with a file of other years beside its own
    r = main(source, tmp_path / "b", "--train_years", 2016, 2017)
    assert r.returncode == 0, r.stderr
    before = file_digests(tmp_path / "b")
    _refused(main(source, tmp_path / "b", "--train_years", 2016), "train/2017.h5")
    assert file_digests(tmp_path / "b") == before
    _refused(main(source, tmp_path / "c", "--train_years", 2016, "--valid_years", 2016),
             "[2016]")
    _refused(main(source, tmp_path / "c", "--train_years", 2016, "--channel", "x=y"), "x=y")
    _refused(main(source, tmp_path / "c", "--train_years", "20x6"),
             "--train_years 20x6", "--train_years 2016 2017")
    _refused(main(tmp_path / "none.zarr", tmp_path / "c", "--train_years", 2016), "none.zarr")
    _refused(main(source, tmp_path / "c", "--train_years", 2030),
             "0 six-hourly steps of 2030 (its times: 2016-01-01T00:00 to 2019-01-02T06:00)")
    (tmp_path / "file").write_text("")
    _refused(main(source, tmp_path / "file", "--train_years", 2016), "file")
    assert not (tmp_path / "c").exists()


def test_complete_years_skipped_interrupted_redone(tmp_path, zarr_store, monkeypatch, main):
    source, ds = zarr_store
    out = tmp_path / "out"
    assert main(source, out, *year_args()).returncode == 0
    train = out / "train" / "2016.h5"
    stamp = train.stat().st_mtime_ns
    # a year stopped part-way by a kill leaves only a hidden temporary file
    (out / "valid" / "2018.h5").unlink()
    (out / "valid" / ".2018.h5.999.tmp").write_bytes(b"partial")
    r = main(source, out, *year_args())
    assert r.returncode == 0, r.stderr
    assert "train/2016.h5: complete" in r.stdout and "valid/2018.h5: 6 steps" in r.stdout
    assert train.stat().st_mtime_ns == stamp
    assert sorted(os.listdir(out / "valid")) == ["2018.h5"]
    check_output(out, ds)
    r = main(source, out, *year_args())
    assert r.returncode == 0 and "nothing to do" in r.stdout

    # an exception part-way through a year leaves no file that looks complete, and no stats
    monkeypatch.setattr(convert_era5, "CHUNK_BYTES", 20 * 8 * 16 * 4)  # one step at a time
    (out / "test" / "2019.h5").unlink()
    real = convert_era5.select

    class Stops:
        """A channel whose second read fails, as a lost store or a stopped process would."""

        def __init__(self, da):
            self.da, self.shape, self.reads = da, da.shape, 0

        def isel(self, **where):
            self.reads += 1
            if self.reads == 2:
                raise RuntimeError("stopped")
            return self.da.isel(**where)

    def stopping(ds, table):
        arrays = real(ds, table)
        return [(Stops(da), channels) for da, channels in arrays]

    convert_era5.select(ds, convert_era5.CHANNELS)  # the check before writing still passes
    monkeypatch.setattr(convert_era5, "select", stopping)
    with pytest.raises(RuntimeError, match="stopped"):
        convert_era5.convert(source, str(out), YEARS, say=lambda line: None)
    assert os.listdir(out / "test") == [] and not os.listdir(out / "stats")
    monkeypatch.setattr(convert_era5, "select", real)
    convert_era5.convert(source, str(out), YEARS, say=lambda line: None)
    check_output(out, ds)


def test_every_option_is_described(monkeypatch):
    import test_cli_help

    test_cli_help.test_every_option_of_every_tool_has_a_description("datapipe.convert_era5",
                                                                   monkeypatch)
