"""Convert ERA5 from a WeatherBench 2 / ARCO-ERA5 zarr store or NetCDF files to the tutorial's files.

The layout written is docs/data.md's; the sources are read through xarray. The command, the channel
table, what is refused and how an interrupted conversion goes on: docs/convert_era5.md.
"""
import collections
import contextlib
import fnmatch
import functools
import glob
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from types import SimpleNamespace

import h5py
import numpy as np

from datapipe.formats import ERA5_CHANNELS
from datapipe.synthetic import atomic_path, int_list, list_files
from settings.errors import ConfigError, OneLineParser, at_least, refuse

# The tutorial's channels, in its order, as (variable, pressure level in hPa or None) in WeatherBench
# 2's names: the surface ones by name, the upper-air ones by letter and level (z500: geopotential, 500).
SURFACE = {"u10m": "10m_u_component_of_wind", "v10m": "10m_v_component_of_wind", "t2m": "2m_temperature",
           "sp": "surface_pressure", "msl": "mean_sea_level_pressure", "tcwv": "total_column_water_vapour"}
UPPER_AIR = {"u": "u_component_of_wind", "v": "v_component_of_wind", "z": "geopotential", "t": "temperature",
             "r": "relative_humidity"}
CHANNELS = {c: (SURFACE[c], None) if c in SURFACE else (UPPER_AIR[c[0]], int(c[1:])) for c in ERA5_CHANNELS}
# Other common spellings of the dimensions (the CDS's NetCDF files, CF short names).
RENAMES = {"valid_time": "time", "pressure_level": "level", "lat": "latitude", "lon": "longitude"}
MARK = "CONVERTED.txt"  # in a folder this command writes: it may write there again
STATS = ("global_means", "global_stds", "time_means")
CHUNK_BYTES = 128 << 20  # float32 values of one read and write of a year


def open_source(source: str):
    """The xarray Dataset of a zarr store (a path or an fsspec URL) or of a folder of .nc files,
    read lazily through dask."""
    try:
        import xarray as xr
    except ImportError:
        raise ConfigError("reading a zarr store or NetCDF files needs xarray: pip install -r "
                          "requirements-era5.txt") from None
    netcdf = sorted(glob.glob(os.path.join(source, "*.nc"))) if os.path.isdir(source) else []
    if "://" not in source and not os.path.exists(source):
        raise ConfigError(f"SOURCE {source} not found: give a zarr store or a folder of .nc files")
    try:
        ds = (xr.open_mfdataset(netcdf, combine="by_coords", chunks={}) if netcdf
              else xr.open_zarr(source, chunks={}))
    except Exception as e:  # the backends raise many kinds for what they cannot read
        raise ConfigError(f"SOURCE {source} is neither a zarr store nor a folder of .nc files "
                          f"xarray can read ({type(e).__name__}: {e})") from None
    return ds.rename({k: v for k, v in RENAMES.items() if k in ds.variables and v not in ds.variables})


def select(ds, table: dict) -> list:
    """(lazy array, its channels) per variable of ``table``, read once for its channels' levels
    in their order: (time, [level,] latitude, longitude), rows north to south. What the store
    lacks is refused, naming what it holds."""
    missing = [d for d in ("time", "latitude", "longitude") if d not in ds.dims]
    if missing:
        raise ConfigError(f"the source has no dimension {', '.join(missing)} (its dimensions: "
                          f"{', '.join(map(str, ds.dims))})")
    lat = ds["latitude"].values
    if not (np.all(np.diff(lat) > 0) or np.all(np.diff(lat) < 0)):
        raise ConfigError("the source's latitudes are not sorted: sort them before converting")
    groups = {}  # variable: [(channel index, level)]
    for c, (channel, (name, level)) in enumerate(table.items()):
        how = f"(channel {channel}; map it to another with --channel {channel}=VARIABLE[@LEVEL])"
        if name not in ds.data_vars:
            raise ConfigError(f"the source has no variable {name} {how}; its variables: "
                              f"{', '.join(sorted(map(str, ds.data_vars)))}")
        levels = [v.item() for v in ds["level"].values] if "level" in ds[name].dims else []
        if level is None and levels:
            raise ConfigError(f"{name} has levels {levels}: give one {how}")
        if level is not None and level not in levels:
            raise ConfigError(f"the source has no level {level} of {name} {how}; its levels: "
                              f"{levels or 'none (a single-level variable)'}")
        groups.setdefault(name, []).append((c, level))
    arrays = []
    for name, members in groups.items():
        da = ds[name] if members[0][1] is None else ds[name].sel(level=[lv for _, lv in members])
        extra = [d for d in da.dims if d not in ("time", "level", "latitude", "longitude")]
        if extra:
            raise ConfigError(f"{name} has dimensions {extra} beyond time, level, latitude and "
                              f"longitude: select one of each before converting")
        da = da.transpose("time", ..., "latitude", "longitude")
        da = da.isel(latitude=slice(None, None, -1)) if lat[0] < lat[-1] else da
        arrays.append((da, [c for c, _ in members]))
    return arrays


def year_steps(ds, year: int) -> np.ndarray:
    """Positions in the source's time axis of ``year``'s steps at 00, 06, 12 and 18 UTC (finer
    steps are left out); times coarser than six-hourly or with gaps are refused."""
    times = ds["time"].values
    seconds = (times - times.astype("datetime64[D]")).astype("timedelta64[s]").astype(np.int64)
    pos = np.flatnonzero((times.astype("datetime64[Y]").astype(int) + 1970 == year)
                         & (seconds % (6 * 3600) == 0))
    if len(pos) < 2:
        raise ConfigError(f"the source holds {len(pos)} six-hourly steps of {year} (its times: "
                          f"{' to '.join(np.datetime_as_string(times[[0, -1]], 'm'))}): choose years it holds")
    gaps = np.flatnonzero(np.diff(times[pos]) != np.timedelta64(6, "h"))
    if len(gaps):
        a, b = np.datetime_as_string(times[pos[gaps[0]:gaps[0] + 2]], "m")
        raise ConfigError(f"the times of {year} are not six-hourly: {a} is followed by {b}; the "
                          f"tutorial's files hold six-hourly steps: give hourly or six-hourly data")
    return pos


def moments(chunks):
    """(steps, per-channel mean, per-channel sum of squared deviations, the (C, H, W) sum over
    steps), float64, of the (t, C, H, W) float32 ``chunks``; squares are taken about the first
    chunk's means, so that large offsets (geopotential, pressure) lose no precision."""
    steps, ref = 0, None
    for x in chunks:
        if ref is None:
            ref = x.mean(axis=(0, 2, 3), dtype=np.float64)
            s1, s2, total = np.zeros_like(ref), np.zeros_like(ref), np.zeros(x.shape[1:])
        for c in range(x.shape[1]):  # one channel at a time: a float64 copy of it only
            d = x[:, c].astype(np.float64) - ref[c]
            s1[c] += d.sum()
            s2[c] += np.vdot(d, d)
        for state in x:
            total += state  # in place: no float64 copy of the whole step
        steps += len(x)
    n = steps * total[0].size
    return steps, ref + s1 / n, s2 - s1 * s1 / n, total


def merge(a, b):
    """The moments of two sets of steps together (Chan, Golub and LeVeque's pairwise update)."""
    (na, ma, qa, ta), (nb, mb, qb, tb) = a, b
    n, d = na + nb, mb - ma
    return n, ma + d * nb / n, qa + qb + d * d * (na * nb / n) * ta[0].size, ta + tb


def convert_year(source, table, out_dir, split, year):
    """Write ``<out_dir>/<split>/<year>.h5`` unless it is complete; returns (progress line, the
    moments of its steps for a training year, else None)."""
    path = os.path.join(out_dir, split, f"{year}.h5")
    start, train = time.monotonic(), split == "train"
    if os.path.exists(path):  # complete: files are moved into place only once written
        if not train:
            return f"{split}/{year}.h5: complete, skipped", None
        with h5py.File(path, "r") as f:  # the statistics need its values again
            fields = f["fields"]
            step = max(1, CHUNK_BYTES // (fields.nbytes // len(fields)))
            sums = moments(fields[a:a + step] for a in range(0, len(fields), step))
        return f"{split}/{year}.h5: complete, read for the statistics", sums
    for stale in glob.glob(os.path.join(out_dir, split, f".{year}.h5.*.tmp")):
        os.remove(stale)  # left by a conversion that was stopped
    ds = open_source(source)
    arrays, pos = select(ds, table), year_steps(ds, year)
    shape = (len(pos), len(table)) + arrays[0][0].shape[-2:]
    step = max(1, CHUNK_BYTES // (4 * int(np.prod(shape[1:]))))

    def chunks(dset):
        for a in range(0, len(pos), step):
            x = np.empty((len(pos[a:a + step]),) + shape[1:], np.float32)
            for da, channels in arrays:
                values = da.isel(time=pos[a:a + step]).values
                x[:, channels] = values if values.ndim == 4 else values[:, None]
            dset[a:a + len(x)] = x
            yield x

    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        dset = f.create_dataset("fields", shape, np.float32)  # contiguous: read by offset
        sums = moments(chunks(dset)) if train else collections.deque(chunks(dset), maxlen=0)
    line = f"{split}/{year}.h5: {shape[0]} steps of {shape[2]}x{shape[3]}"
    return f"{line}, {time.monotonic() - start:.0f} s", (sums if train else None)


def convert(source, out_dir, years: dict, table=CHANNELS, workers=1, say=print):
    """Check everything, then write the years of ``years`` ({split: [year]}) and the statistics
    of the training ones; ConfigError (nothing written) for what check refuses."""
    every = [y for ys in years.values() for y in ys]
    if not years["train"]:
        raise ConfigError("--train_years is empty: the statistics come from the training years")
    if len(set(every)) < len(every):
        raise ConfigError(f"years {sorted({y for y in every if every.count(y) > 1})} appear more "
                          f"than once across train/valid/test")
    ds = open_source(source)
    select(ds, table)
    for y in every:
        year_steps(ds, y)
    jobs = [(split, y) for split, ys in years.items() for y in ys]
    stats = [os.path.join("stats", f"{name}.npy") for name in STATS]
    held = list_files(out_dir) if os.path.isdir(out_dir) else []
    if held and MARK not in held:
        raise ConfigError(f"OUT_DIR {out_dir} holds files but no {MARK}, the mark of a folder "
                          f"this command wrote: choose a new or empty folder")
    ours = {os.path.join(s, f"{y}.h5") for s, y in jobs} | set(stats) | {MARK}
    extra = [f for f in held if f not in ours and not fnmatch.fnmatch(os.path.basename(f), ".*.tmp")]
    if extra:
        raise ConfigError(f"OUT_DIR {out_dir} holds {', '.join(extra[:5])}, which this "
                          f"conversion does not write: move them out, or choose another folder")

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, MARK), "w") as f:  # before any data: it may write here again
        f.write(f"ERA5 converted from {source} by python -m datapipe.convert_era5.\n")
    if all(os.path.exists(os.path.join(out_dir, f)) for f in ours - {MARK}):
        say("every year and the statistics are complete: nothing to do")
        return
    for s in stats:  # never left beside years they were not computed from
        if os.path.exists(os.path.join(out_dir, s)):
            os.remove(os.path.join(out_dir, s))
    for split in years:
        os.makedirs(os.path.join(out_dir, split), exist_ok=True)
    sums = []
    in_process = contextlib.nullcontext(SimpleNamespace(map=map))
    with ProcessPoolExecutor(workers, multiprocessing.get_context("spawn")) if workers > 1 \
            else in_process as pool:
        for line, year_sums in pool.map(functools.partial(convert_year, source, table, out_dir), *zip(*jobs)):
            say(line)
            sums += [year_sums] if year_sums else []
    steps, mean, m2, time_sum = functools.reduce(merge, sums)
    n = steps * time_sum[0].size
    values = {"global_means": mean[None, :, None, None], "global_stds": np.sqrt(m2 / n)[None, :, None, None],
              "time_means": (time_sum / steps)[None]}
    os.makedirs(os.path.join(out_dir, "stats"), exist_ok=True)
    for name in STATS:
        with atomic_path(os.path.join(out_dir, "stats", f"{name}.npy")) as tmp, open(tmp, "wb") as f:
            np.save(f, values[name])
    say(f"stats/: means, stds and time means (float64) of {steps} steps of the training years "
        f"{', '.join(map(str, years['train']))}")


def main(argv=None):
    parser = OneLineParser(prog="python -m datapipe.convert_era5", description=__doc__.split("\n")[0])
    parser.add_argument("source", metavar="SOURCE", help="zarr store (path or URL) or folder of .nc files")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="new or empty folder, or one this wrote")
    for split in ("train", "valid", "test"):
        parser.add_argument(f"--{split}_years", nargs="+" if split == "train" else "*", metavar="YEAR",
                            required=split == "train", default=[],
                            help=f"years written under {split}/ (a list: 2016 2017 or 2016,2017)")
    parser.add_argument("--channel", action="append", default=[], metavar="NAME=VARIABLE[@LEVEL]",
                        help="take a channel from another variable or level (repeatable)")
    parser.add_argument("--workers", type=at_least(1), default=1, metavar="N",
                        help="years converted at once, each in its own process (default: 1)")
    args = parser.parse_args(argv)
    years = {s: int_list(parser, f"{s}_years", getattr(args, f"{s}_years"), example="2016 2017")
             for s in ("train", "valid", "test")}
    table = dict(CHANNELS)
    for text in args.channel:  # NAME=VARIABLE[@LEVEL]
        name, _, source = text.partition("=")
        variable, _, level = source.partition("@")
        if name not in table or not variable or (level and not level.isdigit()):
            refuse(f"--channel {text}: give NAME=VARIABLE or NAME=VARIABLE@LEVEL with NAME one of "
                   f"{', '.join(ERA5_CHANNELS)} and LEVEL in hPa")
        table[name] = (variable, int(level) if level else None)
    try:
        convert(args.source, args.out_dir, years, table, args.workers)
    except ConfigError as e:
        refuse(str(e))
    except OSError as e:
        where = f": {e.filename}" if e.filename else ""
        refuse(f"OUT_DIR {args.out_dir}: cannot write there ({e.strerror or e}{where}): choose a "
               f"folder you can write to, with free space")


if __name__ == "__main__":
    main()
