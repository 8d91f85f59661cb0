"""Synthetic ERA5 and cosmology data: file formats, determinism and the physics the models learn."""
import dataclasses
import logging
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import preloaded  # noqa: E402
from conftest import file_digests  # noqa: E402
from datapipe import synthetic  # noqa: E402
from datapipe.formats import latitudes  # noqa: E402
from datapipe.synthetic import (  # noqa: E402
    ERA5_CHANNELS, HYDRO_VECTOR_CHANNELS, NBODY_VECTOR_CHANNELS, R_DRY, R_EARTH,
    era5_geostrophic_factor, era5_zonal_speed, make_cosmo, make_era5)

STEPS = 64
TRAIN, VALID, TEST = (2000, 2001), (2002,), (2003,)


def ch(name):
    return ERA5_CHANNELS.index(name)


def corr(a, b):
    a, b = np.ravel(a - np.mean(a)), np.ravel(b - np.mean(b))
    return float(a @ b / np.sqrt((a @ a) * (b @ b)))


def read(path, name="fields"):
    with h5py.File(path, "r") as f:
        return f[name][:]


@pytest.fixture(scope="module")
def era5(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("era5"))
    result = make_era5(out, img_size=(32, 64), steps_per_year=STEPS, train_years=TRAIN,
                       valid_years=VALID, test_years=TEST, seed=3)
    return out, result


@pytest.fixture(scope="module")
def train_fields(era5):
    out, _ = era5
    return np.concatenate([read(os.path.join(out, "train", f"{y}.h5")) for y in TRAIN])


@pytest.fixture(scope="module")
def cosmo(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("cosmo"))
    result = make_cosmo(out, train_size=32, val_size=16, seed=5)
    return out, result


def zonal_shift(f, lat, speed_scale=1.0):
    """Shift each row of f (..., H, W) east by era5_zonal_speed(lat) degrees (exact, via FFT)."""
    w = f.shape[-1]
    m = np.arange(w // 2 + 1)
    shift = np.deg2rad(speed_scale * era5_zonal_speed(lat))[:, None]
    return np.fft.irfft(np.fft.rfft(f, axis=-1) * np.exp(-1j * shift * m), n=w, axis=-1)




# ----------------------------------------------------------------------------------------- ERA5

def test_era5_layout_dtypes_and_stats(era5, train_fields):
    out, result = era5
    for split, years in (("train", TRAIN), ("valid", VALID), ("test", TEST)):
        assert sorted(os.listdir(os.path.join(out, split))) == [f"{y}.h5" for y in years]
        assert result[split] == [os.path.join(out, split, f"{y}.h5") for y in years]
        for y in years:
            with h5py.File(os.path.join(out, split, f"{y}.h5"), "r") as f:
                assert list(f.keys()) == ["fields"]
                d = f["fields"]
                assert d.shape == (STEPS, 20, 32, 64) and d.dtype == np.float32
                assert d.chunks is None and d.compression is None  # contiguous like the real files
    assert sorted(os.listdir(os.path.join(out, "stats"))) == [
        "global_means.npy", "global_stds.npy", "time_means.npy"]

    x = train_fields.astype(np.float64)
    means, stds = np.load(result["global_means"]), np.load(result["global_stds"])
    time_means = np.load(result["time_means"])
    assert means.shape == stds.shape == (1, 20, 1, 1) and time_means.shape == (1, 20, 32, 64)
    assert means.dtype == stds.dtype == time_means.dtype == np.float32
    np.testing.assert_allclose(means, x.mean(axis=(0, 2, 3), keepdims=True), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(stds, x.std(axis=(0, 2, 3), keepdims=True), rtol=5e-7)
    np.testing.assert_allclose(time_means, x.mean(axis=0, keepdims=True), rtol=1e-6, atol=1e-4)
    assert len(ERA5_CHANNELS) == 20 and np.all(stds > 0)


def test_era5_values_are_physical(train_fields):
    x = train_fields
    assert np.all(np.isfinite(x))
    assert 180 < x[:, ch("t2m")].min() and x[:, ch("t2m")].max() < 330
    assert np.all(x[:, ch("t500")] < x[:, ch("t850")])  # temperature falls with height
    z = x[:, [ch("z1000"), ch("z850"), ch("z500"), ch("z50")]]
    assert np.all(np.diff(z, axis=1) > 0)  # geopotential rises with height
    assert np.all(x[:, ch("sp")] <= x[:, ch("msl")]) and 4e4 < x[:, ch("sp")].min()
    for name in ("r500", "r850"):
        assert 0 < x[:, ch(name)].min() and x[:, ch(name)].max() < 100
    assert 0 < x[:, ch("tcwv")].min() and x[:, ch("tcwv")].max() < 100
    assert np.abs(x[:, ch("u500")]).max() < 120
    # very different magnitudes across channels: normalisation by the global stats matters
    stds = x.std(axis=(0, 2, 3))
    assert stds.max() / stds.min() > 1e3


def test_era5_deterministic_for_a_seed(tmp_path):
    kw = dict(img_size=(9, 16), steps_per_year=8, train_years=(2010,), valid_years=(),
              test_years=())
    a = make_era5(str(tmp_path / "a"), seed=7, **kw)
    b = make_era5(str(tmp_path / "b"), seed=7, **kw)
    c = make_era5(str(tmp_path / "c"), seed=8, **kw)
    np.testing.assert_array_equal(read(a["train"][0]), read(b["train"][0]))
    np.testing.assert_array_equal(np.load(a["global_stds"]), np.load(b["global_stds"]))
    za, zc = read(a["train"][0])[:, ch("z500")], read(c["train"][0])[:, ch("z500")]
    assert np.abs(za - zc).mean() > 100.0  # m^2/s^2: another realisation of the anomalies


def test_era5_same_physics_at_every_resolution(tmp_path):
    kw = dict(steps_per_year=4, train_years=(2010,), valid_years=(), test_years=(), seed=1)
    coarse = read(make_era5(str(tmp_path / "c"), img_size=(33, 64), **kw)["train"][0])
    fine = read(make_era5(str(tmp_path / "f"), img_size=(65, 128), **kw)["train"][0])
    # the coarse grid's points are every other row and column of the fine grid
    np.testing.assert_allclose(coarse, fine[:, :, ::2, ::2], rtol=1e-5, atol=1e-3)


def test_era5_shift_by_the_flow_beats_persistence(train_fields):
    """Shifting each row by the prescribed jet predicts the next step far better than persisting."""
    lat = latitudes(32)
    for name, max_ratio in (("z500", 0.25), ("t850", 0.25), ("v500", 0.25), ("u500", 0.35),
                            ("tcwv", 0.25)):
        f = train_fields[:, ch(name)].astype(np.float64)
        persistence = np.sqrt(np.mean((f[1:] - f[:-1]) ** 2))
        errors = {s: np.sqrt(np.mean((f[1:] - zonal_shift(f[:-1], lat, s)) ** 2))
                  for s in (0.5, 1.0, 1.5)}
        assert errors[1.0] < max_ratio * persistence, (name, errors[1.0], persistence)
        # the speed in the data is the documented one, not half or 1.5 times it
        assert errors[1.0] < 0.6 * min(errors[0.5], errors[1.5]), (name, errors)
    # features move 1-3 cells per step on a 32 x 64 grid, so persistence really is poor
    cells = era5_zonal_speed(lat) / (360.0 / 64)
    assert cells.min() > 1.0 and cells.max() < 3.0
    z = train_fields[:, ch("z500")].astype(np.float64)
    anomaly = z - z.mean(axis=-1, keepdims=True)
    assert np.sqrt(np.mean((z[1:] - z[:-1]) ** 2)) > 0.4 * anomaly.std()


def test_era5_years_continue_one_trajectory(train_fields):
    """Step 0 of a year follows the last step of the previous year like any other step."""
    lat = latitudes(32)
    f = train_fields[:, ch("z500")].astype(np.float64)
    err = np.sqrt(np.mean((f[1:] - zonal_shift(f[:-1], lat)) ** 2, axis=(1, 2)))  # (2T-1,)
    at_boundary = err[STEPS - 1]  # last step of 2000 -> first step of 2001
    within = np.delete(err, STEPS - 1)
    assert at_boundary < 2.0 * np.median(within)


def test_era5_fields_are_smooth(train_fields):
    x = train_fields.astype(np.float64)
    for name in ERA5_CHANNELS:
        f = x[:, ch(name)]
        f = f - f.mean(axis=-1, keepdims=True)  # anomaly from the zonal mean
        power = np.sum(np.abs(np.fft.rfft(f, axis=-1)[..., 1:]) ** 2, axis=(0, 1))  # m = 1..32
        assert power[16:].sum() < 0.05 * power.sum(), name  # white noise: half of the power
        # neighbouring rows are alike (white noise: mean squared difference = 2 variances);
        # u ~ dz/dphi has the finest meridional structure
        dy = np.mean((f[:, 1:] - f[:, :-1]) ** 2) / f.var()
        assert dy < (0.7 if name[0] == "u" else 0.3), (name, dy)


def test_era5_winds_are_geostrophic(train_fields):
    """u ~ -K/R dz/dphi and v ~ K/(R cos phi) dz/dlambda from finite differences of z."""
    x = train_fields[::4].astype(np.float64)
    lat = latitudes(32)
    phi, dphi, dlam = np.deg2rad(lat), np.deg2rad(180.0 / 31), np.deg2rad(360.0 / 64)
    k = era5_geostrophic_factor(lat)[:, None] / R_EARTH
    for level in ("1000", "850", "500"):
        z = x[:, ch("z" + level)]
        dz_dphi = -(z[:, 2:] - z[:, :-2]) / (2 * dphi)  # rows 1..H-2; rows run north to south
        u_fd = -k[1:-1] * dz_dphi
        dz_dlam = (np.roll(z, -1, axis=-1) - np.roll(z, 1, axis=-1)) / (2 * dlam)
        v_fd = k[2:-2] / np.cos(phi[2:-2])[:, None] * dz_dlam[:, 2:-2]
        u, v = x[:, ch("u" + level)], x[:, ch("v" + level)]
        assert corr(u[:, 2:-2], u_fd[:, 1:-1]) > 0.95, level  # interior rows 2..H-3
        assert corr(v[:, 2:-2], v_fd) > 0.95, level
    np.testing.assert_allclose(x[:, ch("u10m")], 0.7 * x[:, ch("u1000")], rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(x[:, ch("v10m")], 0.7 * x[:, ch("v1000")], rtol=1e-4, atol=1e-3)


def test_era5_temperature_and_moisture_relations(train_fields):
    x = train_fields.astype(np.float64)
    thickness = x[:, ch("z500")] - x[:, ch("z1000")]
    for name in ("t850", "t500"):
        t = x[:, ch(name)]
        assert corr(t, thickness) > 0.99
        slope = np.polyfit(thickness.ravel(), t.ravel(), 1)[0]
        assert slope == pytest.approx(1.0 / (R_DRY * np.log(2.0)), rel=0.02)  # hypsometric
    assert corr(x[:, ch("t2m")], x[:, ch("t850")]) > 0.9
    assert corr(x[:, ch("msl")], x[:, ch("z1000")]) > 0.95
    # Clausius-Clapeyron: column water grows exponentially with temperature
    assert corr(np.log(x[:, ch("tcwv")]), x[:, ch("t850")]) > 0.8


def test_era5_write_is_atomic(tmp_path, monkeypatch):
    calls = []

    def failing(self, t):
        calls.append(len(t))
        if len(calls) > 1:
            raise RuntimeError("simulated crash")
        return original(self, t)

    original = synthetic._Era5Model.fields
    monkeypatch.setattr(synthetic._Era5Model, "fields", failing)
    with pytest.raises(RuntimeError):
        make_era5(str(tmp_path), img_size=(128, 256), steps_per_year=32, train_years=(2010,),
                  valid_years=(), test_years=())
    assert len(calls) == 2  # the file was half written when the crash came
    assert os.listdir(tmp_path / "train") == []  # neither a partial year file nor a temporary


def test_era5_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="img_size"):
        make_era5(str(tmp_path), img_size=(0, 64))
    with pytest.raises(ValueError, match="2015"):
        make_era5(str(tmp_path), train_years=(2015,), valid_years=(2015,))


# ------------------------------------------------------------------------------------ cosmology

def spectral_ops(shape):
    k = [2 * np.pi * np.fft.fftfreq(n) for n in shape]
    return np.meshgrid(*k, indexing="ij")


def smooth(field, radius):
    kx, ky, kz = spectral_ops(field.shape)
    window = np.exp(-0.5 * (kx ** 2 + ky ** 2 + kz ** 2) * radius ** 2)
    return np.fft.ifftn(np.fft.fftn(field) * window).real


def test_cosmo_layout_and_ranges(cosmo):
    out, result = cosmo
    assert sorted(os.listdir(out)) == ["train.h5", "valid.h5"]
    assert result["train"] == os.path.join(out, "train.h5")
    for path, size in ((result["train"], 32), (result["valid"], 16)):
        with h5py.File(path, "r") as f:
            assert sorted(f.keys()) == ["Hydro", "Nbody"]
            assert f["Nbody"].shape == (4, size, size, size)
            assert f["Hydro"].shape == (5, size, size, size)
            for d in (f["Nbody"], f["Hydro"]):
                assert d.dtype == np.float32 and d.chunks is None
            nbody, hydro = f["Nbody"][:], f["Hydro"][:]
        assert np.all(np.isfinite(nbody)) and np.abs(hydro).max() <= 0.95  # inside tanh's range
        for x in list(nbody) + list(hydro):
            assert 0.02 < x.std() < 1.0  # every channel carries signal at O(0.1-1)
        rho = np.exp(14.0 * hydro[0].astype(np.float64))  # the lambda_rho loss term's density
        assert np.isfinite(rho).all() and 0.5 < rho.mean() < 2.0 and rho.max() < 1e4
    assert NBODY_VECTOR_CHANNELS == (1, 2, 3) and HYDRO_VECTOR_CHANNELS == (2, 3, 4)


def test_cosmo_deterministic_and_independent(tmp_path, cosmo):
    _, result = cosmo
    again = make_cosmo(str(tmp_path / "a"), train_size=32, val_size=16, seed=5)
    other = make_cosmo(str(tmp_path / "b"), train_size=32, val_size=32, seed=6)
    for key in ("train", "valid"):
        for name in ("Nbody", "Hydro"):
            np.testing.assert_array_equal(read(result[key], name), read(again[key], name))
    assert abs(corr(read(result["train"], "Nbody")[0], read(other["train"], "Nbody")[0])) < 0.1
    # training and validation boxes are independent realisations
    assert abs(corr(read(other["train"], "Nbody")[0], read(other["valid"], "Nbody")[0])) < 0.1


def test_cosmo_hydro_follows_nbody(cosmo):
    _, result = cosmo
    nbody = read(result["train"], "Nbody").astype(np.float64)
    hydro = read(result["train"], "Hydro").astype(np.float64)
    rho_m = np.exp(4.0 * nbody[0])  # Nbody channel 0 is ln(rho_m / mean) / 4
    smoothed = np.log(np.maximum(smooth(rho_m, 2.0), 1e-6))
    assert corr(hydro[0], smoothed) > 0.9
    assert corr(hydro[0], smoothed) > corr(hydro[0], nbody[0]) + 0.1  # gas is the smoother one
    assert corr(hydro[1], hydro[0]) > 0.95  # T ~ rho_gas^(gamma - 1)
    for a in range(3):
        assert corr(hydro[HYDRO_VECTOR_CHANNELS[a]], nbody[NBODY_VECTOR_CHANNELS[a]]) > 0.9


def test_cosmo_velocity_is_linear_theory(cosmo):
    """The matter velocity is a potential flow whose divergence is minus the density contrast."""
    _, result = cosmo
    nbody = read(result["train"], "Nbody").astype(np.float64)
    k = spectral_ops(nbody.shape[1:])
    v_k = [np.fft.fftn(nbody[c]) for c in NBODY_VECTOR_CHANNELS]  # component a along axis a
    div = np.fft.ifftn(sum(1j * k[a] * v_k[a] for a in range(3))).real
    curl = [np.fft.ifftn(1j * k[b] * v_k[c] - 1j * k[c] * v_k[b]).real
            for b, c in ((1, 2), (2, 0), (0, 1))]
    assert np.sqrt(np.mean(sum(c ** 2 for c in curl))) < 1e-4 * div.std()
    assert corr(div, nbody[0]) < -0.99  # continuity: div v = -f a H delta
    # the same with centred finite differences, to within their truncation error
    fd = sum((np.roll(nbody[1 + a], -1, a) - np.roll(nbody[1 + a], 1, a)) / 2 for a in range(3))
    assert corr(fd, nbody[0]) < -0.85


# ------------------------------------------------------------------------------------------ CLI

def run_cli(*args, fresh=False):
    run = subprocess.run if fresh else preloaded.run  # fresh: nothing loaded before it
    return run([sys.executable, "-m", "datapipe.synthetic", *args], cwd=ROOT, capture_output=True,
               text=True, timeout=120)


def test_cli_writes_era5_and_cosmo(tmp_path):
    proc = run_cli("era5", "--out", str(tmp_path / "era5"), "--img_size", "8", "16",
                   "--steps_per_year", "8", "--train_years", "2001", "2002", "--valid_years",
                   "2003", "--test_years", "2004", "--seed", "2")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 7 and "(8, 20, 8, 16)" in lines[0] and "2001.h5" in lines[0]
    size = os.path.getsize(tmp_path / "era5" / "train" / "2001.h5")
    assert lines[0].endswith(f"float32  {size:,} bytes")
    assert read(str(tmp_path / "era5" / "test" / "2004.h5")).shape == (8, 20, 8, 16)
    assert np.load(tmp_path / "era5" / "stats" / "time_means.npy").shape == (1, 20, 8, 16)

    proc = run_cli("cosmo", "--out", str(tmp_path / "cosmo"), "--train_size", "16",
                   "--val_size", "8")
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip().splitlines()) == 2
    assert read(str(tmp_path / "cosmo" / "valid.h5"), "Hydro").shape == (5, 8, 8, 8)


def test_cli_lists_are_written_either_way(tmp_path):
    """As train.py's list settings ('[8,16]', 8,16) or as argparse's (8 16)."""
    proc = run_cli("era5", "--out", str(tmp_path / "era5"), "--img_size", "[8,16]",
                   "--steps_per_year", "4", "--train_years", "2001,2002", "--valid_years",
                   "[2003]", "--test_years")
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(tmp_path / "era5" / "train")) == ["2001.h5", "2002.h5"]
    assert read(str(tmp_path / "era5" / "valid" / "2003.h5")).shape == (4, 20, 8, 16)
    assert not os.listdir(tmp_path / "era5" / "test")  # no test years


@pytest.mark.parametrize("args, needle", [
    (("era5", "--img_size", "0", "64"), "0 64"),
    (("era5", "--img_size", "[8]"), "--img_size [8]: give 2 numbers"),
    (("era5", "--img_size", "8", "x"), "--img_size 8 x: give whole numbers"),
    (("era5", "--steps_per_year", "1"), "steps_per_year"),
    (("cosmo", "--train_size", "4"), "train_size must be at least 8 voxels, got 4"),
])
def test_cli_rejects_bad_arguments(tmp_path, args, needle):
    proc = run_cli(args[0], "--out", str(tmp_path), *args[1:])
    assert proc.returncode != 0
    assert needle in proc.stderr and "Traceback" not in proc.stderr
    assert not any(tmp_path.iterdir())  # nothing written


# ------------------------------------------------- where synthetic data may be written (never over a user's)

def assert_one_error_line(proc, *needles):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


TINY_ERA5 = ("--img_size", "8", "16", "--steps_per_year", "4")


@pytest.mark.parametrize("kind, files", [
    ("era5", ("train/2016.h5", "valid/2017.h5", "stats/global_means.npy", "stats/global_stds.npy")),
    ("cosmo", ("train.h5", "valid.h5")),
])
def test_cli_never_writes_over_a_data_set(tmp_path, kind, files):
    """A real data set's directory (its files named as the generator names its own) is refused:
    exit 2, one error line naming --out and the fix, and not a byte of it changed or added."""
    real = tmp_path / "real"
    for name in files:
        (real / name).parent.mkdir(parents=True, exist_ok=True)
        (real / name).write_bytes(b"the user's own bytes " * 50)
    before = file_digests(real)
    if kind == "era5":  # years that would write over the user's
        args = TINY_ERA5 + ("--train_years", "2016", "--valid_years", "2017", "--test_years")
    else:
        args = ("--train_size", "8", "--val_size", "8")
    proc = run_cli(kind, "--out", str(real), *args)
    assert_one_error_line(proc, f"error: --out {real} holds files but no SYNTHETIC.txt",
                          "choose another --out")
    assert proc.stdout == "" and file_digests(real) == before
    assert sorted(os.listdir(tmp_path)) == ["real"]


def test_cli_marks_its_output_and_writes_over_only_that(tmp_path):
    """What the command writes is marked SYNTHETIC.txt, so the same command may write it again;
    a file it does not write there (the user's notes, another year) is refused by name, and the
    directory is left as it was."""
    out = tmp_path / "era5"
    assert run_cli("era5", "--out", str(out), *TINY_ERA5).returncode == 0
    assert (out / "SYNTHETIC.txt").is_file()
    proc = run_cli("era5", "--out", str(out), *TINY_ERA5, "--seed", "1")  # its own files: again
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr

    (out / "NOTES.txt").write_text("my notes\n")
    (out / "train" / "2019.h5").write_bytes(b"a year of my own " * 50)
    before = file_digests(out)
    proc = run_cli("era5", "--out", str(out), *TINY_ERA5)
    assert_one_error_line(proc, f"error: --out {out} holds synthetic data (SYNTHETIC.txt) but "
                          f"also NOTES.txt, train/2019.h5,", "move them out, or choose another --out")
    assert file_digests(out) == before


@pytest.mark.parametrize("kind, first, other", [
    ("era5", TINY_ERA5, ("--img_size", "8", "16", "--steps_per_year", "5")),
    ("cosmo", ("--train_size", "8", "--val_size", "8"), ("--train_size", "16", "--val_size", "8")),
])
def test_cli_replaces_synthetic_data_of_other_shapes_only_when_asked(tmp_path, kind, first, other):
    """Synthetic data of other shapes in --out is another data set (a run may be using it): one
    error line naming a file, its shapes and --replace, exit 2, nothing changed; with --replace
    it is written over. The mark records the command that wrote the data."""
    out = tmp_path / kind
    assert run_cli(kind, "--out", str(out), *first).returncode == 0
    mark = (out / "SYNTHETIC.txt").read_text().splitlines()[0]
    assert mark == f"Synthetic data written by python -m datapipe.synthetic {kind} --out {out} " \
        + " ".join(first)
    before = file_digests(out)
    proc = run_cli(kind, "--out", str(out), *other)
    assert_one_error_line(proc, f"error: --out {out} holds synthetic data of other shapes",
                          "add --replace to write over it, or choose another --out")
    assert proc.stdout == "" and file_digests(out) == before
    proc = run_cli(kind, "--out", str(out), *other, "--replace")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert "--replace" in (out / "SYNTHETIC.txt").read_text().splitlines()[0]
    assert run_cli(kind, "--out", str(out), *other).returncode == 0  # now of these shapes


def test_a_run_on_synthetic_data_names_what_made_it(tmp_path, caplog):
    """The run's data line names the writer that SYNTHETIC.txt records: the command, or a run."""
    from datapipe.data_loader import ensure_data
    from datapipe.make_data import make_data_once
    cli, run = tmp_path / "cli", tmp_path / "run"
    synthetic.main(["era5", "--out", str(cli), "--img_size", "16", "32", "--steps_per_year", "4"])
    make_data_once(_vit_cfg(run))
    for root, maker in ((cli, f"python -m datapipe.synthetic era5 --out {cli} --img_size 16 32 "
                              f"--steps_per_year 4"),
                        (run, "a training run (synthesize_if_missing)")):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            ensure_data(_vit_cfg(root), 0, 1)
        assert f"Data: the synthetic vit data under {root} (made by {maker}: not real data)" \
            in caplog.text, caplog.text


def _doc_commands():
    """Every ``python -m datapipe.synthetic`` command of the README and docs/."""
    import glob
    import shlex
    found = []
    for path in [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md"))]:
        for line in open(path).read().splitlines():
            if line.strip().startswith("python -m datapipe.synthetic"):
                found.append((os.path.relpath(path, ROOT), shlex.split(line.split("#")[0])[3:]))
    return found


def _arrays(root):
    out = {}
    for rel in synthetic.list_files(root):
        if rel.endswith(".npy"):
            out[rel] = {None: np.load(os.path.join(root, rel))}
        elif rel.endswith(".h5"):
            with h5py.File(os.path.join(root, rel), "r") as f:
                out[rel] = {name: f[name][:] for name in f}
    return out


def test_the_documented_data_commands_leave_the_quickstarts_data_as_they_make_it(tmp_path):
    """A documented command that writes into a config's synthesize_if_missing data_root writes
    exactly the data that config makes there (else its figures would no longer reproduce); the
    others write elsewhere."""
    from datapipe.make_data import synthesize
    from settings.parse import build_config, load_yaml_configs
    roots = {}  # data_root -> the configs that make their data there
    for kind, yaml in (("era5", "ViT.yaml"), ("cosmo", "UNet.yaml")):
        path = os.path.join(ROOT, "config", yaml)
        for name in load_yaml_configs(path):
            cfg = build_config(path, name, {})
            if cfg.synthesize_if_missing:
                roots.setdefault((kind, os.path.normpath(cfg.data_root)), []).append(cfg)
    commands = _doc_commands()
    assert {kind for _, (kind, *_) in commands} == {"era5", "cosmo"}, commands
    compared, seen = 0, set()
    for i, (doc, (kind, *args)) in enumerate(commands):
        if (kind, *args) in seen:  # the same command in another document: the same data,
            continue  # compared already
        seen.add((kind, *args))
        at = args.index("--out") + 1
        for j, cfg in enumerate(roots.get((kind, os.path.normpath(args[at])), [])):
            made, ours = tmp_path / f"doc{i}", tmp_path / f"cfg{i}-{j}"
            synthetic.main([kind, *args[:at], str(made), *args[at + 1:]])
            synthesize(dataclasses.replace(cfg, data_root=str(ours)))
            a, b = _arrays(made), _arrays(ours)
            assert a.keys() == b.keys(), (doc, args)
            for rel in a:
                assert a[rel].keys() == b[rel].keys(), (doc, args, rel)
                for name in a[rel]:
                    np.testing.assert_array_equal(a[rel][name], b[rel][name], err_msg=f"{doc}: {args}")
            compared += 1
    assert compared >= 2  # the README's commands write the quickstarts' data_roots


def test_cli_runs_without_warnings(tmp_path):
    """``python -m datapipe.synthetic`` is not imported by its package before it runs (runpy's
    RuntimeWarning: a second copy of the module), and importing the package leaves it alone."""
    # runpy gives its RuntimeWarning exactly when importing the package (which ``-m`` does
    # first) has loaded datapipe.synthetic, so the empty stderr of a fresh interpreter's run is
    # also the check that importing the package leaves the module alone
    proc = run_cli("cosmo", "--out", str(tmp_path / "cosmo"), "--train_size", "8", "--val_size", "8",
                   fresh=True)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def _vit_cfg(root):
    from settings.parse import build_config
    return build_config(os.path.join(ROOT, "config", "ViT.yaml"), "quickstart",
                        {"img_size": "[16,32]", "synthesize_if_missing": "true",
                         "synthetic_steps_per_year": "4", "data_root": str(root)})


def test_training_regenerates_incomplete_synthetic_data_and_says_so(tmp_path, caplog):
    """A marked data_root that lacks a part and holds nothing but the generator's files is made
    anew, and the log calls it incomplete synthetic data, not "No data"."""
    from datapipe import make_data
    root = tmp_path / "era5"
    cfg = _vit_cfg(root)
    assert make_data.make_data_once(cfg) is True
    made = set(file_digests(root))
    assert made == {"SYNTHETIC.txt", "train/2014.h5", "train/2015.h5", "valid/2016.h5",
                    "test/2017.h5", "stats/global_means.npy", "stats/global_stds.npy",
                    "stats/time_means.npy"}
    import shutil
    for part in ("stats", "valid", "stats/global_stds.npy"):  # a synthesis cut short, or a
        path = root / part  # part removed since: any part training reads
        shutil.rmtree(path) if path.is_dir() else path.unlink()
        caplog.clear()  # only this call's lines
        with caplog.at_level(logging.INFO):
            assert make_data.make_data_once(cfg) is True
        named = part + "/" if "." not in part else part
        assert f"Incomplete synthetic data under {root} (missing: {named}): regenerating" \
            in caplog.text
        assert "No data under" not in caplog.text
        assert set(file_digests(root)) == made and sorted(os.listdir(tmp_path)) == ["era5"]
    # the U-Net's: its validation volume too
    from settings.parse import build_config
    cosmo = build_config(os.path.join(ROOT, "config", "UNet.yaml"), "quickstart",
                         {"synthetic_size": "[16,16]", "synthesize_if_missing": "true",
                          "data_root": str(tmp_path / "cosmo")})
    assert make_data.make_data_once(cosmo) is True
    (tmp_path / "cosmo" / cosmo.val_file).unlink()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert make_data.make_data_once(cosmo) is True
    assert f"(missing: {cosmo.val_file}): regenerating" in caplog.text
    assert (tmp_path / "cosmo" / cosmo.val_file).is_file()


def test_training_keeps_the_files_a_user_added_to_synthetic_data(tmp_path):
    """A marked data_root that lacks a part but holds files the generator does not write (the
    user's notes, a year of their own) is refused by name, and nothing in it is touched."""
    from datapipe import make_data
    from settings.errors import ConfigError
    root = tmp_path / "era5"
    cfg = _vit_cfg(root)
    make_data.make_data_once(cfg)
    import shutil
    shutil.rmtree(root / "stats")
    (root / "NOTES.txt").write_text("my notes\n")
    (root / "train" / "2019.h5").write_bytes(b"a year of my own " * 50)
    before = file_digests(root)
    with pytest.raises(ConfigError) as e:
        make_data.make_data_once(cfg)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"data_root={root} holds synthetic data")
    assert "NOTES.txt, train/2019.h5" in message and "choose another --data_root" in message
    assert file_digests(root) == before and sorted(os.listdir(tmp_path)) == ["era5"]


def test_train_py_refuses_to_replace_a_user_file_in_synthetic_data(tmp_path):
    """The quickstart's ``python train.py --data_root DIR``: exit 2 and one error line."""
    root = tmp_path / "era5"
    (root / "train").mkdir(parents=True)
    (root / "SYNTHETIC.txt").write_text("synthetic\n")
    (root / "train" / "2014.h5").write_bytes(b"made before " * 50)
    (root / "NOTES.txt").write_text("my notes\n")
    before = file_digests(root)
    proc = preloaded.run([sys.executable, "train.py", "--data_root", str(root), "--expdir",
                          str(tmp_path / "logs"), "--img_size", "[16,32]",
                          "--synthetic_steps_per_year", "16", "--num_iters", "1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert_one_error_line(proc, f"error: data_root={root} holds synthetic data",
                          "also NOTES.txt,", "move them out")
    assert file_digests(root) == before


def test_a_file_added_during_synthesis_stops_the_replacement(tmp_path, monkeypatch):
    """Checked again when the new set is renamed into place: the old set goes back untouched."""
    from datapipe import make_data
    from settings.errors import ConfigError
    root = tmp_path / "era5"
    cfg = _vit_cfg(root)
    make_data.make_data_once(cfg)
    import shutil
    shutil.rmtree(root / "stats")
    real_synthesize = make_data.synthesize

    def synthesize(staging_cfg):
        real_synthesize(staging_cfg)
        (root / "NOTES.txt").write_text("written while the new set was being made\n")

    monkeypatch.setattr(make_data, "synthesize", synthesize)
    with pytest.raises(ConfigError, match="also NOTES.txt, which"):
        make_data.make_data_once(cfg)
    assert not (root / "stats").exists() and (root / "NOTES.txt").exists()
    assert sorted(os.listdir(tmp_path)) == ["era5"]  # no staging, nothing moved aside


def test_a_set_moved_aside_by_a_maker_that_died_is_put_back(tmp_path, caplog):
    """Killed between moving the old set aside and renaming the new one in: the next maker puts
    the old set back rather than removing it."""
    from datapipe import make_data
    root = tmp_path / "era5"
    cfg = _vit_cfg(root)
    make_data.make_data_once(cfg)
    before = file_digests(root)
    os.rename(root, tmp_path / "era5.old-somehost-123")
    with caplog.at_level(logging.INFO):
        assert make_data.make_data_once(cfg) is False  # whole again: nothing to make
    assert "Put back" in caplog.text and file_digests(root) == before
    assert sorted(os.listdir(tmp_path)) == ["era5"]
