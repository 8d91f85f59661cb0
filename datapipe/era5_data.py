"""ERA5 input/target pairs read from per-year HDF5 files (docs/data.md: the format, row bands,
and which files are read by byte offset, over how many threads).

A sample is the state at step t and at t + dt of the same year, cropped to ``img_size``, as stored
(float32, not normalised: ``ERA5Task.device_batch`` normalises on the device); every valid pair
of every year is one index; with ``steps`` N > 1 (rollout training) the target is the N states
t + dt, ..., t + N dt of the same year, (N, C, H, W). ``rows=(start, stop)`` reads (or holds)
only that band of image rows.
Batches are read whole into the caller's batch buffer and checked for non-finite values: by
``os.preadv`` where ``fields`` is plain float32 bytes (``raw_layout``), each 1 MB piece checked
while still in cache; else through h5py, checked once per batch. File descriptors, h5py handles
and threads belong to one process: a forked worker opens its own at its first read.
"""
from __future__ import annotations

import contextlib
import glob
import multiprocessing
import operator
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor, wait

import h5py
import numpy as np
import torch

from datapipe.batch_dataset import BatchReadDataset, check_stored_dtype, finite_sums, read_float32
from settings.errors import DataError


def load_stats(root: str, n_channels: int):
    """Global means and stds, (1, C, 1, 1) on disk, as (C, 1, 1) float32 arrays."""
    out = []
    for name in ("global_means", "global_stds"):
        path = os.path.join(root, "stats", f"{name}.npy")
        try:
            a = np.load(path)
        except FileNotFoundError:
            raise DataError(f"{path} not found: the ERA5 stats must be in <data_root>/stats/ "
                            f"(make them with: python -m datapipe.synthetic era5 --out DIR)") from None
        except Exception as e:  # numpy's parse of a damaged header raises many kinds
            raise DataError(f"{path} is not a valid .npy file ({_npy_problem(e)}): write it "
                            f"again with numpy.save of a float array") from None
        if a.ndim != 4 or a.shape[0] != 1 or a.shape[2:] != (1, 1) or a.shape[1] < n_channels:
            raise DataError(f"{path} has shape {a.shape}; expected (1, C, 1, 1) with C >= "
                            f"{n_channels}")
        out.append(a[0, :n_channels].astype(np.float32))
    means, stds = out
    if not np.all(np.isfinite(means)) or not np.all(np.isfinite(stds)) or np.any(stds <= 0):
        raise DataError(f"{root}/stats holds non-finite means or non-positive stds")
    return means, stds


def _npy_problem(exc: BaseException) -> str:
    """Why ``np.load`` refused a file, without numpy's advice to unpickle it (a statistics file
    holds numbers: a file that is no array, or an array of objects, is damaged or another file)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "pickle" in text:
        return "it holds no array of numbers: damaged, or not a .npy array file"
    if isinstance(exc, EOFError):
        return "it is empty or cut short"
    return text


def check_rows(rows, height: int) -> tuple[int, int]:
    """``rows`` as ``(start, stop)`` with ``0 <= start < stop <= height``; ``None``: all rows."""
    if rows is None:
        return 0, height
    try:
        start, stop = (operator.index(r) for r in rows)  # integers only: 3.5 is refused
    except (TypeError, ValueError):
        raise ValueError(f"rows={rows!r} must be a (start, stop) pair of image rows") from None
    if not 0 <= start < stop <= height:
        raise ValueError(f"rows={rows!r} is not a band of the {height} image rows: choose "
                         f"0 <= start < stop <= {height} (img_size[0])")
    return start, stop


class ERA5Dataset(BatchReadDataset):
    def __init__(self, directory, data_root, img_size, dt=1, n_in=20, n_out=20,
                 limit_nsamples=None, inmem=False, rows=None, steps=1):
        self.directory = directory
        self.img_size = tuple(img_size)
        self.rows = check_rows(rows, self.img_size[0])  # the band of image rows a sample holds
        self.dt, self.n_in, self.n_out, self.steps = dt, n_in, n_out, steps
        self.files = sorted(glob.glob(os.path.join(directory, "*.h5")))
        if not self.files:
            raise DataError(f"no ERA5 year files (*.h5) in {directory}: set --data_root to the "
                            f"directory holding train/, valid/ and stats/ (or the ERA5_DATA_ROOT "
                            f"environment variable), or generate synthetic data with "
                            f"python -m datapipe.synthetic era5 --out DIR (meant the U-Net? "
                            f"its configs need --yaml_config config/UNet.yaml)")
        load_stats(data_root, max(n_in, n_out))  # refused here, before training, if missing
        # Per file: the pairs it holds, and where its values lie as plain bytes (or None: h5py).
        checked = [self._check_file(f) for f in self.files]
        self.pairs_per_file = [n for n, _, _ in checked]
        self._layouts = [layout for _, layout, _ in checked]
        self.file_rows = min(rows for _, _, rows in checked)  # the stored fields' rows (H)
        self.offsets = np.cumsum([0] + self.pairs_per_file)
        total = int(self.offsets[-1])
        if limit_nsamples is not None and limit_nsamples < total:
            # An even spread over all years, not the first N pairs of the first year.
            self.index = np.unique(np.linspace(0, total - 1, limit_nsamples).round().astype(np.int64))
        else:
            self.index = np.arange(total, dtype=np.int64)
        self._handles, self._fds = {}, {}  # per process: h5py datasets, file descriptors
        self._pid = None
        self._arrays = [self._read_all(f) for f in self.files] if inmem else None
        # In memory: which steps are finite as inputs (first n_in channels) and as targets,
        # found once here, so that batches need no check of their own.
        self._finite = None if self._arrays is None else [
            (_finite_steps(a[:, :n_in]), _finite_steps(a[:, :n_out])) for a in self._arrays]

    @property
    def sample_shapes(self):
        """Shapes of one input and one target: (n_in, rows, W) and ([steps,] n_out, rows, W)."""
        h, w = self.rows[1] - self.rows[0], self.img_size[1]
        return (self.n_in, h, w), (self.steps,) * (self.steps > 1) + (self.n_out, h, w)

    def _check_file(self, path) -> tuple:
        """(pairs, raw layout or None, rows of its fields) of the year file ``path``, or a
        DataError naming what is wrong with it."""
        h, w = self.img_size
        try:
            with h5py.File(path, "r") as f:
                if "fields" not in f:
                    raise DataError(f"{path} has no dataset 'fields' (found: {list(f.keys())})")
                shape = f["fields"].shape
                check_stored_dtype(path, "fields", f["fields"])
                layout = raw_layout(path, f["fields"])
        except OSError as e:
            raise DataError(f"{path} is not a readable HDF5 file ({e}): replace or remove it") from None
        if len(shape) != 4:
            raise DataError(f"{path}: 'fields' has shape {shape}; expected (T, C, H, W)")
        t, c, fh, fw = shape
        need_c = max(self.n_in, self.n_out)
        if c < need_c or fh < h or fw < w:
            raise DataError(f"{path}: 'fields' {shape} is smaller than the model needs "
                            f"(C >= {need_c}, H >= {h}, W >= {w}): check img_size and channels")
        lead = self.steps * self.dt  # the last target's
        if t <= lead:
            steps = f"rollout_steps={self.steps} x " if self.steps > 1 else ""
            raise DataError(f"{path} holds {t} steps, not more than {steps}dt={self.dt}")
        return t - lead, layout, fh

    def _read_all(self, path):
        (start, stop), w = self.rows, self.img_size[1]
        with h5py.File(path, "r") as f:
            return read_float32(f["fields"], np.s_[:, : max(self.n_in, self.n_out), start:stop, :w])

    def _this_process(self):
        """Handles are opened lazily and once per process: an h5py handle must not cross a fork,
        and a forked worker opens its own file descriptors (closing the inherited copies)."""
        if self._pid != os.getpid():
            if self._pid is not None:  # forked: these are this process's copies of the parent's
                for fd in self._fds.values():
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self._handles, self._fds, self._pid = {}, {}, os.getpid()

    def _fields(self, k):
        """Year file k's HDF5 dataset, opened once per process."""
        self._this_process()
        if k not in self._handles:
            self._handles[k] = h5py.File(self.files[k], "r")["fields"]
        return self._handles[k]

    def _fd(self, k) -> int:
        """Year file k opened for plain reads by offset, once per process."""
        self._this_process()
        if k not in self._fds:
            self._fds[k] = os.open(self.files[k], os.O_RDONLY)
        return self._fds[k]

    def __getstate__(self):
        # Pickled (a spawned worker): no handles or descriptors travel; the new process opens its own.
        state = dict(self.__dict__)
        state.update(_handles={}, _fds={}, _pid=None)
        return state

    def __len__(self):
        return len(self.index)

    def locate(self, i: int):
        """(file number, time step) of sample i."""
        j = int(self.index[i])
        k = int(np.searchsorted(self.offsets, j, side="right") - 1)
        return k, j - int(self.offsets[k])

    def read_batch(self, keys, x: np.ndarray, y: np.ndarray):
        """Samples ``keys`` (indices, or (epoch, index) pairs) into ``x`` (B, n_in, rows, W) and
        ``y`` (B, n_out, rows, W), float32 C-contiguous arrays the caller owns."""
        w = self.img_size[1]
        band = slice(*self.rows)
        where = [self.locate(key[1] if isinstance(key, tuple) else key) for key in keys]
        if self._arrays is not None:  # the band is all there is: one copy into the slot
            for j, (k, t) in enumerate(where):
                ok_in, ok_out = self._finite[k]
                if not (ok_in[t] and all(ok_out[s] for s, _ in self._targets(t, y[j]))):
                    self._refuse(k, t)
                fields = self._arrays[k]
                np.copyto(x[j], fields[t, : self.n_in])
                for s, dest in self._targets(t, y[j]):
                    np.copyto(dest, fields[s, : self.n_out])
            return
        # Files stored as plain float32 bytes: read by offset into the slots (threads, each piece
        # checked for non-finite values as it lands); any other file through HDF5, as a hyperslab
        # (only the band's rows) read into the slot, converted to float32 by HDF5, no copy after.
        by_offset = _raw_target(x) and _raw_target(y)
        pieces, others = [], []
        for j, (k, t) in enumerate(where):
            if by_offset and self._layouts[k] is not None:
                path, fd = self.files[k], self._fd(k)
                pieces += self._pieces(path, fd, self._layouts[k], t, x[j])
                for s, dest in self._targets(t, y[j]):
                    pieces += self._pieces(path, fd, self._layouts[k], s, dest)
            else:
                others.append(j)
        finite = read_pieces(pieces)
        for j in others:
            k, t = where[j]
            fields = self._fields(k)
            fields.read_direct(x[j], np.s_[t, : self.n_in, band, :w])
            for s, dest in self._targets(t, y[j]):
                fields.read_direct(dest, np.s_[s, : self.n_out, band, :w])
        # Read by HDF5: one reduction over the batch, a NaN or infinity anywhere makes the sum
        # non-finite. Only then are the samples looked at one by one (a huge finite sum may
        # overflow too), so the error names the first sample with a non-finite value.
        if others:
            finite = finite and finite_sums(x, y)
        if not finite:
            for j, (k, t) in enumerate(where):
                if not (np.isfinite(x[j]).all() and np.isfinite(y[j]).all()):
                    self._refuse(k, t)

    def _targets(self, t, out) -> list:
        """(step, destination) of each target state of the sample at step ``t``, whose target is
        ``out``: (C, rows, W), or (steps, C, rows, W)."""
        states = out.reshape(self.steps, *out.shape[-3:])  # (a view: the batch buffer's)
        return [(t + (i + 1) * self.dt, state) for i, state in enumerate(states)]

    def _pieces(self, path, fd, layout, t, out):
        """Pieces of step ``t``'s first ``len(out)`` channels, rows ``self.rows``, width ``W`` of
        ``out`` (C, rows, W): (path, fd, file offset, destination rows, file row bytes)."""
        offset, (_, c, h, w) = layout
        start, stop = self.rows
        n, rows, width = out.shape
        row_bytes = 4 * w  # a stored image row
        base = offset + t * c * h * row_bytes
        if rows == h:  # whole channels: all channels' rows follow each other in the file
            runs = [(base, out.reshape(n * h, width))]
        else:  # a band: one run of rows per channel
            runs = [(base + (ch * h + start) * row_bytes, out[ch]) for ch in range(n)]
        per_piece = max(1, PIECE_BYTES // row_bytes)
        return [(path, fd, at + i * row_bytes, dest[i:i + per_piece], row_bytes)
                for at, dest in runs for i in range(0, len(dest), per_piece)]

    def _refuse(self, k, t):
        raise DataError(f"non-finite values in {self.files[k]} at step {t} "
                        f"{'or' if self.steps == 1 else 'to'} {t + self.steps * self.dt} "
                        f"(rows {self.rows[0]}:{self.rows[1]}): repair the file or remove it "
                        f"from {self.directory}")


def raw_layout(path: str, dataset):
    """``(byte offset, shape)`` of ``dataset``'s values in the file at ``path`` where they are plain
    little-endian float32 bytes in C order: contiguous layout (not chunked, hence no compression
    or other filters), stored in this file (no external storage, not virtual, not an external
    link), allocated, and all of them inside the file. Otherwise None: read through HDF5."""
    if (sys.byteorder != "little" or dataset.dtype != np.dtype("<f4") or dataset.chunks is not None
            or dataset.is_virtual or dataset.external):
        return None
    nbytes = 4 * int(np.prod(dataset.shape, dtype=np.int64))
    # An unallocated dataset (never written) has no storage: HDF5 would read its fill value.
    if dataset.id.get_storage_size() != nbytes or nbytes == 0:
        return None
    try:
        if not os.path.samefile(dataset.file.filename, path):
            return None
        offset = dataset.id.get_offset()
        if offset is None or offset + nbytes > os.path.getsize(path):
            return None
    except (OSError, ValueError):
        return None
    return int(offset), tuple(int(s) for s in dataset.shape)


# Bytes per piece of a batch read by offset: a piece is read and then checked for non-finite
# values while it is still in cache; pieces are what the threads share out.
PIECE_BYTES = 1 << 20
# Fewer threads for small batches: a thread's wake-up costs more than copying a few MB.
MIN_BYTES_PER_THREAD = 4 << 20
MAX_READ_THREADS = 4


def read_threads() -> int:
    """Threads that read a batch in this process: up to ``MAX_READ_THREADS`` in the main process,
    the CPUs shared by ``num_workers`` in a torch DataLoader worker, and one in any other child
    process (``datapipe.batch_pool``'s workers, DALI's), which already read in parallel."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    info = torch.utils.data.get_worker_info()
    if info is not None:
        return max(1, min(MAX_READ_THREADS, cpus // max(1, info.num_workers)))
    if multiprocessing.parent_process() is not None:
        return 1
    return max(1, min(MAX_READ_THREADS, cpus))


_pool, _pool_key = None, None
_scratch = threading.local()


def _thread_pool(size: int) -> ThreadPoolExecutor:
    """This process's reader threads, created on first use after any fork (the threads of a
    parent do not exist in its forked children)."""
    global _pool, _pool_key
    key = (os.getpid(), size)
    if _pool_key != key:
        if _pool is not None and _pool_key[0] == os.getpid():
            _pool.shutdown(wait=False)
        _pool, _pool_key = ThreadPoolExecutor(size, thread_name_prefix="era5-read"), key
    return _pool


def _raw_target(a: np.ndarray) -> bool:
    """Whether byte reads can land in ``a``: C-contiguous, writable, native float32."""
    return a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable


def read_pieces(pieces) -> bool:
    """Read ``pieces`` (see ``ERA5Dataset._pieces``) by offset, over up to ``read_threads()``
    threads (this one included); whether every value read is finite."""
    if not pieces:
        return True
    nbytes = sum(p[3].nbytes for p in pieces)
    n = min(read_threads(), len(pieces), -(-nbytes // MIN_BYTES_PER_THREAD))
    left = pieces[::-1]  # shared: each thread pops the next piece as it frees (in file order)
    if n <= 1:
        return _read_share(left)
    futures = [_thread_pool(n - 1).submit(_read_share, left) for _ in range(n - 1)]
    try:
        finite = _read_share(left)
    finally:
        wait(futures)  # the threads write into the caller's buffers: never return before them
    return all([f.result() for f in futures]) and finite


def _read_share(left: list) -> bool:
    """Read pieces popped from ``left`` until none is left; whether all were finite."""
    finite = True
    while True:
        try:
            path, fd, offset, dest, row_bytes = left.pop()
        except IndexError:
            break
        if dest.shape[1] * 4 == row_bytes:  # whole rows: the bytes are the piece
            _pread_into(path, fd, memoryview(dest).cast("B"), offset)
        else:  # a cropped width: whole stored rows into a bounce buffer, then the columns
            rows, width = dest.shape
            buf = _scratch_buffer("rows", rows * row_bytes // 4, np.float32)
            _pread_into(path, fd, memoryview(buf).cast("B"), offset)
            np.copyto(dest, buf.reshape(rows, row_bytes // 4)[:, :width])
        # Checked while the piece is still in cache; exact (no sum that could overflow).
        finite = finite and bool(np.isfinite(dest, out=_scratch_buffer("ok", dest.size, bool)
                                             .reshape(dest.shape)).all())
    return finite


def _scratch_buffer(name: str, n: int, dtype) -> np.ndarray:
    """The first ``n`` elements of this thread's scratch array ``name`` (grown when too small)."""
    buf = getattr(_scratch, name, None)
    if buf is None or buf.size < n:
        buf = np.empty(max(n, PIECE_BYTES // 4), dtype)
        setattr(_scratch, name, buf)
    return buf[:n]


def _pread_into(path, fd, view, offset):
    """Fill ``view`` with the file's bytes from ``offset`` (a read may return fewer bytes)."""
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise DataError(f"{path} ends at byte {offset}, inside its dataset 'fields': the file "
                            f"is truncated; replace or remove it")
        view, offset = view[n:], offset + n


def _finite_steps(a: np.ndarray) -> np.ndarray:
    """(T,) bool: step t of ``a`` (T, ...) holds only finite values."""
    ok = np.isfinite(a.sum(axis=tuple(range(1, a.ndim)), dtype=np.float64))
    for t in np.flatnonzero(~ok):  # a sum can overflow where every value is finite
        ok[t] = np.isfinite(a[t]).all()
    return ok
