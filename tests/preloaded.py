"""Processes forked from a server that has loaded torch and the engine once.

A test that runs ``python train.py ...`` spends about 6 s of CPU on a 2-core machine loading torch
and the engine before the run's first line; a tiny run's steps take far less. The functions here
start such processes from a server (multiprocessing's ``forkserver``) that imported ``PRELOAD``
once: a process starts in a fraction of a second.

    from preloaded import run, Popen        # tests/ is on sys.path, as for the harness

    r = run([sys.executable, "train.py", "--num_iters", "4"], cwd=ROOT, capture_output=True,
            text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))

``run`` and ``Popen`` take the arguments of ``subprocess.run`` and ``subprocess.Popen`` that the
tests use (``cwd``, ``env``, ``stdout``/``stderr`` as ``PIPE``, ``DEVNULL``, ``STDOUT``, a file or
None, ``text``, ``timeout``, ``start_new_session``) and give the same results. A forked process is
what a fresh ``python script.py args`` or ``python -m module args`` is in: ``sys.argv``, the
environment (the one passed, not the server's), the working directory, ``sys.path`` (the script's
directory, or the working directory for ``-m``, first), the standard streams on the given files
(buffered as a fresh interpreter buffers them, ``PYTHONUNBUFFERED`` included), ``__main__`` (for
``-m`` the module runs anew even where the server had loaded it), the multiprocessing main process
with the platform's start method and its own resource tracker, SIGINT's Python handler, the exit
code (``sys.exit``'s; 1 after an uncaught exception, its traceback on stderr; minus the signal's
number when a signal ended it), and its end: non-daemon threads joined, then ``atexit`` handlers,
then the streams flushed.

What differs: the modules of ``PRELOAD`` are already in ``sys.modules`` (and warnings they gave as
they loaded are not given again), its stdin is ``/dev/null`` (a fresh one inherits the caller's),
and the process is the server's child, not the caller's (its pid works with ``os.kill`` and
``os.killpg``, not ``os.waitpid``). So a test about what a fresh interpreter loads, or about its
start-up, uses ``subprocess``. A fresh process is started with ``subprocess`` instead where the
command is not a plain script or ``-m`` run of this interpreter, where ``preexec_fn`` is given, or
where the environment differs from the server's in a variable that torch or Python reads as it
loads (``IMPORT_TIME_ENV``): the result is the same either way, only slower. ``OMP_NUM_THREADS`` is
the exception: where the server was started without it, the process applies it with
``torch.set_num_threads``, as torch does at load.

Ranks of :func:`distributed_harness.run_ranks` fork from the same server.
"""
import atexit
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time

from multiprocessing import get_context, reduction

__all__ = ["run", "Popen", "context", "IMPORT_TIME_ENV"]

# What the server loads before it forks: the engine through train.py, and with it torch and every
# part of torch that the engine or an optimizer loads (dynamo, DTensor, DCP, FSDP).
PRELOAD = ("train",)
IMPORT_TIME_ENV = ("TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "CUDA", "LD_", "PYTHON")
APPLIED_AT_START = ("PYTHONUNBUFFERED",)  # applied by the forked process itself (streams)
_server_env = None  # the environment the server was started with


def _applied_at_start():
    """The import-time variables a forked process applies itself: ``OMP_NUM_THREADS`` too where
    the server was started without it (``torch.set_num_threads``, as torch does at load)."""
    omp = () if "OMP_NUM_THREADS" in _server_env else ("OMP_NUM_THREADS",)
    return APPLIED_AT_START + omp


def _import_time_env(env):
    applied = _applied_at_start()
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV) and k not in applied}


def context(env=None):
    """The forkserver context, its server started on first use with ``PRELOAD`` under the
    environment of that moment; None where ``env`` (``os.environ`` by default) differs from the
    server's in an import-time variable."""
    global _server_env
    if _server_env is None:
        from multiprocessing import forkserver
        forkserver.set_forkserver_preload(list(PRELOAD))
        _server_env = dict(os.environ)
        forkserver.ensure_running()
    env = os.environ if env is None else env
    if _import_time_env(env) != _import_time_env(_server_env):
        return None
    return get_context("forkserver")


# ----------------------------------------------------------------------------- the forked process

class _Fd:
    """A file descriptor sent to the forked process (by SCM_RIGHTS, through the server)."""

    def __init__(self, fd):
        self.fd = fd

    def __reduce__(self):
        return _Fd._received, (reduction.DupFd(self.fd),)

    @staticmethod
    def _received(dup):
        return _Fd(dup.detach())


def _stream(fd, unbuffered, line_buffering, encoding, errors):
    """Standard stream ``fd`` as a fresh interpreter opens it."""
    raw = io.FileIO(fd, "wb" if fd else "rb", closefd=False)
    if fd == 0:
        return io.TextIOWrapper(io.BufferedReader(raw), encoding=encoding, errors=errors)
    buffered = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(buffered, encoding=encoding, errors=errors,
                            line_buffering=line_buffering, write_through=unbuffered)


def _exit_code(code):
    """What the interpreter makes of ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _main(argv, env, cwd, fds, new_session, threads, path):
    """Run ``argv`` (``[script, *args]`` or ``["-m", module, *args]``) as ``python argv`` would,
    then end the process as the interpreter ends. ``threads``: ``OMP_NUM_THREADS`` to apply, or
    None; ``path``: a fresh interpreter's ``sys.path`` after its first entry."""
    import runpy
    from multiprocessing import context as mp_context, process, resource_tracker

    # This process is no multiprocessing child: the main process of its own, with the platform's
    # default start method for the processes it starts (loader workers).
    main = process.current_process()
    main._identity, main._name, main._parent_pid, main._parent_name = (), "MainProcess", None, None
    main._config = {"authkey": process.AuthenticationString(os.urandom(32)), "semprefix": "/mp"}
    process._parent_process, process._children = None, set()
    mp_context._default_context._actual_context = None
    tracker = resource_tracker._resource_tracker  # its own, started on first use, not the server's
    if tracker._fd is not None:
        os.close(tracker._fd)
    tracker._fd = tracker._pid = None

    if new_session:
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd.fd, target)
        if fd.fd > 2 and fd.fd not in [f.fd for f in fds[target + 1:]]:
            os.close(fd.fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    encoding, errors = sys.__stdout__.encoding, sys.__stdout__.errors
    sys.stdin = sys.__stdin__ = _stream(0, False, False, encoding, errors)
    sys.stdout = sys.__stdout__ = _stream(1, unbuffered, os.isatty(1), encoding, errors)
    sys.stderr = sys.__stderr__ = _stream(2, unbuffered, True, encoding, "backslashreplace")
    if threads is not None:
        import torch
        torch.set_num_threads(threads)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's path in argv[0]
            sys.path[:] = [cwd, *path]
            sys.modules.pop(argv[1], None)  # not loaded before it runs, as in a fresh interpreter
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[:] = [os.path.dirname(os.path.abspath(argv[0])), *path]
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException as e:
        tb = e.__traceback__  # from the script's first frame, as the interpreter prints it
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>"):
            tb = tb.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        code = 1
        if isinstance(e, KeyboardInterrupt):  # the interpreter ends itself by the signal
            code = -signal.SIGINT
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


# ----------------------------------------------------------------------------- the caller's side

def _script_argv(args):
    """``args`` after the interpreter when it is a plain script or ``-m`` run, else None."""
    args = list(args)
    if not args or os.path.realpath(args[0]) != os.path.realpath(sys.executable):
        return None
    if len(args) >= 3 and args[1] == "-m":
        return args[1:]
    if len(args) >= 2 and not args[1].startswith("-"):
        return args[1:]
    return None


def _fresh_path(_cache=[]):
    """A fresh interpreter's ``sys.path`` after its first entry, under the server's environment
    (which has the caller's ``PYTHONPATH``: an import-time variable)."""
    if not _cache:
        code = "import json, sys; print(json.dumps(sys.path[1:]))"
        out = subprocess.run([sys.executable, "-c", code], env=_server_env, capture_output=True,
                             text=True, check=True).stdout
        _cache.append(json.loads(out))
    return _cache[0]


class Popen:
    """``subprocess.Popen`` for ``[sys.executable, script, ...]`` forked from the server (see the
    module's docstring); a ``subprocess.Popen`` otherwise. ``pid``, ``stdout``, ``stderr``,
    ``returncode``, ``poll``, ``wait``, ``communicate``, ``send_signal``, ``terminate`` and
    ``kill`` behave as ``subprocess.Popen``'s do."""

    def __init__(self, args, *, cwd=None, env=None, stdout=None, stderr=None, text=False,
                 start_new_session=False, preexec_fn=None):
        self.args = args
        env = dict(os.environ if env is None else env)
        argv = _script_argv(args) if preexec_fn is None else None
        ctx = context(env) if argv is not None else None
        self._popen = None
        if ctx is None:
            self._popen = subprocess.Popen(args, cwd=cwd, env=env, stdout=stdout, stderr=stderr,
                                           text=text, start_new_session=start_new_session,
                                           preexec_fn=preexec_fn)
            self.pid, self.stdout, self.stderr = (self._popen.pid, self._popen.stdout,
                                                  self._popen.stderr)
            return
        self.stdout = self.stderr = None
        mine, theirs = [], []  # descriptors this side closes once the process has its copies
        devnull = os.open(os.devnull, os.O_RDWR)
        mine.append(devnull)

        def child_fd(spec, fallback):
            if spec is None:
                return fallback
            if spec == subprocess.DEVNULL:
                return devnull
            if spec == subprocess.PIPE:
                r, w = os.pipe()
                mine.append(w)
                theirs.append(r)
                return w
            return spec if isinstance(spec, int) else spec.fileno()

        out = child_fd(stdout, 1)
        if stdout == subprocess.PIPE:
            self.stdout = self._reader(theirs[-1], text)
        err = out if stderr == subprocess.STDOUT else child_fd(stderr, 2)
        if stderr == subprocess.PIPE:
            self.stderr = self._reader(theirs[-1], text)
        threads = env.get("OMP_NUM_THREADS") if "OMP_NUM_THREADS" in _applied_at_start() else None
        self._process = ctx.Process(
            target=_main, name=os.path.basename(argv[0] if argv[0] != "-m" else argv[1]),
            args=(argv, env, os.path.abspath(cwd or os.getcwd()),
                  [_Fd(devnull), _Fd(out), _Fd(err)], start_new_session,
                  None if threads is None else int(threads), _fresh_path()), daemon=False)
        try:
            self._process.start()
        finally:
            for fd in mine:
                os.close(fd)
        self.pid = self._process.pid

    @staticmethod
    def _reader(fd, text):
        return open(fd, "r" if text else "rb", closefd=True)

    @property
    def returncode(self):
        return self._popen.returncode if self._popen else self._process.exitcode

    def poll(self):
        if self._popen:
            return self._popen.poll()
        return self._process.exitcode

    def wait(self, timeout=None):
        if self._popen:
            return self._popen.wait(timeout)
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def communicate(self, timeout=None):
        """Read both pipes to their ends (on threads, so neither fills), then wait."""
        if self._popen:
            return self._popen.communicate(timeout=timeout)
        streams = [s for s in (self.stdout, self.stderr) if s is not None]
        results = {}

        def drain(stream):
            results[id(stream)] = stream.read()

        readers = [threading.Thread(target=drain, args=(s,), daemon=True) for s in streams]
        for t in readers:
            t.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for s in streams:
            s.close()
        return tuple(results.get(id(s)) if s is not None else None
                     for s in (self.stdout, self.stderr))

    def send_signal(self, sig):
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for s in (self.stdout, self.stderr):
            if s is not None:
                s.close()
        self.wait()


def run(args, *, cwd=None, env=None, stdout=None, stderr=None, capture_output=False, text=False,
        timeout=None, check=False, start_new_session=False, preexec_fn=None):
    """``subprocess.run`` for ``[sys.executable, script, ...]`` forked from the server (see the
    module's docstring); ``subprocess.run`` otherwise. On a timeout the process is killed and
    ``subprocess.TimeoutExpired`` raised, as ``subprocess.run`` does."""
    if capture_output:
        stdout = stderr = subprocess.PIPE
    p = Popen(args, cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=text,
              start_new_session=start_new_session, preexec_fn=preexec_fn)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise
    result = subprocess.CompletedProcess(args, p.returncode, out, err)
    if check:
        result.check_returncode()
    return result
