"""Peak memory of python -m datapipe.convert_era5 at ERA5's 0.25 degree grid (721 x 1440).

Writes a WeatherBench 2-layout zarr store of a short year (--steps six-hourly steps, random
values) into a temporary folder, converts it in a child process and prints the child's peak
resident memory beside what the imports alone take, the year written and one time step. Needs
requirements-era5.txt. The figure and what it is bounded against: docs/convert_era5.md.

    python benchmarks/convert_era5_memory.py --steps 16
"""
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from settings.errors import OneLineParser, at_least  # noqa: E402

SURFACE = ["10m_u_component_of_wind", "10m_v_component_of_wind", "2m_temperature",
           "surface_pressure", "mean_sea_level_pressure", "total_column_water_vapour"]
UPPER = ["u_component_of_wind", "v_component_of_wind", "geopotential", "temperature",
         "relative_humidity"]
LEVELS = [50, 500, 850, 1000]


def write_store(path, steps, h, w):
    """A zarr store in WeatherBench 2's layout, one time step per chunk, made chunk by chunk."""
    import dask.array as da
    import numpy as np
    import xarray as xr

    times = np.datetime64("2016-01-01T00", "ns") + np.arange(steps) * np.timedelta64(6, "h")
    data = {}
    for name in SURFACE + UPPER:
        upper = name in UPPER
        shape = (steps,) + ((len(LEVELS),) if upper else ()) + (h, w)
        values = da.random.random(shape, chunks=(1,) + shape[1:]).astype(np.float32)
        data[name] = (("time",) + (("level",) if upper else ()) + ("latitude", "longitude"), values)
    coords = {"time": times, "level": LEVELS, "latitude": np.linspace(-90, 90, h),
              "longitude": np.arange(w) * 360.0 / w}
    xr.Dataset(data, coords=coords).to_zarr(path, zarr_format=2)


def main(argv=None):
    parser = OneLineParser(prog="python benchmarks/convert_era5_memory.py",
                           description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=at_least(2), default=16,
                        help="six-hourly steps of the year converted (default: %(default)s)")
    parser.add_argument("--grid", type=at_least(2), nargs=2, default=[721, 1440], metavar=("H", "W"),
                        help="latitudes and longitudes (default: 721 1440, 0.25 degree)")
    parser.add_argument("--dir", default=None,
                        help="folder for the store and the output (default: a temporary one)")
    args = parser.parse_args(argv)
    (h, w), mib = args.grid, 1 << 20
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        store = os.path.join(tmp, "era5.zarr")
        write_store(store, args.steps, h, w)
        # what the imports alone take (torch among them: the datapipe package loads it)
        subprocess.run([sys.executable, "-c", "import datapipe.convert_era5, xarray, zarr, "
                        "dask.array"], cwd=ROOT, check=True)
        imports = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
        start = time.monotonic()
        subprocess.run([sys.executable, "-m", "datapipe.convert_era5", store,
                        os.path.join(tmp, "out"), "--train_years", "2016"], cwd=ROOT, check=True)
        seconds = time.monotonic() - start
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    step = 20 * h * w * 4
    print(f"grid {h}x{w}, {args.steps} steps: peak RSS {peak / mib:.0f} MiB ({imports / mib:.0f} "
          f"MiB of it the imports); the year written {args.steps * step / mib:.0f} MiB, one step "
          f"{step / mib:.0f} MiB; {seconds:.0f} s")


if __name__ == "__main__":
    main()
