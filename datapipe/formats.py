"""Facts about the on-disk data formats, shared by the loaders and the synthetic generator
(numpy and the settings only, so the generator's command line starts fast)."""
import numpy as np

from settings.config import ERA5_CHANNELS  # noqa: F401  (the settings name them too)

# Cosmology: channels that are the (x, y, z) components of a velocity; component k lies along
# array axis k + 1 of a (C, X, Y, Z) volume.
NBODY_VECTOR_CHANNELS = (1, 2, 3)  # Nbody: [log matter density, vx, vy, vz]
HYDRO_VECTOR_CHANNELS = (2, 3, 4)  # Hydro: [log gas density, log temperature, vx, vy, vz]
HYDRO_CHANNELS = ("log_rho", "log_T", "vx", "vy", "vz")  # names in logs and TensorBoard


def latitudes(h: int) -> np.ndarray:
    """Latitude of each ERA5 row in degrees: 90 at row 0 down to -90 at row h - 1."""
    return 90.0 - np.arange(h) * 180.0 / (h - 1)
