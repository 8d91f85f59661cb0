"""ERA5 batches read by byte offset (contiguous float32 files) are bitwise the h5py reads; other
files fall back to h5py; the checks and their messages are kept; reading works after a fork."""
import multiprocessing
import os
import pickle

import h5py
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from conftest import write_era5
from datapipe import era5_data
from datapipe.era5_data import ERA5Dataset
from settings.errors import DataError


def era5_ds(root, **kw):
    args = dict(data_root=root, img_size=(16, 32), dt=1, n_in=20, n_out=20)
    args.update(kw)
    return ERA5Dataset(os.path.join(root, "train"), **args)


@pytest.fixture(params=[1, 3], ids=["1 thread", "3 threads"])
def threads(request, monkeypatch):
    """Reads over ``threads`` threads in pieces of 3 image rows (the fixture's batches are a few
    kB: without this every batch would be one piece read by one thread)."""
    monkeypatch.setattr(era5_data, "read_threads", lambda: request.param)
    monkeypatch.setattr(era5_data, "MIN_BYTES_PER_THREAD", 1)
    monkeypatch.setattr(era5_data, "PIECE_BYTES", 3 * 32 * 4)
    return request.param


def no_h5py(ds):
    """Make any read through h5py fail: the batch must come from reads by offset alone."""
    def refuse(k):
        raise AssertionError(f"h5py read of file {k}")
    ds._fields = refuse
    return ds


def expected(ds, keys):
    """The batch as h5py reads it, one hyperslab per field (the read path before offsets)."""
    (r0, r1), w = ds.rows, ds.img_size[1]
    xs, ys = [], []
    for key in keys:
        k, t = ds.locate(key[1] if isinstance(key, tuple) else key)
        with h5py.File(ds.files[k], "r") as f:
            xs.append(f["fields"][t, : ds.n_in, r0:r1, :w].astype(np.float32))
            ys.append(f["fields"][t + ds.dt, : ds.n_out, r0:r1, :w].astype(np.float32))
    return np.stack(xs), np.stack(ys)


def read(ds, keys):
    """``read_batch`` into batch arrays filled with NaN first: a value not written is noticed."""
    sx, sy = ds.sample_shapes
    x, y = np.full((len(keys), *sx), np.nan, np.float32), np.full((len(keys), *sy), np.nan, np.float32)
    ds.read_batch(keys, x, y)
    return x, y


def assert_bitwise(got, want):
    for g, e in zip(got, want):
        assert g.dtype == np.float32 and g.shape == e.shape
        assert np.array_equal(g.view(np.uint32), e.view(np.uint32))


CASES = {
    "whole images": {},
    "band": dict(rows=(4, 12)),
    "top rows": dict(rows=(0, 3)),
    "bottom rows": dict(rows=(13, 16)),
    "cropped image": dict(img_size=(8, 16)),
    "band of a narrower image": dict(img_size=(16, 24), rows=(5, 9)),
    "dt 3, fewer inputs": dict(dt=3, n_in=5),
    "dt 2, fewer outputs": dict(dt=2, n_out=3),
    "limit_nsamples": dict(limit_nsamples=7),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_offset_reads_are_bitwise_the_h5py_reads(era5_root, threads, case):
    ds = no_h5py(era5_ds(era5_root, **CASES[case]))
    assert all(layout is not None for layout in ds._layouts)  # both year files: by offset
    n = len(ds)
    years = {ds.locate(i)[0] for i in range(n)}
    assert years == {0, 1}
    everything = list(range(n))  # one batch over both years
    shuffled = [(5, int(i)) for i in np.random.default_rng(0).permutation(n)[:5]]  # (epoch, index)
    for keys in (everything, shuffled, [n - 1], [0, 0, n - 1]):
        assert_bitwise(read(ds, keys), expected(ds, keys))
    x, y = ds[(2, n - 1)]  # one sample through __getitem__
    assert_bitwise((x[None].numpy(), y[None].numpy()), expected(ds, [n - 1]))
    # and the dataset's own h5py path (files marked as not readable by offset) gives the same
    reference = era5_ds(era5_root, **CASES[case])
    reference._layouts = [None] * len(reference._layouts)
    assert_bitwise(read(ds, shuffled), read(reference, shuffled))


def test_a_batch_slice_of_a_larger_buffer(era5_root, threads):
    """A loader may hand rows ``lo:hi`` of one batch buffer to each worker: contiguous slices."""
    ds = no_h5py(era5_ds(era5_root, rows=(2, 11)))
    sx, sy = ds.sample_shapes
    x, y = np.full((6, *sx), np.nan, np.float32), np.full((6, *sy), np.nan, np.float32)
    keys = [3, 17, 8, 0, 21, 12]
    ds.read_batch(keys[:2], x[:2], y[:2])
    ds.read_batch(keys[2:], x[2:], y[2:])
    assert_bitwise((x, y), expected(ds, keys))


def rewrite(path, **create):
    """Rewrite ``fields`` of the file at ``path`` with the same values, stored as ``create`` says."""
    with h5py.File(path, "r") as f:
        values = f["fields"][:]
    with h5py.File(path, "w") as f:
        f.create_dataset("fields", data=values.astype(create.pop("dtype", values.dtype)), **create)


@pytest.mark.parametrize("stored", ["chunked", "gzip", "big-endian", "float64", "mixed"])
def test_other_layouts_and_types_fall_back_to_h5py(tmp_path, era5_root, threads, stored):
    """Chunked or compressed files, other byte orders and other types are read through HDF5 (which
    converts them to float32) and give the same batches; a batch may mix both kinds of file."""
    root = write_era5(str(tmp_path / "other"))
    files = [os.path.join(root, "train", f"{y}.h5") for y in (2016, 2017)]
    how = {"chunked": dict(chunks=(1, 4, 16, 32)), "gzip": dict(chunks=(2, 20, 16, 32), compression="gzip"),
           "big-endian": dict(dtype=">f4"), "float64": dict(dtype=np.float64),
           "mixed": dict(chunks=(1, 20, 8, 32), compression="gzip")}[stored]
    for path in files[1:] if stored == "mixed" else files:
        rewrite(path, **dict(how))
    ds, ref = era5_ds(root, rows=(3, 14)), no_h5py(era5_ds(era5_root, rows=(3, 14)))
    by_offset = [layout is not None for layout in ds._layouts]
    assert by_offset == ([True, False] if stored == "mixed" else [False, False])
    keys = list(range(len(ds)))
    assert_bitwise(read(ds, keys), read(ref, keys))
    assert_bitwise(read(ds, keys), expected(ds, keys))


def test_where_the_bytes_are(tmp_path, threads):
    """A file with a user block (the dataset's offset counts it) is read by offset at the right
    place; a dataset never written (no storage: HDF5 reads its fill value) goes through h5py."""
    root = write_era5(str(tmp_path / "e"))
    path = os.path.join(root, "train", "2017.h5")
    with h5py.File(path, "r") as f:
        values = f["fields"][:]
    with h5py.File(path, "w", userblock_size=1024) as f:
        f["fields"] = values
    ds = no_h5py(era5_ds(root))
    assert ds._layouts[1][0] > 1024
    keys = list(range(len(ds)))
    assert_bitwise(read(ds, keys), expected(ds, keys))
    with h5py.File(path, "w") as f:
        f.create_dataset("fields", shape=values.shape, dtype=np.float32, fillvalue=2.5)
    ds = era5_ds(root)
    assert ds._layouts[1] is None
    x, y = read(ds, [len(ds) - 1])
    assert (x == 2.5).all() and (y == 2.5).all()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_give_the_one_line_error(tmp_path, threads, bad):
    """The check of every piece read by offset still names the file, steps and rows of the sample
    holding the value, whichever slot and thread; values outside the rows read are not seen."""
    root = write_era5(str(tmp_path / "e"))
    with h5py.File(os.path.join(root, "train", "2017.h5"), "r+") as f:
        f["fields"][3, 5, 9, 30] = bad  # row 9
    ds = no_h5py(era5_ds(root))
    bad_i = next(i for i in range(len(ds)) if ds.locate(i) == (1, 3))
    good = [i for i in range(len(ds)) if ds.locate(i) not in ((1, 3), (1, 2))]
    read(ds, good)  # finite: no error
    with pytest.raises(DataError) as e:
        read(ds, good[:2] + [bad_i] + good[2:5])
    message = str(e.value)
    assert "\n" not in message
    assert message == (f"non-finite values in {ds.files[1]} at step 3 or 4 (rows 0:16): repair the "
                       f"file or remove it from {ds.directory}")
    as_target = next(i for i in range(len(ds)) if ds.locate(i) == (1, 2))
    with pytest.raises(DataError, match=r"2017\.h5 at step 2 or 3 \(rows 4:12\)"):
        read(no_h5py(era5_ds(root, rows=(4, 12))), [0, as_target])
    read(no_h5py(era5_ds(root, rows=(10, 16))), [bad_i, as_target])  # row 9 is not read


def test_huge_finite_values_are_not_refused(tmp_path, threads):
    """Values near float32's largest are finite: reading them raises nothing."""
    root = write_era5(str(tmp_path / "e"))
    with h5py.File(os.path.join(root, "train", "2016.h5"), "r+") as f:
        f["fields"][:, :, :2] = 3e38
    ds = no_h5py(era5_ds(root))
    x, y = read(ds, [i for i in range(len(ds)) if ds.locate(i)[0] == 0])  # all of 2016
    assert (x[:, :, :2] == np.float32(3e38)).all() and (y[:, :, :2] == np.float32(3e38)).all()


def test_a_file_truncated_after_opening_gives_one_line(tmp_path):
    root = write_era5(str(tmp_path / "e"))
    ds = no_h5py(era5_ds(root))
    last = len(ds) - 1  # the last steps of 2017, at the end of the file
    read(ds, [last])
    path = ds.files[1]
    os.truncate(path, os.path.getsize(path) - 4096)
    with pytest.raises(DataError, match=r"2017\.h5 ends at byte \d+, inside its dataset 'fields': "
                                        r"the file is truncated"):
        read(ds, [last])


class Batches(Dataset):
    """Whole batches through ``read_batch`` (as the project's loaders read them), with the pid of
    the process that read each and the pid its reader threads were made in."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitems__(self, keys):
        x, y = read(self.ds, keys)
        pool = era5_data._pool_key[0] if era5_data._pool_key else None
        assert self.ds._pid == os.getpid()  # the files were opened by this process
        return torch.from_numpy(x), torch.from_numpy(y), os.getpid(), pool


def _as_is(batch):
    return batch


def test_reads_in_forked_loader_workers(era5_root, monkeypatch):
    """After the main process has read (its files and reader threads exist), forked workers
    read the same batches with files and threads of their own."""
    monkeypatch.setattr(era5_data, "read_threads", lambda: 2)
    monkeypatch.setattr(era5_data, "MIN_BYTES_PER_THREAD", 1)
    monkeypatch.setattr(era5_data, "PIECE_BYTES", 4 * 32 * 4)
    ds = no_h5py(era5_ds(era5_root, rows=(1, 15)))
    keys = list(range(len(ds)))
    read(ds, keys)  # the parent reads first: descriptors open, threads started
    assert ds._fds and era5_data._pool_key[0] == os.getpid()
    batches = DataLoader(Batches(ds), batch_size=4, collate_fn=_as_is, num_workers=2,
                         multiprocessing_context="fork", timeout=60)  # a hang fails instead
    pids = set()
    for n, (x, y, pid, pool) in enumerate(batches):
        assert_bitwise((x.numpy(), y.numpy()), expected(ds, keys[4 * n:4 * n + 4]))
        assert pid != os.getpid() and pool == pid  # threads made in the worker, after the fork
        pids.add(pid)
    assert len(pids) == 2 and n == len(keys) // 4 - (len(keys) % 4 == 0)
    samples = DataLoader(ds, batch_size=3, num_workers=2, multiprocessing_context="fork", timeout=60)
    x, y = (torch.cat(a) for a in zip(*samples))
    assert_bitwise((x.numpy(), y.numpy()), expected(ds, keys))


def test_pickled_datasets_open_their_own_files(era5_root):
    """A dataset pickled after reading (for a spawned worker) carries no handles and reads again."""
    ds = era5_ds(era5_root)
    read(ds, [0, 15])
    ds._fields(0)  # an h5py handle open too (it does not pickle)
    assert ds._fds and ds._handles
    copy = pickle.loads(pickle.dumps(ds))
    assert copy._fds == {} and copy._handles == {}
    assert_bitwise(read(no_h5py(copy), [0, 15]), expected(ds, [0, 15]))


def _threads_in_child(q):
    q.put(era5_data.read_threads())


class Threads(Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        return era5_data.read_threads()


def test_thread_count_follows_the_cpus_and_the_workers():
    cpus = len(os.sched_getaffinity(0))
    assert era5_data.read_threads() == min(era5_data.MAX_READ_THREADS, cpus)
    per_worker = list(DataLoader(Threads(), batch_size=None, num_workers=2,
                                 multiprocessing_context="fork"))
    assert per_worker == [max(1, min(era5_data.MAX_READ_THREADS, cpus // 2))] * 2
    ctx = multiprocessing.get_context("fork")  # another loader's worker process: one thread
    q = ctx.Queue()
    p = ctx.Process(target=_threads_in_child, args=(q,))
    p.start()
    assert q.get(timeout=60) == 1
    p.join()
