"""Synthetic ERA5 and cosmology data in exactly the on-disk formats of the real data sets (the
files, the command line and where it may write: docs/data.md, "Synthetic data"; the grids and
vector axes: ``datapipe.formats``). ERA5 statistics are over the training years. Cosmology after
Harrington et al. 2021; every Hydro value lies in [-0.95, 0.95], inside the (-1, 1) range of the
network's tanh output. Both generators are deterministic for a seed, write every file under a
temporary name moved into place (``atomic_path``), and generate in slices (time steps, channels)
so that large grids fit in memory.
"""
import contextlib
import os
import re
import shlex
import sys

import h5py
import numpy as np

from datapipe.formats import ERA5_CHANNELS, HYDRO_VECTOR_CHANNELS, NBODY_VECTOR_CHANNELS, latitudes  # noqa: F401 (re-exported)
from settings.errors import ConfigError, OneLineParser, refuse

R_EARTH = 6.371e6  # m
OMEGA = 7.292e-5  # Earth's rotation rate, 1/s
R_DRY = 287.0  # gas constant of dry air, J/(kg K)
EPOCH_YEAR = 1979  # step 0 of this year is absolute step 0 of every trajectory
YEARS = {"train": (2014, 2015), "valid": (2016,), "test": (2017,)}  # make_era5's default years

# ERA5 anomaly model (see _Era5Model): bands, zonal spectrum, vertical structure.
_BAND_LATS = np.arange(-80.0, 81.0, 10.0)  # centres of the latitude bands, degrees
_BAND_WIDTH = 14.0  # Gaussian e-folding half-width of a band, degrees
_M_MAX = 20  # largest zonal wavenumber (wavelength 18 degrees of longitude)
_ENV_AMP = 0.3  # relative amplitude of the slow growth/decay of each wave
_CORIOLIS_FLOOR = 0.25  # sin(latitude) below which the geostrophic factor is tapered to 0
# level: (amplitude of the dynamical anomaly psi, of the thermal anomaly tau [m^2/s^2],
#         e-folding zonal wavenumber of the level's smoothing)
_LEVELS = {1000: (900.0, 0.0, 12.0), 850: (1100.0, 300.0, 10.0),
           500: (2200.0, 1000.0, 8.0), 50: (3500.0, 1500.0, 3.0)}
_MOIST_SMOOTH = {850: 10.0, 500: 6.0}  # e-folding zonal wavenumber of the moisture tracer

# cosmology
_CELL_MPC = 1.0  # voxel size, Mpc/h
_SIGMA_DELTA = 1.5  # rms of the Gaussian (linear) density contrast on the grid
_BBKS_SHAPE = 0.2  # shape parameter Gamma of the BBKS transfer function, h/Mpc
_N_S = 0.965  # primordial spectral index
_FAH = 50.0  # growth rate times a*H, km/s per Mpc/h: v(k) = i f a H delta(k) k / k^2
_VEL_SCALE = 250.0  # km/s per unit of a velocity channel
_NBODY_LOG_SCALE = 4.0  # Nbody channel 0 = ln(rho_m / mean) / 4
_GAS_LOG_SCALE = 14.0  # Hydro channel 0 = ln(rho_gas / mean) / 14: exp(14 x) is the overdensity
_JEANS_MPC = 1.5  # Gaussian (pressure) smoothing of the gas density and velocity, Mpc/h
_GAS_BIAS = 1.4  # rho_gas ~ (smoothed rho_m)^1.4
_GAS_GAMMA = 1.6  # T ~ rho_gas^(gamma - 1)
_TEMP_LOG_SCALE = 2.0  # Hydro channel 1 = 0.95 tanh(ln(T / T0) / 2)
_HYDRO_MAX = 0.95


@contextlib.contextmanager
def atomic_path(path):
    """Yield a temporary path next to ``path``; move it onto ``path`` only if the block succeeds."""
    directory, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# ------------------------------------------------------------------ where synthetic data may go

SYNTHETIC_MARK = "SYNTHETIC.txt"  # in a directory of synthetic data: it may be written again
_WRITTEN_BY = "Synthetic data written by "  # the mark's first line: then what wrote the data
CLI_MARK = ("{command}\nIt may be written again here (with files of other shapes only with "
            "--replace), and a training run with synthesize_if_missing may regenerate it.")
RUN_MARK = "a training run (synthesize_if_missing)\nIt may be regenerated here."


def write_mark(out_dir, text):
    """Mark ``out_dir`` as synthetic data written by ``text`` (its first line: what wrote it),
    before any data is written there: a writer that stops part-way leaves a directory that may
    be written again."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, SYNTHETIC_MARK), "w") as f:
        f.write(_WRITTEN_BY + text.rstrip("\n") + "\n")


def made_by(out_dir) -> str | None:
    """What wrote the synthetic data in ``out_dir``, as its mark says (None: not marked)."""
    try:
        with open(os.path.join(out_dir, SYNTHETIC_MARK)) as f:
            first = f.readline().strip()
    except OSError:
        return None
    # marks written before the writer's command was recorded: "<writer>; it may ..."
    return first.removeprefix(_WRITTEN_BY).split("; it may")[0] or "an unnamed writer"


def list_files(root):
    """Every entry under ``root`` that is not a directory (a link to one included), as sorted
    paths relative to ``root``. Directories are left out: an empty one holds no data."""
    found = []
    for here, dirs, files in os.walk(root):
        links = [d for d in dirs if os.path.islink(os.path.join(here, d))]  # not walked into
        for name in files + links:
            found.append(os.path.relpath(os.path.join(here, name), root))
    return sorted(found)


def check_target(out_dir, files, name, option, unmarked):
    """Refuse (ConfigError) to write synthetic data into ``out_dir`` unless it is new, empty, or
    marked (``SYNTHETIC_MARK``) and holds only ``files`` (docs/data.md, "Synthetic data"):
    ``name`` names it, ``option`` chooses another, ``unmarked`` refuses files without a mark."""
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"{name} is a file, not a directory: choose a directory")
    if not os.path.isdir(out_dir) or not os.listdir(out_dir):
        return
    if not os.path.isfile(os.path.join(out_dir, SYNTHETIC_MARK)):
        raise ConfigError(unmarked)
    ours = {os.path.normpath(f) for f in files} | {SYNTHETIC_MARK}
    extra = [f for f in list_files(out_dir) if f not in ours]
    if extra:
        shown = ", ".join(extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        raise ConfigError(f"{name} holds synthetic data ({SYNTHETIC_MARK}) but also {shown}, "
                          f"which this synthesis does not write (it writes anew only where "
                          f"nothing else is): move them out, or choose another {option}")


def _stored_shapes(path) -> dict | None:
    """{dataset: shape} of an HDF5 file, {None: shape} of a .npy array; None if unreadable."""
    try:
        if path.endswith(".npy"):
            return {None: np.load(path, mmap_mode="r").shape}
        with h5py.File(path, "r") as f:
            return {name: f[name].shape for name in f}
    except Exception:  # noqa: BLE001 - whatever is not the array it should be differs from it
        return None


def _shapes_text(shapes) -> str:
    return "  ".join(f"{name} {tuple(shape)}" if name else str(tuple(shape))
                     for name, shape in shapes.items())


# ----------------------------------------------------------------------------------------- ERA5

def era5_zonal_speed(lat_deg):
    """Eastward drift of the anomalies, degrees of longitude per 6-hour step, at ``lat_deg``: a
    jet peaking at 45 degrees (16 degrees/step) over a 6 degrees/step background."""
    lat = np.abs(np.asarray(lat_deg, dtype=np.float64))
    return 6.0 + 10.0 * np.exp(-((lat - 45.0) / 30.0) ** 2)


def era5_geostrophic_factor(lat_deg):
    """K (seconds), for 1/f in u = -K/R dz/dphi, v = K/(R cos phi) dz/dlambda: K = sin(phi) /
    (2 Omega (sin^2 phi + 0.25^2)) is 1/f away from the tropics and goes smoothly through 0."""
    s = np.sin(np.deg2rad(np.asarray(lat_deg, dtype=np.float64)))
    return s / (2.0 * OMEGA * (s * s + _CORIOLIS_FLOOR ** 2))


def _zonal_mean_state(phi, season):
    """Zonal-mean geopotential of 1000, 850, 500, 50 hPa (m^2/s^2): (T, 4, H) for phi (H,) in
    radians and season (T,) in [-1, 1] (+1 at northern midsummer), built upwards with the
    hypsometric equation from subtropical highs and subpolar lows at 1000 hPa."""
    s = season[:, None]
    sin = np.sin(phi)[None, :]
    alat = np.abs(np.rad2deg(phi))[None, :]
    z1000 = 800.0 + 900.0 * np.exp(-((alat - 30.0) / 13.0) ** 2) \
        - 1100.0 * np.exp(-((alat - 62.0) / 11.0) ** 2)
    t_layer = 282.0 - 40.0 * sin ** 2 + 8.0 * s * sin
    t_strat = 218.0 - 12.0 * sin ** 2 + 18.0 * s * sin
    z850 = z1000 + R_DRY * np.log(1000.0 / 850.0) * (t_layer + 13.0)
    z500 = z1000 + R_DRY * np.log(2.0) * t_layer
    z50 = z500 + R_DRY * np.log(10.0) * t_strat
    return np.stack(np.broadcast_arrays(z1000, z850, z500, z50), axis=1)


class _Era5Model:
    """A seeded atmosphere in closed form: ``fields(t)`` evaluates any steps of the trajectory.

    Three latent anomalies (psi dynamical, tau thermal, q a moisture tracer) are each a sum over
    17 latitude bands and zonal wavenumbers m <= 20:
    core(phi, lambda, t) = sum_n B_n(phi) Re sum_m a_nm env_nm(t) exp(i m (lambda - c_n t)).
    Each band drifts at its own jet speed c_n: a per-row shift would shear the field into ever
    finer filaments, a per-band one cannot. Time t counts 6-hour steps from EPOCH_YEAR, so each
    year file continues the previous one; the seasonal cycle spans a year file, the diurnal one 4
    steps. The coefficients are drawn for the full spectrum before the grid is known: one seed
    gives the same physical fields at every resolution.
    """

    def __init__(self, img_size, steps_per_year, seed):
        h, w = img_size
        self.w = w
        self.steps_per_year = steps_per_year
        self.lat = latitudes(h)  # (H,) degrees, north to south
        self.lon = 360.0 * np.arange(w) / w  # (W,) degrees
        self.phi = np.deg2rad(self.lat)
        rng = np.random.default_rng(np.random.SeedSequence([seed, 0xE5A5]))

        m_all = np.arange(1, _M_MAX + 1)
        amp = (1.0 + (m_all / 5.0) ** 2) ** -0.75
        amp /= np.sqrt(np.sum(amp ** 2))
        band_w = 0.35 + 0.65 * np.exp(-((np.abs(_BAND_LATS) - 45.0) / 20.0) ** 2)
        band_w /= np.sqrt(np.sum((band_w * np.exp(-((45.0 - _BAND_LATS) / _BAND_WIDTH) ** 2)) ** 2))
        shape = (3, _BAND_LATS.size, _M_MAX)  # (psi/tau/q, band, m)
        coef = rng.standard_normal(shape) + 1j * rng.standard_normal(shape)
        coef *= band_w[:, None] * amp  # unit variance of a latent anomaly at 45 degrees
        env_period = 4.0 * rng.uniform(25.0, 150.0, shape)  # steps
        env_phase = rng.uniform(0.0, 2.0 * np.pi, shape)
        speed = np.deg2rad(era5_zonal_speed(_BAND_LATS))  # (N,) rad/step

        self.m = m_all[: min(_M_MAX, (w - 1) // 2)]  # resolved wavenumbers, m < W/2
        nm = self.m.size
        self.coef = coef[..., :nm]
        self.env_freq = 2.0 * np.pi / env_period[..., :nm]
        self.env_phase = env_phase[..., :nm]
        self.omega = -self.m[None, :] * speed[:, None]  # (N, M) phase change per step
        d = (self.lat[:, None] - _BAND_LATS[None, :]) / _BAND_WIDTH
        self.band = np.exp(-d ** 2)  # (H, N)
        self.dband = -2.0 * d / np.deg2rad(_BAND_WIDTH) * self.band  # d/dphi, per radian

        # orography: 8 seeded Gaussian mountain ranges on the sphere, up to ~3.5 km
        clat = np.deg2rad(rng.uniform(-60.0, 70.0, 8))
        clon = np.deg2rad(rng.uniform(0.0, 360.0, 8))
        radius = np.deg2rad(rng.uniform(6.0, 18.0, 8))
        height = rng.uniform(500.0, 3500.0, 8)
        lon = np.deg2rad(self.lon)
        lat3 = self.phi[:, None, None]
        cosd = (np.sin(lat3) * np.sin(clat)
                + np.cos(lat3) * np.cos(clat) * np.cos(lon[None, :, None] - clon))
        dist = np.arccos(np.clip(cosd, -1.0, 1.0))  # (H, W, 8) great-circle distance
        self.orography = np.sum(height * np.exp(-0.5 * (dist / radius) ** 2), axis=-1)  # m
        self.dp_orography = 101325.0 * (1.0 - np.exp(-self.orography / 8400.0))  # Pa

    def _grid(self, coef):
        """(..., H, M) complex coefficients -> (..., H, W) real field Re sum_m c_m exp(i m lon)."""
        spec = np.zeros(coef.shape[:-1] + (self.w // 2 + 1,), dtype=np.complex128)
        spec[..., 1:self.m.size + 1] = coef * (self.w / 2.0)
        return np.fft.irfft(spec, n=self.w, axis=-1)

    def fields(self, t):
        """Absolute steps t (T,) -> (T, 20, H, W) float32 in ERA5_CHANNELS order."""
        t = np.asarray(t, dtype=np.float64)
        season = np.sin(2.0 * np.pi * (t / self.steps_per_year - 80.0 / 365.0))  # (T,)
        tt = t[:, None, None, None]
        a = self.coef * (1.0 + _ENV_AMP * np.sin(self.env_freq * tt + self.env_phase)) \
            * np.exp(1j * self.omega * tt)  # (T, 3, N, M)
        rows = np.einsum("jn,tfnm->tfjm", self.band, a)  # (T, 3, H, M)
        drows = np.einsum("jn,tfnm->tfjm", self.dband, a)  # d/dphi of the above

        sin, cos = np.sin(self.phi)[:, None], np.cos(self.phi)[:, None]  # (H, 1)
        sw = season[:, None, None]
        storm = 1.0 - 0.25 * sw * sin  # (T, H, 1): stronger anomalies in the winter hemisphere
        weight = storm * cos  # cos(phi): single-valued at the poles
        dweight = -storm * sin - 0.25 * sw * cos ** 2  # d(weight)/dphi
        eps = 1e-6
        zbar = _zonal_mean_state(self.phi, season)  # (T, 4, H)
        dzbar = (_zonal_mean_state(self.phi + eps, season)
                 - _zonal_mean_state(self.phi - eps, season)) / (2.0 * eps)
        k_geo = era5_geostrophic_factor(self.lat)[:, None] / R_EARTH  # (H, 1)

        z, u, v = {}, {}, {}
        for i, (level, (a_psi, a_tau, m_smooth)) in enumerate(_LEVELS.items()):
            filt = np.exp(-0.5 * (self.m / m_smooth) ** 2)
            lev = filt * (a_psi * rows[:, 0] + a_tau * rows[:, 1])  # (T, H, M)
            core = self._grid(lev)
            z[level] = zbar[:, i, :, None] + weight * core
            if level == 50:
                continue
            dlev = filt * (a_psi * drows[:, 0] + a_tau * drows[:, 1])
            dz_dphi = dzbar[:, i, :, None] + dweight * core + weight * self._grid(dlev)
            u[level] = -k_geo * dz_dphi
            # v = K/(R cos phi) dz/dlambda; the cos(phi) of the taper cancels: no pole singularity
            v[level] = k_geo * storm * self._grid(1j * self.m * lev)

        t_layer = (z[500] - z[1000]) / (R_DRY * np.log(2.0))  # hypsometric 1000-500 hPa mean
        t850, t500 = t_layer + 9.0, t_layer - 15.0  # lapse-rate offsets from the layer mean
        t_layer_bar = (zbar[:, 2] - zbar[:, 0])[:, :, None] / (R_DRY * np.log(2.0))
        day = (t % 4.0)[:, None, None] / 4.0 + self.lon / 360.0  # local solar time / 24 h
        # 6.5 K/km from 850 hPa (~1.5 km) down to the surface, whose height is the orography;
        # the diurnal cycle peaks at 15 local time, the surface-pressure tide at 10
        t2m = t850 + 9.75 - 0.0065 * self.orography + 3.0 * cos * np.cos(2 * np.pi * (day - 0.625))
        msl = 1.0e5 + 1.225 * z[1000] + 80.0 * cos * np.cos(2 * np.pi * (day - 0.42))
        sp = msl - self.dp_orography

        alat = np.abs(self.lat)[:, None]
        moist_bias = 0.9 * np.exp(-(alat / 12.0) ** 2) - 0.9 * np.exp(-((alat - 25.0) / 10.0) ** 2)
        t_anom = t_layer - t_layer_bar  # temperature departure from the zonal mean
        rh = {}
        for level, offset in ((850, 0.8), (500, 0.0)):
            q = cos * self._grid(np.exp(-0.5 * (self.m / _MOIST_SMOOTH[level]) ** 2) * rows[:, 2])
            # warmer air at the same vapour content is further from saturation (~7 %/K)
            rh[level] = 100.0 / (1.0 + np.exp(-(offset + moist_bias + q - 0.07 * t_anom)))
        tc = t850 - 273.15  # saturation vapour pressure (hPa, Magnus): Clausius-Clapeyron scaling
        tcwv = 3.0 * rh[850] / 100.0 * (6.112 * np.exp(17.67 * tc / (tc + 243.5)))  # kg/m^2

        out = {"u10m": 0.7 * u[1000], "v10m": 0.7 * v[1000], "t2m": t2m, "sp": sp, "msl": msl,
               "t850": t850, "u1000": u[1000], "v1000": v[1000], "z1000": z[1000],
               "u850": u[850], "v850": v[850], "z850": z[850], "u500": u[500], "v500": v[500],
               "z500": z[500], "t500": t500, "z50": z[50], "r500": rh[500], "r850": rh[850],
               "tcwv": tcwv}
        return np.stack([out[c] for c in ERA5_CHANNELS], axis=1).astype(np.float32)


def _era5_chunk(h, w):
    """Steps evaluated at a time: ~2 MB per field per slice, so large grids fit in memory."""
    return max(1, 2 ** 18 // (h * w))


def era5_fields(steps, img_size, steps_per_year, seed=0):
    """The fields at absolute 6-hourly steps ``steps`` of this seed's trajectory, in memory:
    (T, 20, H, W) float32, the values make_era5 stores for those steps (step t of year Y's file
    is absolute step (Y - EPOCH_YEAR) * steps_per_year + t)."""
    h, w = (int(v) for v in img_size)
    model = _Era5Model((h, w), int(steps_per_year), seed)
    steps = np.asarray(steps, dtype=np.int64)
    chunk = _era5_chunk(h, w)
    out = np.empty((steps.size, len(ERA5_CHANNELS), h, w), np.float32)
    for start in range(0, steps.size, chunk):
        out[start:start + chunk] = model.fields(steps[start:start + chunk])
    return out


def era5_plan(img_size=(32, 64), steps_per_year=256, train_years=YEARS["train"],
              valid_years=YEARS["valid"], test_years=YEARS["test"]):
    """What make_era5 writes: {path relative to its ``out_dir``: {dataset: shape}} (None: the
    array of a .npy file)."""
    h, w, nc = int(img_size[0]), int(img_size[1]), len(ERA5_CHANNELS)
    splits = {"train": train_years, "valid": valid_years, "test": test_years}
    plan = {os.path.join(split, f"{int(y)}.h5"): {"fields": (int(steps_per_year), nc, h, w)}
            for split, years in splits.items() for y in years}
    for name, shape in (("global_means", (1, nc, 1, 1)), ("global_stds", (1, nc, 1, 1)),
                        ("time_means", (1, nc, h, w))):
        plan[os.path.join("stats", f"{name}.npy")] = {None: shape}
    return plan


def make_era5(out_dir, img_size=(32, 64), steps_per_year=256, train_years=YEARS["train"],
              valid_years=YEARS["valid"], test_years=YEARS["test"], seed=0, mark=None):
    """Write synthetic ERA5 year files (``steps_per_year`` 6-hourly steps of one trajectory per
    seed, years continuing each other) and the population mean/std over (time, lat, lon) of the
    stored training values under ``out_dir``; ``mark``: what writes them (``write_mark``, once
    the arguments are checked; None: no mark). Returns {"train"/"valid"/"test": [year file
    paths], "global_means"/"global_stds"/"time_means": stats paths}."""
    h, w = (int(v) for v in img_size)
    steps_per_year = int(steps_per_year)
    if h < 2 or w < 4:
        raise ValueError(f"img_size must be at least (2, 4) (rows include both poles), got {h} {w}")
    if steps_per_year < 2:
        raise ValueError(f"steps_per_year must be at least 2, got {steps_per_year}")
    splits = {"train": [int(y) for y in train_years], "valid": [int(y) for y in valid_years],
              "test": [int(y) for y in test_years]}
    if not splits["train"]:
        raise ValueError("train_years is empty: the statistics come from the training years")
    years = [y for ys in splits.values() for y in ys]
    repeated = sorted({y for y in years if years.count(y) > 1})
    if repeated:
        raise ValueError(f"years {repeated} appear more than once across train/valid/test")
    if mark is not None:
        write_mark(out_dir, mark)

    model = _Era5Model((h, w), steps_per_year, seed)
    nc = len(ERA5_CHANNELS)
    chunk = min(steps_per_year, _era5_chunk(h, w))
    ref, s1, s2, time_sum, count = None, np.zeros(nc), np.zeros(nc), np.zeros((nc, h, w)), 0
    result = {}
    for split, split_years in splits.items():
        os.makedirs(os.path.join(out_dir, split), exist_ok=True)
        result[split] = []
        for year in split_years:
            path = os.path.join(out_dir, split, f"{year}.h5")
            t0 = (year - EPOCH_YEAR) * steps_per_year
            with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
                dset = f.create_dataset("fields", (steps_per_year, nc, h, w), dtype=np.float32)
                for start in range(0, steps_per_year, chunk):
                    stop = min(start + chunk, steps_per_year)
                    x = model.fields(np.arange(t0 + start, t0 + stop))
                    dset[start:stop] = x
                    if split == "train":  # statistics of the stored float32 values
                        x = x.astype(np.float64)
                        if ref is None:  # shift by a first estimate to avoid cancellation
                            ref = x.mean(axis=(0, 2, 3))
                        d = x - ref[:, None, None]
                        s1 += d.sum(axis=(0, 2, 3))
                        s2 += (d * d).sum(axis=(0, 2, 3))
                        time_sum += x.sum(axis=0)
                        count += stop - start
            result[split].append(path)

    n = count * h * w
    mean = ref + s1 / n
    std = np.sqrt(np.maximum(s2 / n - (s1 / n) ** 2, 0.0))
    stats = {"global_means": mean.reshape(1, nc, 1, 1), "global_stds": std.reshape(1, nc, 1, 1),
             "time_means": (time_sum / count)[None]}
    os.makedirs(os.path.join(out_dir, "stats"), exist_ok=True)
    for name, array in stats.items():
        result[name] = os.path.join(out_dir, "stats", f"{name}.npy")
        with atomic_path(result[name]) as tmp, open(tmp, "wb") as f:
            np.save(f, array.astype(np.float32))
    return result


# ------------------------------------------------------------------------------------ cosmology

def _bbks_power(k):
    """Linear matter power spectrum shape k^n_s T(k)^2 (BBKS transfer function), k in h/Mpc."""
    q = np.maximum(k, 1e-12) / _BBKS_SHAPE
    transfer = np.log1p(2.34 * q) / (2.34 * q) * (
        1.0 + 3.89 * q + (16.1 * q) ** 2 + (5.46 * q) ** 3 + (6.71 * q) ** 4) ** -0.25
    return np.where(k > 0.0, k ** _N_S * transfer ** 2, 0.0)


def _cosmo_fields(size, rng):
    """One periodic box of side ``size`` voxels, field by field: yields (dataset, channel,
    (L, L, L) array) for Nbody (4 channels) and Hydro (5), so a large box never needs all its
    fields in memory at once.

    delta: Gaussian random field with the BBKS spectrum, rms _SIGMA_DELTA on the grid.
    Matter: lognormal rho_m / mean = exp(delta - sigma^2 / 2); velocity from linear theory,
    v(k) = i f a H delta(k) k / k^2, which is curl-free and obeys div v = -f a H delta.
    Gas: density (G_1.5 * rho_m)^1.4 (pressure smoothing, bias), temperature T0 rho_gas^0.6,
    velocity G_1.5 * v_m, with G_R a Gaussian filter of radius R Mpc/h applied in k-space.
    """
    shape = (size,) * 3
    kx = 2.0 * np.pi * np.fft.fftfreq(size, d=_CELL_MPC).astype(np.float32)[:, None, None]
    ky = kx.reshape(1, size, 1)
    kz = 2.0 * np.pi * np.fft.rfftfreq(size, d=_CELL_MPC).astype(np.float32)[None, None, :]
    k2 = kx ** 2 + ky ** 2 + kz ** 2  # (L, L, L//2+1) h^2/Mpc^2
    power = _bbks_power(np.sqrt(k2, dtype=np.float64))
    # expected grid variance of the field: mean of P over the full (Hermitian) k-grid
    half = np.full(kz.shape[-1], 2.0)
    half[0] = 1.0
    if size % 2 == 0:
        half[-1] = 1.0
    norm = _SIGMA_DELTA / np.sqrt(np.sum(power * half) / size ** 3)
    delta_k = np.fft.rfftn(rng.standard_normal(shape, dtype=np.float32))
    delta_k *= (norm * np.sqrt(power)).astype(np.float32)  # (L, L, L//2+1) complex64
    del power

    def smooth(field_k, radius):
        return np.fft.irfftn(field_k * np.exp(-0.5 * k2 * radius ** 2), s=shape, axes=(0, 1, 2))

    # ln(rho_m / mean) of the lognormal density
    log_rho = np.fft.irfftn(delta_k, s=shape, axes=(0, 1, 2)) - 0.5 * _SIGMA_DELTA ** 2
    yield "Nbody", 0, log_rho / _NBODY_LOG_SCALE
    # the k-space Gaussian can ring slightly below 0 next to voids; keep the density positive
    rho_s = np.maximum(smooth(np.fft.rfftn(np.exp(log_rho)), _JEANS_MPC), 1e-6)
    del log_rho
    log_gas = _GAS_BIAS * np.log(rho_s)
    del rho_s
    log_gas -= np.log(np.mean(np.exp(log_gas, dtype=np.float64)))  # ln(rho_gas / mean)
    yield "Hydro", 0, np.clip(log_gas / _GAS_LOG_SCALE, -_HYDRO_MAX, _HYDRO_MAX)
    yield "Hydro", 1, _HYDRO_MAX * np.tanh((_GAS_GAMMA - 1.0) * log_gas / _TEMP_LOG_SCALE)
    del log_gas
    k2_safe = np.where(k2 > 0.0, k2, np.float32(1.0))
    for axis, k in enumerate((kx, ky, kz)):
        k = np.where(np.abs(k) < (1.0 - 1.5 / size) * np.pi / _CELL_MPC, k, 0.0)  # 0 at Nyquist
        v_k = (1j * _FAH / _VEL_SCALE) * delta_k * (k / k2_safe)  # velocity channel, k-space
        yield "Nbody", 1 + axis, np.fft.irfftn(v_k, s=shape, axes=(0, 1, 2))
        yield "Hydro", 2 + axis, _HYDRO_MAX * np.tanh(smooth(v_k, _JEANS_MPC))


_COSMO_CHANNELS = {"Nbody": 4, "Hydro": 5}
_COSMO_STREAMS = {"train": 1, "valid": 2}  # one random stream per box of a seed


def _cosmo_rng(seed, split):
    return np.random.default_rng(np.random.SeedSequence([seed, 0xC05, _COSMO_STREAMS[split]]))


def cosmo_box(size, seed=0, split="train"):
    """The box of ``split`` ("train" or "valid") that make_cosmo writes for this seed and size, in
    memory: (Nbody (4, L, L, L), Hydro (5, L, L, L)) float32."""
    arrays = {name: np.empty((n,) + (size,) * 3, np.float32) for name, n in _COSMO_CHANNELS.items()}
    for name, channel, field in _cosmo_fields(int(size), _cosmo_rng(seed, split)):
        arrays[name][channel] = field
    return arrays["Nbody"], arrays["Hydro"]


def cosmo_plan(train_size=64, val_size=64, train_name="train.h5", val_name="valid.h5"):
    """What make_cosmo writes, as ``era5_plan`` says it."""
    return {name: {dataset: (n,) + (int(size),) * 3 for dataset, n in _COSMO_CHANNELS.items()}
            for name, size in ((train_name, train_size), (val_name, val_size))}


def make_cosmo(out_dir, train_size=64, val_size=64, seed=0, train_name="train.h5",
               val_name="valid.h5", mark=None):
    """Write independent training and validation boxes (N-body inputs, hydro targets); ``mark``:
    as make_era5's. Returns {"train": path, "valid": path}."""
    for name, size in (("train_size", train_size), ("val_size", val_size)):
        if int(size) < 8:
            raise ValueError(f"{name} must be at least 8 voxels, got {size}")
    os.makedirs(out_dir, exist_ok=True)
    if mark is not None:
        write_mark(out_dir, mark)
    result = {}
    for split, size, name in (("train", train_size, train_name), ("valid", val_size, val_name)):
        result[split] = os.path.join(out_dir, name)
        with atomic_path(result[split]) as tmp, h5py.File(tmp, "w") as f:
            datasets = {dataset: f.create_dataset(dataset, shape, dtype=np.float32)
                        for dataset, shape in cosmo_plan(size)["train.h5"].items()}
            for dataset, channel, field in _cosmo_fields(int(size), _cosmo_rng(seed, split)):
                datasets[dataset][channel] = field
    return result


# ------------------------------------------------------------------------------------------ CLI

def int_list(parser, name: str, values: list[str], length: int | None = None,
             example: str = "32 64") -> list[int]:
    """A list option given as ``352 720`` (argparse's way), ``'[352,720]'`` or ``352,720`` (the
    way train.py's list settings are written): its integers; a wrong one is parser.error's
    one line, naming ``example`` written both ways."""
    tokens = [t for t in re.split(r"[\s,\[\]]+", " ".join(values)) if t]
    ways = f"e.g. --{name} {example} or --{name} '[{example.replace(' ', ',')}]'"
    try:
        out = [int(t) for t in tokens]
    except ValueError:
        parser.error(f"--{name} {' '.join(values)}: give whole numbers, {ways}")
    if length is not None and len(out) != length:
        parser.error(f"--{name} {' '.join(values)}: give {length} numbers, {ways}")
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = OneLineParser(prog="python -m datapipe.synthetic", description=__doc__.split("\n")[0])
    common = OneLineParser(add_help=False)
    common.add_argument("--out", required=True, help="directory to write the files into")
    common.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    common.add_argument("--replace", action="store_true",
                        help="write over synthetic data of other shapes in --out (refused "
                        "without it: another data set, which a run may use)")
    sub = parser.add_subparsers(dest="kind", required=True, metavar="{era5,cosmo}")
    era5 = sub.add_parser("era5", parents=[common],
                          help="ERA5-format year files and statistics for the ViT")
    lists = " (a list: 1 2 3, '[1,2,3]' or 1,2,3)"
    era5.add_argument("--img_size", nargs="+", default=["32", "64"], metavar="H W",
                      help="latitude x longitude grid, e.g. 32 64 or '[32,64]' (default: 32 64)")
    era5.add_argument("--steps_per_year", type=int, default=256,
                      help="time steps in each year file (default: %(default)s)")
    for split, years in YEARS.items():
        era5.add_argument(f"--{split}_years", nargs="+" if split == "train" else "*",
                          default=[str(y) for y in years],
                          help=f"years written under {split}/{lists} (default: "
                          f"{' '.join(map(str, years))})")
    cosmo = sub.add_parser("cosmo", parents=[common], help="N-body / hydro boxes for the 3D U-Net")
    for split, box in (("train", "training"), ("val", "validation")):
        cosmo.add_argument(f"--{split}_size", type=int, default=64,
                           help=f"side in voxels of the {box} box (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.kind == "era5":
        shapes = dict(img_size=tuple(int_list(era5, "img_size", args.img_size, length=2)),
                      steps_per_year=args.steps_per_year)
        shapes.update({name: int_list(era5, name, getattr(args, name))
                       for name in ("train_years", "valid_years", "test_years")})
        plan, make = era5_plan(**shapes), make_era5
    else:
        shapes = dict(train_size=args.train_size, val_size=args.val_size)
        plan, make = cosmo_plan(**shapes), make_cosmo
    out = f"--out {args.out}"
    mark = CLI_MARK.format(command=shlex.join(["python", "-m", "datapipe.synthetic", *argv]))
    try:
        # Never over a user's files: only where this command (or a training run) wrote before,
        # and over another synthetic set (other shapes) only when asked to.
        check_target(args.out, plan, out, "--out",
                     f"{out} holds files but no {SYNTHETIC_MARK}, the mark of synthetic data "
                     f"written there before; synthetic data is written only into a new or empty "
                     f"directory, or over earlier synthetic data: choose another --out")
        for rel, planned in plan.items():
            path = os.path.join(args.out, rel)
            if (not args.replace and os.path.lexists(path)
                    and (found := _stored_shapes(path)) != planned):
                raise ConfigError(f"{out} holds synthetic data of other shapes than this command "
                                  f"writes ({rel}: {_shapes_text(found) if found else 'unreadable'}"
                                  f", not {_shapes_text(planned)}): add --replace to write over "
                                  f"it, or choose another --out")
        make(args.out, seed=args.seed, mark=mark, **shapes)
    except ValueError as e:  # ConfigError included
        refuse(str(e))
    except OSError as e:
        where = f": {e.filename}" if e.filename else ""
        refuse(f"{out}: cannot write there ({e.strerror or e}{where}): choose a directory you "
                f"can write to, with free space")
    for rel, planned in plan.items():
        path = os.path.join(args.out, rel)
        print(f"{path}  {_shapes_text(planned)} float32  {os.path.getsize(path):,} bytes")


if __name__ == "__main__":
    main()
