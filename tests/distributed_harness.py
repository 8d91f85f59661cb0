"""Run a function on N real ``torch.distributed`` ranks (gloo, CPU) from a test.

    from tests.distributed_harness import run_ranks

    def check(scale):                      # module-level, so it can be pickled
        import torch, torch.distributed as dist
        t = torch.ones(2) * dist.get_rank() * scale
        dist.all_reduce(t)
        return t

    results = run_ranks(check, 4, 2.0)     # one entry per rank, in rank order

Each rank is a new process with the caller's environment and working directory at the call,
``MASTER_ADDR=127.0.0.1``, a free port chosen at run time, ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``
set, one intra-op thread (``OMP_NUM_THREADS=1``; ranks share few cores) and the default process
group already initialised with the gloo backend. ``fn(*args)`` runs there; its return value is
pickled back.

Ranks are forked from a server process that has loaded torch and the engine once
(:mod:`preloaded`): a rank starts in a fraction of a second, where a ``spawn``-ed one spends
seconds of CPU loading torch anew. Where the caller's environment differs from the server's in a
variable that torch may read as it loads (``preloaded.IMPORT_TIME_ENV``), the ranks are spawned
instead, so that they load torch under the caller's environment.

If any rank raises, the remaining ranks are stopped and :class:`RankError` is raised in the
caller with that rank's traceback. If the ranks do not finish within ``timeout`` seconds (a
hang in a collective, for instance), all of them are stopped and ``TimeoutError`` is raised, so
a deadlock fails the test instead of hanging CI.
"""
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch.multiprocessing as mp

try:
    import preloaded
except ModuleNotFoundError:  # imported as tests.distributed_harness (benchmarks/)
    from tests import preloaded

__all__ = ["run_ranks", "find_free_port", "RankError"]

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _context():
    """The preloaded server's forkserver context; the spawn context where the caller's
    import-time environment is not the server's."""
    return preloaded.context() or mp.get_context("spawn")


class RankError(RuntimeError):
    """A rank raised; the message holds its rank and traceback."""


def find_free_port(host="127.0.0.1"):
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        return s.getsockname()[1]


def _rank_main(rank, world_size, port, out_dir, fn, args, pg_timeout, env):
    os.environ.clear()
    os.environ.update(env)  # the caller's, not the server's
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1",
    )
    if _REPO_ROOT not in sys.path:
        sys.path.insert(0, _REPO_ROOT)
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    initialized = False
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout))
        initialized = True
        result = ("ok", fn(*args))
    except BaseException as e:  # report everything, including KeyboardInterrupt/SystemExit
        result = ("error", f"{type(e).__name__}: {e}\n\n{traceback.format_exc()}")
    result += (time.time_ns(),)  # when it finished or failed: the first failure is usually the cause
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            pickle.dump(result, f)
    except Exception as e:  # unpicklable return value
        with open(tmp, "wb") as f:
            pickle.dump(("error", f"rank {rank} returned a value that cannot be pickled: {e!r}\n"
                                  f"{traceback.format_exc()}", result[2]), f)
    os.replace(tmp, path)  # the file appears only once complete
    if initialized:  # only after the result is out: tearing down makes waiting peers fail
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def run_ranks(fn, world_size, *args, timeout=120, pg_timeout=None):
    """Run ``fn(*args)`` on ``world_size`` gloo ranks and return their results in rank order.

    ``pg_timeout``: seconds a collective of the default group waits (``timeout`` by default).

    ``fn`` and ``args`` must be picklable (a module-level function, plain data or tensors).
    Inside ``fn`` use ``torch.distributed.get_rank()`` / ``get_world_size()``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="ranks-") as out_dir:
        port = find_free_port()
        procs = []
        for rank in range(world_size):
            p = ctx.Process(target=_rank_main, name=f"rank{rank}",
                            args=(rank, world_size, port, out_dir, fn, args,
                                  pg_timeout or max(timeout, 1), dict(os.environ)),
                            daemon=False)  # ranks may start their own workers (DataLoader)
            p.start()
            procs.append(p)
        paths = [os.path.join(out_dir, f"rank{r}.pkl") for r in range(world_size)]
        results = [None] * world_size
        finished_at = [None] * world_size  # when each rank finished or failed (first failure = cause)
        failed = None
        grace_end = None
        try:
            while True:
                for r, path in enumerate(paths):
                    if results[r] is None and os.path.exists(path):
                        with open(path, "rb") as f:
                            *results[r], finished_at[r] = pickle.load(f)
                        if results[r][0] == "error" and failed is None:
                            failed = r
                            grace_end = time.monotonic() + 5.0  # let peers report their own errors
                for r, p in enumerate(procs):
                    if results[r] is None and not p.is_alive() and not os.path.exists(paths[r]):
                        results[r] = ("error", f"rank {r} exited with code {p.exitcode} "
                                               "without reporting a result")
                        finished_at[r] = time.time_ns()
                        if failed is None:
                            failed = r
                            grace_end = time.monotonic() + 5.0
                if all(res is not None for res in results):
                    break
                now = time.monotonic()
                if grace_end is not None and now > grace_end:
                    break
                if now > deadline:
                    pending = [r for r, res in enumerate(results) if res is None]
                    raise TimeoutError(
                        f"ranks {pending} of {world_size} did not finish {getattr(fn, '__name__', fn)} "
                        f"within {timeout}s (a collective may be hanging)")
                time.sleep(0.02)
        finally:
            for p in procs:
                p.join(timeout=0.5)
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
        if failed is not None:
            # The rank that failed first is usually the cause; its peers then fail in collectives.
            errors = sorted((finished_at[r], r, res[1]) for r, res in enumerate(results)
                            if res is not None and res[0] == "error")
            failed = errors[0][1]
            msg = "\n".join(f"--- rank {r} ---\n{tb}" for _, r, tb in errors)
            raise RankError(f"rank {failed} of {world_size} failed in "
                            f"{getattr(fn, '__name__', fn)}:\n{msg}")
        return [res[1] for res in results]


def simulate_long_ring(ring_s: float):
    """From now on in this process, every all-reduce launched without waiting holds one of 2
    threads for ``ring_s`` from when a thread takes it up (or until it is done, if later), as
    gloo's 2 threads per group are held for a ring of hundreds of ranks (launched in order: the
    ranks' collectives still match)."""
    from concurrent.futures import ThreadPoolExecutor

    import torch.distributed as dist

    real, threads = dist.all_reduce, ThreadPoolExecutor(2)

    def held(tensor, *args, async_op=False, **kwargs):
        work = real(tensor, *args, async_op=async_op, **kwargs)
        if not async_op:
            return work

        def ring():
            until = time.perf_counter() + ring_s
            work.wait()
            time.sleep(max(0.0, until - time.perf_counter()))

        done = threads.submit(ring)

        class Held:
            def wait(self):
                done.result()
                return True

        return Held()

    dist.all_reduce = held
