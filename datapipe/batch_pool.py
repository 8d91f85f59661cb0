"""Batches assembled in place in a pool of shared, reused batch buffers (pinned on a GPU).

``BatchLoader`` serves the batches of a dataset with ``sample_shapes`` and ``read_batch(keys, x,
y)`` (``datapipe.batch_dataset``) in the order of a sampler, as torch's DataLoader did, without its
per-batch costs. docs/performance.md ("Batch hand-over") says how its slots (``BatchLoader.depth``
batch buffers) are made, filled and reused; **Release**: a slot's batch is handed out on a storage
of its own, watched by weak reference, its slot reused once unreferenced and, on a GPU, once a
CUDA event recorded at its release has completed. Workers, forked at the first pass and kept,
each read their share of a batch's rows into its slot, ignore the stop signals and Ctrl-C, and
send errors back as raised (``_describe``). ``iter(loader)`` starts a pass and ends the previous
one, whose batches still queued the workers skip (a shared pass number).

Invariants, checked after every step of random sequences of passes, fetches, held batches, slow
and failing reads, killed workers, interrupts and ``close()`` by tests/test_batch_pool_stress.py:

1. Only parts not yet answered are waited for, and each is answered once (``_Batch.out``); ending
   a pass waits for the parts still out, then gives back the slot of every batch in flight.
2. A batch holds exactly the samples its keys name: a slot is in one state at a time (free, in
   flight, handed out, releasing) and each row of a batch in flight is written by one worker.
3. A batch handed out does not change while it is referenced (Release, above).
4. Every wait returns on an answer or on a worker's end, and a signal handler can interrupt it
   (``connection.wait`` on pipes and sentinels, a polled CUDA event); the one C-level wait is the
   device synchronisation in ``close()``. ``waiting_for()`` says what a wait is for.
5. An exception at any point (a stop request, a stall timeout) leaves a loader that ``close()``
   and the next pass recover: ``in_doubt`` stays set, that pass ends, and the next ``iter()``
   starts with ``close()``. Workers are forked with signal handlers deferred, so none is ever
   left out of ``workers``.
6. Nothing outlives ``close()`` or the main process: workers are killed and joined, slots are
   anonymous memory, and a worker's first act is ``exit_with_parent``.
7. An iterator of an ended pass stops (superseded, run out, failed, interrupted, closed).
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import mmap
import multiprocessing
import os
import pickle
import random
import signal
import tempfile
import threading
import time
import traceback
import weakref
from collections import deque
from multiprocessing import connection, reduction

import numpy as np
import torch

from settings.errors import TrainingError, UserError
from settings.signals import ignore_stop_signals

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # fault the pages in when mapping, not per page


try:  # looked up here, in the main process: a forked child calls it before anything else
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


def exit_with_parent(parent_pid: int):
    """Make this worker process die as soon as the training process does (even by kill -9),
    instead of lingering. The first thing a worker does: nothing before it can block (a lock
    held by another thread of the parent at the fork). The death signal comes when the thread
    that forked the worker ends, so workers are forked by the main thread only. Linux only;
    elsewhere a worker ends when its pipe to the main process closes."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        os._exit(1)


class LoaderWorkerDied(TrainingError):
    """A loader worker process ended in the middle of a pass (killed, or out of memory)."""


# ----------------------------------------------------------------------------- host memory

class HostMemory:
    """CPU batches: slots are plain shared memory; a released batch's slot is free at once (the
    pool asks only pinned memory for marks)."""

    pinned = False

    def register(self, address: int, nbytes: int):
        pass

    def unregister(self, address: int):
        pass


class PinnedHostMemory(HostMemory):
    """GPU batches: slots page-locked in place with ``cudaHostRegister``; a released batch's slot
    is reused only after a mark (a CUDA event on the current stream of ``device``) taken at its
    release has passed. ``runtime`` (``torch.cuda.cudart()`` by default) and the marks are the
    only CUDA calls: tests run everything else on a CPU with stand-ins."""

    pinned = True
    PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context, as torch does

    def __init__(self, device, runtime=None):
        self.device = device
        self._runtime = runtime

    @property
    def runtime(self):
        if self._runtime is None:
            self._runtime = torch.cuda.cudart()
        return self._runtime

    def _on_device(self):
        """The loader's device current while registering (the primary context of another GPU
        is not created for it); nothing to set for a stand-in on a CPU."""
        if self.device.type == "cuda":
            return torch.cuda.device(self.device)
        return contextlib.nullcontext()

    def register(self, address: int, nbytes: int):
        with self._on_device():
            err = int(self.runtime.cudaHostRegister(address, nbytes, self.PORTABLE))
        if err:
            raise RuntimeError(f"cudaHostRegister of a {nbytes / 2**20:.1f} MiB batch buffer "
                               f"failed with cudaError {err}: pinned memory exhausted? Lower "
                               f"--num_data_workers, --prefetch_depth or the batch size")

    def unregister(self, address: int):
        with self._on_device():
            self.runtime.cudaHostUnregister(address)  # an error here leaves nothing to undo

    def mark(self):
        """A point in the device's queue of work, after everything queued so far."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def passed(self, mark) -> bool:
        return mark.query()

    def wait(self, mark):
        while not mark.query():  # polled: a signal handler runs (and may raise) meanwhile
            time.sleep(0.0002)

    def wait_all(self):
        torch.cuda.synchronize(self.device)


# ----------------------------------------------------------------------------- slots

def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _shared_file(nbytes: int) -> int:
    """A descriptor of ``nbytes`` of anonymous shared memory, allocated now (so that a lack of
    memory shows here, not as SIGBUS when a page is first touched)."""
    try:
        fd = os.memfd_create("batch-slot", os.MFD_CLOEXEC)
    except (AttributeError, OSError):  # no memfd: a file unlinked at once
        with tempfile.TemporaryFile() as f:
            fd = os.dup(f.fileno())
    try:
        os.ftruncate(fd, nbytes)
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        os.close(fd)
        limit = (" (a shared-memory file counts against the file-size limit, ulimit -f: raise "
                 "it, or use --num_data_workers 0)" if e.errno == errno.EFBIG else "")
        raise TrainingError(f"could not allocate a {nbytes / 2**20:.1f} MiB batch buffer in "
                            f"shared memory ({e.strerror}){limit}: lower --num_data_workers, "
                            f"--prefetch_depth or the batch size") from None
    return fd


class SlotLayout:
    """Where a batch's input (B, *x) and target (B, *y), float32, lie in a slot's bytes."""

    def __init__(self, x_shape, y_shape):
        self.x_shape, self.y_shape = tuple(x_shape), tuple(y_shape)
        self.nx, self.ny = int(np.prod(self.x_shape)), int(np.prod(self.y_shape))
        self.y_offset = _round_up(4 * self.nx, 64)  # bytes; cache-line aligned
        self.nbytes = _round_up(self.y_offset + 4 * self.ny, mmap.PAGESIZE)

    def arrays(self, buffer):
        """Writable float32 ``(x, y)`` arrays over ``buffer`` (a slot's mapping)."""
        x = np.frombuffer(buffer, np.float32, self.nx).reshape(self.x_shape)
        y = np.frombuffer(buffer, np.float32, self.ny, self.y_offset).reshape(self.y_shape)
        return x, y

    def map(self, fd: int) -> mmap.mmap:
        return mmap.mmap(fd, self.nbytes, flags=mmap.MAP_SHARED | _MAP_POPULATE)

    def map_private(self) -> mmap.mmap:
        """Anonymous memory of this process alone (no workers: nothing to share, no file, so no
        file-size limit applies), kept out of forked children and on huge pages if it can."""
        buffer = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE)
        for advice in ("MADV_DONTFORK", "MADV_HUGEPAGE"):
            if hasattr(mmap, advice):
                with contextlib.suppress(OSError):
                    buffer.madvise(getattr(mmap, advice))
        np.frombuffer(buffer, np.uint8)[::mmap.PAGESIZE] = 0  # its pages, faulted in now
        return buffer


class Slot:
    """One batch buffer of the pool, made in the main process and registered with ``memory``
    (pinned on a GPU): ``shared``, a mapping of an anonymous shared file (``fd`` passes it to
    workers); else memory of this process alone (no workers)."""

    def __init__(self, index: int, layout: SlotLayout, memory: HostMemory, shared: bool = True):
        self.index, self.layout, self.memory = index, layout, memory
        self.fd = _shared_file(layout.nbytes) if shared else -1
        try:
            self.buffer = layout.map(self.fd) if shared else layout.map_private()
            self.x, self.y = layout.arrays(self.buffer)  # where the main process reads into
            self.address = self.x.ctypes.data
            memory.register(self.address, layout.nbytes)
        except BaseException:
            if self.fd >= 0:
                os.close(self.fd)
            raise
        self.registered = True
        self.handed_out = None  # weak reference to the storage's array while a batch is out

    def batch(self, n: int):
        """The first ``n`` samples as tensors on a new view of the slot's memory, which lives as
        long as any tensor made from it: ``in_use`` says whether any is still referenced."""
        whole = np.frombuffer(self.buffer, np.uint8)  # the base of both arrays below
        x, y = (torch.from_numpy(a)[:n] for a in self.layout.arrays(whole))
        self.handed_out = weakref.ref(whole)  # dies with the last tensor made from it
        return x, y

    def in_use(self) -> bool:
        return self.handed_out is not None and self.handed_out() is not None

    def close(self):
        """Unregister and drop the pool's hold on the memory; batches still referenced keep
        their pages mapped (unpinned) until they go."""
        if self.registered:
            self.registered = False
            self.memory.unregister(self.address)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.x = self.y = self.buffer = None


class BatchPool:
    """The slots of one loader and the state of each (invariant 2); releasing: no longer
    referenced, waiting for its mark to pass (GPU only)."""

    def __init__(self, layout: SlotLayout, memory: HostMemory, depth: int, shared: bool = True):
        self.layout, self.memory, self.depth, self.shared = layout, memory, depth, shared
        self.slots: list[Slot] = []
        self.free: deque[Slot] = deque()
        self.out: list[Slot] = []
        self.releasing: deque[tuple[object, list[Slot]]] = deque()

    def collect(self):
        """Release the handed-out batches no longer referenced; free the released slots whose
        mark has passed."""
        gone = [s for s in self.out if not s.in_use()]
        if gone:
            self.out = [s for s in self.out if s.in_use()]
            for s in gone:
                s.handed_out = None
            if self.memory.pinned:  # a copy from them may still be queued: free after this mark
                self.releasing.append((self.memory.mark(), gone))
            else:
                self.free.extend(gone)
        while self.releasing and self.memory.passed(self.releasing[0][0]):
            self.free.extend(self.releasing.popleft()[1])

    def take(self, urgent: bool = True) -> Slot | None:
        """A slot to fill: a free one, a new one while fewer than ``depth`` exist, else (urgent)
        the oldest released one once its mark has passed (waiting for it), else a new one: every
        slot is held by the consumer. Not urgent (a prefetch): None rather than wait."""
        self.collect()
        if self.free:
            return self.free.popleft()
        if len(self.slots) >= self.depth and self.releasing:
            if not urgent:
                return None
            mark, slots = self.releasing.popleft()
            self.memory.wait(mark)
            self.free.extend(slots)
            return self.free.popleft()
        slot = Slot(len(self.slots), self.layout, self.memory, self.shared)
        self.slots.append(slot)
        return slot

    def hand_out(self, slot: Slot, n: int):
        batch = slot.batch(n)
        self.out.append(slot)
        return batch

    def give_back(self, slot: Slot):
        """A slot filled for nothing (its pass ended, or its read failed)."""
        self.free.append(slot)

    def close(self):
        if self.memory.pinned and self.slots:
            self.memory.wait_all()  # no copy from any slot is still queued
        for s in self.slots:
            s.close()
        self.slots, self.out = [], []
        self.free.clear()
        self.releasing.clear()


# ----------------------------------------------------------------------------- workers

def _worker_loop(dataset, conn, control, worker_id: int, parent_pid: int, seed: int, others):
    """A worker: map the slots it is sent, fill its parts of batches, answer each part."""
    exit_with_parent(parent_pid)
    for c in others:  # the other ends of every pipe: only the main process keeps them
        c.close()
    for number, handler in _deferred.items():  # the parent's, as they were before the fork
        signal.signal(number, handler)
    ignore_stop_signals()  # the main process stops the run (and its workers) on them
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's, likewise
    torch.set_num_threads(1)
    random.seed(seed)
    np.random.seed(seed % 2**32)  # libraries that draw from it: a stream per worker and rank
    torch.manual_seed(seed)
    current_pass = np.frombuffer(control, np.int64)
    slots = {}
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                return
            if msg[0] == "slot":
                _, index, x_shape, y_shape = msg
                fd = reduction.recv_handle(conn)
                layout = SlotLayout(x_shape, y_shape)
                buffer = layout.map(fd)
                os.close(fd)
                slots[index] = layout.arrays(buffer)
                continue
            _, pass_id, batch, index, lo, hi, keys = msg
            if pass_id != current_pass[0]:  # a pass that has ended: skip
                conn.send(("skip", pass_id, batch, lo, None))
                continue
            x, y = slots[index]
            try:
                dataset.read_batch(keys, x[lo:hi], y[lo:hi])
                conn.send(("done", pass_id, batch, lo, None))
            except Exception as e:  # noqa: BLE001 - every error goes back to the main process
                conn.send(("error", pass_id, batch, lo, _describe(e, worker_id)))
    except (EOFError, OSError, KeyboardInterrupt):
        return  # the main process went away


_deferred: dict = {}  # while forking: the handlers that _signal_handlers_deferred replaced


@contextlib.contextmanager
def _signal_handlers_deferred():
    """Python signal handlers run after the body, not inside it: a handler that raises (a stop
    request) can then neither leave a forked worker out of the list that ``close()`` ends, nor
    run inside the fork's own hooks (and leave logging's lock taken, say). Main thread only."""
    caught = []
    _deferred.update({n: h for n in signal.valid_signals() if callable(h := signal.getsignal(n))})
    for number in _deferred:
        signal.signal(number, lambda n, frame: caught.append((n, frame)))
    try:
        yield
    finally:
        handlers = dict(_deferred)
        _deferred.clear()
        for number, handler in handlers.items():
            signal.signal(number, handler)
        for number, frame in caught:
            handlers[number](number, frame)


def _describe(e: BaseException, worker_id: int):
    """A worker's error as the main process raises it: a UserError as itself (one line);
    anything else as a RuntimeError with the worker's traceback."""
    if isinstance(e, UserError):
        try:
            pickle.loads(pickle.dumps(e))
            return e
        except Exception:  # noqa: BLE001 - an error that does not pickle: described instead
            pass
    text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    return RuntimeError(f"Caught {type(e).__name__} in loader worker {worker_id} "
                        f"(pid {os.getpid()}).\nOriginal {text}")


class _Worker:
    def __init__(self, index, process, conn):
        self.index, self.process, self.conn = index, process, conn
        self.slots = set()  # slots whose descriptor it has


class _Batch:
    """A batch being filled: its slot, its keys, its parts not answered yet (``out``: first row
    -> (worker, end row)), its first error."""

    def __init__(self, index, slot, keys):
        self.index, self.slot, self.keys, self.n = index, slot, keys, len(keys)
        self.out: dict[int, tuple[_Worker, int]] = {}
        self.error, self.error_at = None, None


class _Pass:
    """One pass over the sampler (``iter(loader)``)."""

    def __init__(self, loader: BatchLoader):
        self.loader = loader
        self.id = loader._begin_pass(self)
        self.keys = iter(loader.sampler)
        self.sent = 0  # batches sent to workers (or read)
        self.served = 0  # batches handed out
        self.pending = None  # the keys of the next batch to send, drawn but not sent yet
        self.exhausted = False  # the sampler has no more keys
        if loader.num_workers:
            loader._send_ahead(self)  # the workers start on the first batches now
        loader.in_doubt = False

    def __iter__(self):
        return self

    def __next__(self):
        return self.loader._next(self)

    def next_keys(self):
        """The keys of the next batch (drawn once), or None at the end of the pass."""
        if self.pending is None and not self.exhausted:
            self.pending = list(itertools.islice(self.keys, self.loader.batch_size)) or None
            self.exhausted = self.pending is None
        return self.pending


class BatchLoader:
    """Batches of ``dataset`` in the order of ``sampler`` (the last one may be smaller), read by
    ``workers`` processes (0: this one); ``memory``: ``PinnedHostMemory(device)`` on a GPU."""

    def __init__(self, dataset, sampler, batch_size: int, workers: int = 0,
                 prefetch_depth: int = 2, memory: HostMemory | None = None, seed: int = 0):
        self.dataset, self.sampler, self.batch_size = dataset, sampler, batch_size
        self.num_workers, self.prefetch_depth, self.seed = workers, max(1, prefetch_depth), seed
        self.memory = memory if memory is not None else HostMemory()
        self.pin_memory = self.memory.pinned
        self.ahead = self.prefetch_depth * workers  # batches in flight
        # The engine holds batch k - 1 while it fetches batch k: in flight + 2 slots. On a GPU
        # one more: a released slot waits for the device to pass its mark.
        self.depth = self.ahead + 2 + int(self.memory.pinned)
        self.pool: BatchPool | None = None
        self.workers: list[_Worker] | None = None
        self.control = None  # the current pass number, shared with the workers
        self.current: _Pass | None = None
        self.in_flight: dict[tuple[int, int], _Batch] = {}
        self.passes = 0
        self.in_doubt = False  # an exception left a pass's exchange with the workers half done
        self.awaited = None  # what the main process waits for now: (pass, batch index) or None

    def __len__(self):
        return -(-len(self.sampler) // self.batch_size)

    def __iter__(self):
        return _Pass(self)

    # -------------------------------------------------------------- passes

    def _begin_pass(self, new: _Pass) -> int:
        if self.in_doubt:  # the last pass was interrupted: fresh workers and slots
            self.close()
        self.in_doubt = True  # until the new pass has sent its first batches
        if self.pool is None:
            sx, sy = self.dataset.sample_shapes
            layout = SlotLayout((self.batch_size, *sx), (self.batch_size, *sy))
            self.pool = BatchPool(layout, self.memory, self.depth, shared=self.num_workers > 0)
        if self.num_workers and self.workers is None:
            self._start_workers()
        self.passes += 1
        if self.control is not None:
            np.frombuffer(self.control, np.int64)[0] = self.passes  # older passes' parts: skipped
        self._end_pass()
        self.current = new
        return self.passes

    def _end_pass(self):
        """End the current pass (invariant 1; the workers skip the parts they have not begun)."""
        self.current = None
        self.awaited = (self.passes - 1, None)
        while any(b.out for b in self.in_flight.values()):
            self._receive()
        for b in self.in_flight.values():
            self.pool.give_back(b.slot)
        self.in_flight.clear()
        self.awaited = None

    def _next(self, p: _Pass):
        if p is not self.current or self.in_doubt:  # ended (run out, failed, superseded) or
            raise StopIteration                      # interrupted: see the module docstring
        self.in_doubt = True  # cleared below, unless an exception leaves in the middle
        b = self._read_here(p) if self.num_workers == 0 else self._wait_for_next(p)
        self.in_doubt = False
        if b is None:  # the end of the pass
            self.current = None
            raise StopIteration
        if b.error is not None:
            self.pool.give_back(b.slot)
            self.current = None
            np.frombuffer(self.control, np.int64)[0] = -1  # the rest of this pass: skipped
            raise b.error.with_traceback(None) from None
        return self.pool.hand_out(b.slot, b.n)

    def _wait_for_next(self, p: _Pass) -> _Batch | None:
        """The next batch of ``p`` once filled (None at the end of its keys); batches sent ahead."""
        self._send_ahead(p)
        if p.served == p.sent:  # nothing in flight: the keys have run out
            return None
        self.awaited = (p.id, p.served)
        b = self.in_flight[self.awaited]
        while b.out:
            self._receive()
        del self.in_flight[self.awaited]
        self.awaited = None
        p.served += 1
        if b.error is None:
            self._send_ahead(p)  # slots released by the device meanwhile
        return b

    def _read_here(self, p: _Pass) -> _Batch | None:
        keys = p.next_keys()
        if keys is None:
            return None
        p.pending = None
        b = _Batch(p.sent, self.pool.take(), keys)
        self.dataset.read_batch(keys, b.slot.x[:b.n], b.slot.y[:b.n])
        p.sent += 1
        p.served += 1
        return b

    def _send_ahead(self, p: _Pass):
        """Send batches up to ``ahead`` past the next one to serve (that one whatever it takes;
        the others while slots are free)."""
        while p.sent < p.served + self.ahead and p.next_keys() is not None:
            slot = self.pool.take(urgent=p.sent == p.served)
            if slot is None:
                return
            keys, p.pending = p.pending, None
            self._send(p, slot, keys)

    def _send(self, p: _Pass, slot: Slot, keys):
        b = self.in_flight[(p.id, p.sent)] = _Batch(p.sent, slot, keys)
        w = len(self.workers)
        parts = min(w, b.n)
        for i in range(parts):
            worker = self.workers[(p.sent * parts + i) % w]
            lo, hi = i * b.n // parts, (i + 1) * b.n // parts
            b.out[lo] = (worker, hi)
            try:
                if slot.index not in worker.slots:
                    worker.conn.send(("slot", slot.index, slot.layout.x_shape,
                                      slot.layout.y_shape))
                    reduction.send_handle(worker.conn, slot.fd, worker.process.pid)
                    worker.slots.add(slot.index)
                worker.conn.send(("part", p.id, p.sent, slot.index, lo, hi, keys[lo:hi]))
            except OSError:  # its end of the pipe is closed: the worker is gone
                self._died(worker)
        p.sent += 1

    # -------------------------------------------------------------- workers

    def _start_workers(self):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("a BatchLoader with workers starts them from the main thread "
                               "(a worker dies with the thread that forked it): iterate it "
                               "first in the main thread, or use workers=0")
        ctx = multiprocessing.get_context("fork")  # the dataset is inherited, not pickled
        self.control = mmap.mmap(-1, 8)  # anonymous shared memory, inherited by the workers
        pipes = [ctx.Pipe(duplex=True) for _ in range(self.num_workers)]
        self.workers = []
        with _signal_handlers_deferred():
            for i, (here, there) in enumerate(pipes):
                others = [c for pair in pipes for c in pair if c is not there]
                seed = int(np.random.SeedSequence([self.seed, i]).generate_state(1)[0])
                process = ctx.Process(target=_worker_loop, daemon=True,
                                      args=(self.dataset, there, self.control, i, os.getpid(),
                                            seed, others),
                                      name=f"loader-worker-{i}")
                process.start()
                self.workers.append(_Worker(i, process, here))
            for _, there in pipes:
                there.close()

    def _receive(self):
        """Wait for the next answer of any worker, or the end of one, and account for it."""
        by_conn = {w.conn: w for w in self.workers}
        by_sentinel = {w.process.sentinel: w for w in self.workers}
        ready = connection.wait(list(by_conn) + list(by_sentinel))
        for r in ready:
            if r in by_conn:
                try:
                    kind, pass_id, batch, lo, error = r.recv()
                except (EOFError, OSError):
                    self._died(by_conn[r])
                b = self.in_flight[(pass_id, batch)]
                del b.out[lo]
                if kind == "error" and (b.error is None or lo < b.error_at):
                    b.error, b.error_at = error, lo  # the error of its first failing sample
        for r in ready:
            if r in by_sentinel:
                self._died(by_sentinel[r])

    def _died(self, w: _Worker):
        w.process.join(timeout=5)
        code = w.process.exitcode
        if code is not None and code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited (code {code})"
        pid = w.process.pid
        self.close()
        raise LoaderWorkerDied(
            f"data loader worker {w.index} (pid {pid}) {how} in the middle of a pass: most often "
            f"the system's out-of-memory killer; lower --num_data_workers, --prefetch_depth or "
            f"the batch size (or use data_loader_config lowmem)")

    def waiting_for(self) -> str:
        """What this loader waits for, in one line: the pass and batch, the workers alive and
        dead, the parts outstanding. Reads plain state only, never blocks: safe in a signal
        handler that interrupts a fetch (and after it, until the next pass or ``close()``)."""
        pass_id, batch = self.awaited or (self.passes, None)
        what = (f"pass {pass_id} waits for nothing" if self.awaited is None
                else f"pass {pass_id} waits for batch {batch}" if batch is not None
                else f"pass {pass_id + 1} waits for the parts of earlier passes still out")
        workers = list(self.workers or ())
        try:
            dead = set(connection.wait([w.process.sentinel for w in workers], timeout=0))
        except (OSError, ValueError):  # closed meanwhile
            dead = set()
        alive = [str(w.process.pid) for w in workers if w.process.sentinel not in dead]
        gone = [f"{w.process.pid} (worker {w.index})" for w in workers
                if w.process.sentinel in dead]
        parts = [f"worker {w.index} (pid {w.process.pid}) batch {pass_}:{b.index} rows "
                 f"{lo}:{hi} keys {b.keys[lo]!r}..{b.keys[hi - 1]!r}"
                 for (pass_, _), b in list(self.in_flight.items())
                 for lo, (w, hi) in list(b.out.items())]
        more = f" and {len(parts) - 4} more" if len(parts) > 4 else ""
        return (f"batch loader: {what}; workers alive: pids {', '.join(alive) or 'none'}; dead: "
                f"{', '.join(gone) or 'none'}; parts outstanding: "
                f"{', '.join(parts[:4]) or 'none'}{more}")

    def close(self):
        """End the workers now (SIGKILL: they hold nothing to clean up) and give back the pool;
        batches still referenced stay valid. A later ``iter()`` starts afresh. Safe to repeat
        (after an exception raised inside it, say)."""
        self.current, self.awaited = None, None
        self.in_flight.clear()
        for w in self.workers or ():
            w.process.kill()
        for w in self.workers or ():
            w.process.join(timeout=10)  # killed; one in an uninterruptible read dies after it
            w.conn.close()
        self.workers = self.control = None
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        self.in_doubt = False

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit parts of the runtime may be gone
            pass
