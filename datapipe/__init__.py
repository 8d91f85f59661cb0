"""The data path: each problem's files and samples, and the loaders that bring them to the step.
Importing the package registers the problems' data sets (``datapipe.data_sets``), and makes every
process forked from this one (a loader's workers: the batch pool's, DALI's Python workers) leave
what it inherited to the process that made it: its garbage collector never frees an inherited
object, whose finaliser would run in a copy without the threads it expects (a DALI pipeline's
shut-down, so run, crashed a worker). Only the child's own garbage is collected there."""
import gc
import os

from datapipe import cosmo, era5  # noqa: F401

os.register_at_fork(after_in_child=gc.freeze)
