"""Hostile and conflicting input: every case ends with one line starting ``error:`` that names
the value and the fix, exit code 2, and nothing on disk changed.

The table of settings is generated from the config classes (every setting's type, range, NaN
and infinity, and the flag without its value), so a setting added later is covered by it; the
hand-written rows below it are the paths, conflicts and resumes. Most rows run ``from_argv``
in-process (what ``python train.py`` runs first); the rows that need a run, and a sample of the
others, run ``python train.py`` in a subprocess and compare the files before and after.
"""
import contextlib
import dataclasses
import hashlib
import io
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
import typing

import pytest
import torch

from conftest import ROOT, write_era5
from utils import checkpoint
from utils.config import CONFIG_CLASSES, field_types, from_argv, identity_fields
from utils.errors import TrainingError

VIT_YAML = os.path.join(ROOT, "config", "ViT.yaml")
TINY_VIT = ["--img_size", "[16,32]", "--patch_size", "4", "--embed_dim", "32", "--depth", "1",
            "--num_heads", "2", "--global_batch_size", "4", "--base_batch_size", "4",
            "--synthesize_if_missing", "false", "--log_every", "2"]
MODEL_ARGS = {"vit": [], "unet": ["--yaml_config", os.path.join(ROOT, "config", "UNet.yaml")]}


# ----------------------------------------------------------------------------- the table


def _plain_type(tp):
    """(type, is_list) of a field annotation, Optional removed."""
    if typing.get_origin(tp) is typing.Union:
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) is list:
        return typing.get_args(tp)[0], True
    return tp, False


def _setting_rows():
    """(model, argv, expected substring) for every setting of every model family."""
    rows = []
    for model, cls in CONFIG_CLASSES.items():
        types = field_types(cls)
        for f in dataclasses.fields(cls):
            key = f.name
            if key in identity_fields(cls):
                continue
            tp, is_list = _plain_type(types[key])
            meta = f.metadata
            if not _takes_a_bare_flag(tp):
                rows.append((model, [f"--{key}"], f"--{key} needs a value"))
            if tp is str:
                continue
            wrap = (lambda v: f"[{v}]") if is_list else (lambda v: v)
            if tp is not bool:
                rows.append((model, [f"--{key}", wrap("abc")], f"{key}"))
            if tp is float:
                rows.append((model, [f"--{key}", wrap("nan")], "not a finite number"))
                rows.append((model, [f"--{key}", wrap("inf")], "not a finite number"))
                rows.append((model, [f"--{key}", wrap("-inf")], "not a finite number"))
            if tp in (int, float):
                step = 1 if tp is int else 0.5
                for bound, delta, words in (("min", -step, "must be >="), ("max", step, "must be <="),
                                            ("above", 0, "must be >"), ("below", 0, "must be <")):
                    if bound in meta:
                        rows.append((model, [f"--{key}", wrap(str(meta[bound] + delta))], words))
            if is_list and "length" in meta:
                one = f.default_factory()[:1]  # a valid entry, one too few
                rows.append((model, [f"--{key}", str(one)], f"must have {meta['length']} entries"))
    return rows


def _takes_a_bare_flag(tp) -> bool:
    """Whether a bare ``--key`` is a value of the setting (true for a boolean)."""
    return tp is bool or (typing.get_origin(tp) is typing.Literal and True in typing.get_args(tp))


# Hand-written rows: (argv, expected substring); "{tmp}" is a directory the test makes, holding
# a file "afile", an empty directory "adir" and the tiny data set "era5".
CASES = [
    (["--config"], "--config needs a value"),
    (["--yaml_config"], "--yaml_config needs a value"),
    (["--yaml_config", "{tmp}/adir"], "is a directory"),
    (["--yaml_config", "{tmp}/missing.yaml"], "no such file"),
    (["--config", "nonexistent"], "no such config"),
    (["--expdir", "{tmp}/afile"], "is a file, not a directory"),
    (["--expdir", "{tmp}/afile/below"], "is a file, not a directory"),
    (["--lr", "nan"], "lr='nan' is not a finite number"),
    (["--dropout", "nan"], "dropout='nan' is not a finite number"),
    (["--seed", "-1"], "seed=-1 must be >= 0"),
    (["--seed", str(2**64)], "must be <= 4294967295"),
    (["--global_batch_size", "16", "--local_batch_size", "4"], "keep one"),
    (["--enable_amp", "--amp_mode", "bf16"], "--enable_amp means amp_mode=fp16 but amp_mode=bf16"),
    (["--amp_mode", "bf16", "--enable_amp"], "--enable_amp means amp_mode=fp16 but amp_mode=bf16"),
    (["--num_epochs", "2", "--num_iters", "3"], "keep one"),
    (["--no_such_setting", "1"], "unknown setting 'no_such_setting'"),
    (["lr", "1e-3"], "unexpected argument 'lr'"),
]


def _error_of(argv, model="vit"):
    """(exit code, stderr) of from_argv, the first thing train.py runs."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exc:
        from_argv(MODEL_ARGS[model] + argv, VIT_YAML)
    return exc.value.code, err.getvalue()


def _assert_one_error_line(code, stderr, expected):
    lines = stderr.strip().splitlines()
    assert code == 2, stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert expected in lines[0], lines[0]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    base = tmp_path_factory.mktemp("hostile")
    (base / "afile").write_text("not a directory\n")
    (base / "adir").mkdir()
    write_era5(str(base / "era5"))
    return str(base)


@pytest.mark.parametrize("model,argv,expected", _setting_rows(),
                         ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_every_setting_refuses_bad_values(model, argv, expected):
    _assert_one_error_line(*_error_of(argv, model), expected)


def test_the_setting_table_covers_every_setting():
    keys = {argv[0][2:] for _, argv, _ in _setting_rows()}
    for cls in CONFIG_CLASSES.values():
        settable = {f.name for f in dataclasses.fields(cls)} - set(identity_fields(cls))
        typed = {k for k in settable if _plain_type(field_types(cls)[k])[0] is not bool}
        assert typed <= keys


@pytest.mark.parametrize("argv,expected", CASES, ids=lambda v: " ".join(v) if isinstance(v, list)
                         else None)
def test_hostile_case(tmp, argv, expected):
    _assert_one_error_line(*_error_of([a.format(tmp=tmp) for a in argv]), expected)


# ----------------------------------------------------------------------------- real runs


def train(args, check=False, preexec_fn=None, timeout=300, prefix=()):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    r = subprocess.run([*prefix, sys.executable, "train.py", *args], cwd=ROOT,
                       capture_output=True, text=True, env=env, preexec_fn=preexec_fn,
                       timeout=timeout)
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def snapshot(*roots) -> dict:
    """Every file under ``roots`` with its content hash."""
    out = {}
    for root in roots:
        for d, _, files in os.walk(root):
            for name in files:
                path = os.path.join(d, name)
                with open(path, "rb") as f:
                    out[path] = hashlib.sha256(f.read()).hexdigest()
    return out


def _permissions_apply() -> tuple:
    """A command prefix under which file permissions apply to this user: none for a plain user;
    for root (whose capabilities ignore them) setpriv without capabilities; skipped otherwise."""
    if os.geteuid() != 0:
        return ()
    if shutil.which("setpriv") is None:
        pytest.skip("root ignores file permissions, and setpriv is not installed to drop that")
    return ("setpriv", "--inh-caps=-all", "--bounding-set=-all")


@pytest.fixture
def run_args(tmp, tmp_path):
    exp = str(tmp_path / "logs")
    os.makedirs(exp)
    return TINY_VIT + ["--data_root", f"{tmp}/era5", "--expdir", exp, "--num_iters", "2"], exp


SUBPROCESS_CASES = [
    (["--lr", "nan"], "lr='nan' is not a finite number"),
    (["--yaml_config"], "--yaml_config needs a value"),
    (["--yaml_config", "{tmp}/adir"], "is a directory"),
    (["--expdir", "{tmp}/afile"], "is a file, not a directory"),
    (["--global_batch_size", "16", "--local_batch_size", "4"], "keep one"),
    (["--enable_amp", "--amp_mode", "bf16"], "--enable_amp means amp_mode=fp16"),
]


@pytest.mark.parametrize("argv,expected", SUBPROCESS_CASES,
                         ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_train_refuses_with_one_line_and_changes_nothing(tmp, run_args, argv, expected):
    args, exp = run_args
    before = snapshot(tmp, exp)
    r = train(args + [a.format(tmp=tmp) for a in argv])
    _assert_one_error_line(r.returncode, r.stderr, expected)
    assert snapshot(tmp, exp) == before


def test_unwritable_expdir_is_refused(tmp, run_args, tmp_path):
    args, _ = run_args
    ro = tmp_path / "readonly"
    ro.mkdir()
    os.chmod(ro, 0o555)
    r = train(args + ["--expdir", str(ro / "runs")], prefix=_permissions_apply())
    _assert_one_error_line(r.returncode, r.stderr, "is not writable by this user")
    assert os.listdir(ro) == []


def test_model_too_large_to_allocate_names_the_size_settings(tmp, run_args):
    args, _ = run_args
    before = snapshot(tmp)
    r = train(args + ["--embed_dim", "2000000", "--num_heads", "1"])
    _assert_one_error_line(r.returncode, r.stderr, "out of memory on cpu")
    assert "embed_dim=2000000" in r.stderr and "depth=1" in r.stderr
    assert snapshot(tmp) == before


def test_resume_logs_allowed_changes_and_refuses_others(tmp, run_args):
    args, exp = run_args
    train(args, check=True)
    ckpts = os.path.join(exp, "quickstart", "1", "0", "checkpoints")
    before = snapshot(ckpts, tmp)
    r = train(args + ["--resume", "--lr", "2e-3", "--dropout", "0.1", "--log_every", "1"])
    _assert_one_error_line(r.returncode, r.stderr, "was written with other settings")
    assert "lr 0.001 -> 0.002" in r.stderr and "dropout 0.0 -> 0.1" in r.stderr
    assert "log_every" not in r.stderr  # allowed: not among the refused differences
    assert snapshot(ckpts, tmp) == before
    r = train(args + ["--resume", "--num_iters", "4", "--log_every", "1"], check=True)
    assert "resume: num_iters 2 -> 4" in r.stdout and "resume: log_every 2 -> 1" in r.stdout
    assert "resume: resume" not in r.stdout  # how the run was resumed is no change
    assert os.path.exists(checkpoint.path_for(ckpts, 4))


# ----------------------------------------------------------------------------- full disks


def _file_size_limit(nbytes):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))


def test_checkpoint_that_does_not_fit_keeps_the_previous_one(tmp, run_args):
    """The resumed run may write files of at most 64 kB: its logs fit, its checkpoint does not
    (as on a full disk, the write fails part-way)."""
    args, exp = run_args
    train(args, check=True)
    ckpts = os.path.join(exp, "quickstart", "1", "0", "checkpoints")
    first = checkpoint.path_for(ckpts, 2)
    assert os.path.getsize(first) > 64_000
    before = snapshot(ckpts)
    r = train(args + ["--resume", "--num_iters", "4"], preexec_fn=_file_size_limit(64_000))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: cannot write the checkpoint "
                               f"{checkpoint.path_for(ckpts, 4)}")
    assert f"needs about {os.path.getsize(first) / 1e6:.1f} MB" in lines[0]
    assert "MB free there" in lines[0] and f"the newest checkpoint {first} is kept" in lines[0]
    assert snapshot(ckpts) == before  # no partial file, no temporary file, the old one intact
    assert checkpoint.load_latest(ckpts)[1] == first


def test_checkpoint_into_an_unwritable_directory(tmp_path):
    """checkpoint.save in a process without write permission on the directory."""
    ckpts = tmp_path / "ckpts"
    state = {"model": {"w": torch.zeros(1000)}}
    checkpoint.save(str(ckpts), 1, state, keep=3)
    os.chmod(ckpts, 0o555)
    code = ("import sys, torch; from utils import checkpoint; from utils.errors import "
            "TrainingError\ntry:\n checkpoint.save(sys.argv[1], 2, {'w': torch.zeros(1000)}, 3)\n"
            "except TrainingError as e:\n print(e)\n")
    r = subprocess.run([*_permissions_apply(), sys.executable, "-c", code, str(ckpts)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert "cannot write the checkpoint" in r.stdout and "Permission denied" in r.stdout, r
    assert "ckpt_00000001.pt is kept" in r.stdout
    assert sorted(os.listdir(ckpts)) == ["ckpt_00000001.pt"]


def test_state_size_estimates_the_first_checkpoint(tmp_path):
    state = {"model": {"w": torch.zeros(250_000)}, "rng": [torch.zeros(10, dtype=torch.uint8)]}
    assert checkpoint.state_nbytes(state) == 1_000_010
    (tmp_path / "afile").write_text("a file where the checkpoint directory would go\n")
    with pytest.raises(TrainingError, match=r"needs about 1\.0 MB.*no earlier checkpoint"):
        checkpoint.save(str(tmp_path / "afile" / "ckpts"), 1, state, 3)


# ----------------------------------------------------------------------------- loader workers


def test_worker_errors_arrive_as_the_same_one_line(tmp_path):
    root = write_era5(str(tmp_path / "era5"))
    import h5py  # a NaN in one training file: found when its batch is read

    with h5py.File(os.path.join(root, "train", "2016.h5"), "r+") as f:
        f["fields"][3, 0, 0, 0] = float("nan")
    errors = {}
    for workers in (0, 2):
        r = train(TINY_VIT + ["--data_root", root, "--expdir", str(tmp_path / f"w{workers}"),
                              "--num_epochs", "1", "--num_data_workers", str(workers)],
                  timeout=120)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1, r.stderr
        errors[workers] = lines[0]
    assert errors[0].startswith("error: non-finite values in ") and "2016.h5" in errors[0]
    assert errors[2] == errors[0]


def _children(pid) -> set[int]:
    out = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out |= {int(p) for p in f.read().split()}
    return out


def _alive(pid) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] not in "ZX"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_loader_workers_exit_when_the_run_is_killed(tmp, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "train.py", *TINY_VIT, "--data_root", f"{tmp}/era5", "--expdir",
         str(tmp_path / "logs"), "--num_epochs", "1000", "--num_data_workers", "2"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:  # workers are running once the first epoch has started
            if "Epoch 1:" in line:
                break
        workers = _children(proc.pid)
        assert len(workers) >= 2
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.time() + 2
    while any(_alive(w) for w in workers) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(_alive(w) for w in workers)
