"""The data path: each problem's files and samples, and the loaders that bring them to the step.
Importing the package registers the problems' data sets (``datapipe.data_sets``)."""
from datapipe import cosmo, era5  # noqa: F401
