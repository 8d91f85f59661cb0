"""Hostile and conflicting input: every case ends with one line starting ``error:`` that names
the value and the fix, exit code 2, and nothing on disk changed.

The table of wrong settings is generated from the config classes: every setting of both model
families gets every kind of wrong value that its type (from the annotation), bounds (field
metadata min/max/above/below/length), choices (``Literal``) and path (metadata ``path``) admit,
from the command line and from a YAML file; a setting added later is covered by it. The
hand-written rows below it are the entry arguments, broken YAML files, conflicts and resumes.
Most rows run ``from_argv`` in-process (what ``python train.py`` runs first); the rows that need
a run, and a sample of the others, run ``python train.py`` in a subprocess and compare the files
before and after.
"""
import contextlib
import dataclasses
import errno
import functools
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import typing
import warnings

import pytest
import torch
import yaml

import preloaded
from conftest import ROOT, file_digests, write_era5
from datapipe import make_data
from engine import checkpoint
from settings.config import CONFIG_CLASSES, field_types, identity_fields, to_dict
from settings.parse import build_config
from settings.cli import from_argv
from settings.errors import ConfigError, DataError, TrainingError

VIT_YAML = os.path.join(ROOT, "config", "ViT.yaml")
YAML_OF = {"vit": VIT_YAML, "unet": os.path.join(ROOT, "config", "UNet.yaml")}
TINY_VIT = ["--img_size", "[16,32]", "--patch_size", "4", "--embed_dim", "32", "--depth", "1",
            "--num_heads", "2", "--global_batch_size", "4", "--base_batch_size", "4",
            "--synthesize_if_missing", "false", "--log_every", "2"]
MODEL_ARGS = {"vit": [], "unet": ["--yaml_config", YAML_OF["unet"]]}


# ----------------------------------------------------------------------------- the schema


def _schema(cls, name):
    """(scalar type or Literal, is a list, is Optional) of a setting, from its annotation."""
    tp = field_types(cls)[name]
    optional = typing.get_origin(tp) is typing.Union and type(None) in typing.get_args(tp)
    if optional:
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    is_list = typing.get_origin(tp) is list
    if is_list:
        (tp,) = typing.get_args(tp)
    if not (tp in (bool, int, float, str) or typing.get_origin(tp) is typing.Literal):
        raise TypeError(f"{cls.__name__}.{name}: no wrong values known for {tp}: add them here")
    return tp, is_list, optional


def _not_a(tp) -> tuple:
    """What the error says of a value of the wrong type for ``tp``."""
    if typing.get_origin(tp) is typing.Literal:
        return ("is not a string", "is not one of")
    return ({bool: "is not a boolean", int: "is not an integer", float: "is not a number",
             str: "is not a string"}[tp],)


def _item_values(tp, meta):
    """(kind, value, words) of wrong values of one scalar (or list entry) of type ``tp``: command
    line strings, and values as YAML gives them (kind "yaml ...")."""
    out = []
    wrong = _not_a(tp)
    if typing.get_origin(tp) is typing.Literal:
        choices = typing.get_args(tp)
        out += [("unknown choice", "nosuch", ("is not one of",)),
                ("near choice", f"{choices[-1]}x", ("is not one of",)),
                ("empty", "", ("is not one of",)),
                ("yaml number", 5, ("is not one of",)),
                ("yaml list", ["x"], wrong)]
        return out
    if tp is str:
        return [("yaml list", ["x"], wrong), ("yaml mapping", {"a": 1}, wrong),
                ("yaml boolean", True, wrong)]
    out += [("wrong type", "abc", wrong), ("empty", "", wrong), ("yaml list", [1], wrong),
            ("yaml mapping", {"a": 1}, wrong), ("yaml string", "abc", wrong)]
    if tp is bool:
        return out + [("number", "2", wrong), ("yaml number", 2, wrong)]
    out.append(("yaml boolean", True, wrong))
    if tp is int:
        out += [("fraction", "1.5", wrong), ("yaml fraction", 1.5, wrong), ("nan", "nan", wrong),
                ("yaml nan", math.nan, wrong), ("inf", "inf", wrong)]
    else:
        finite = ("not a finite number",)
        out += [("nan", "nan", finite), ("inf", "inf", finite), ("-inf", "-inf", finite),
                ("overflow", "1e999", finite), ("yaml nan", math.nan, finite),
                ("yaml inf", math.inf, finite), ("yaml huge integer", 10**400, finite)]
    step = 1 if tp is int else 0.5
    bounds = []  # (kind, value, words)
    if "min" in meta:
        bounds.append(("below min", meta["min"] - step, "must be >="))
        if meta["min"] >= 0:
            bounds.append(("negative", -1, "must be >="))
        if meta["min"] >= 1:
            bounds.append(("zero", 0, "must be >="))
    if "above" in meta:
        bounds.append(("at above", meta["above"], "must be >"))
        if meta["above"] >= 0:
            bounds.append(("negative", -1, "must be >"))
    for bound, words in (("max", "must be <="), ("below", "must be <")):
        if bound in meta:
            edge = meta[bound] + step if bound == "max" else meta[bound]
            bounds += [(f"at {bound}" if bound == "below" else "above max", edge, words),
                       ("huge", 10**30 if tp is int else 1e300, words)]
    for kind, v, words in bounds:
        v = tp(v)
        out += [(kind, str(v), (words,)), (f"yaml {kind}", v, (words,))]
    return out


def bad_values(cls, f):
    """(kind, value, words) of every kind of wrong value for setting ``f`` of ``cls``. A value
    is a command-line string (None: the flag without its value) or, for a kind "yaml ...", the
    value a YAML file gives; ``words``: the error holds one of them (and names the setting)."""
    tp, is_list, optional = _schema(cls, f.name)
    meta = f.metadata
    out = []
    if not (tp is bool or (typing.get_origin(tp) is typing.Literal and True in typing.get_args(tp))):
        out.append(("no value", None, ("needs a value",)))
    if not optional:
        out.append(("yaml null", None, ("is not a list",) if is_list else _not_a(tp) + (
            ("is not one of",) if typing.get_origin(tp) is typing.Literal else ())))
    if meta.get("path") in ("dir", "out"):
        out += [("a file", "{tmp}/afile", ("is a file, not a directory",)),
                ("below a file", "{tmp}/afile/below", ("is a file, not a directory",))]
    if not is_list:
        return out + _item_values(tp, meta)
    default = f.default_factory()
    out += [("yaml scalar", 5, ("is not a list",)), ("yaml mapping", {"a": 1}, ("is not a list",))]
    if "length" in meta:
        n, words = meta["length"], (f"must have {meta['length']} entries",)
        for kind, items in (("too short", default[:n - 1]), ("too long", default + default[:1]),
                            ("empty list", [])):
            out += [(kind, f"[{','.join(map(str, items))}]", words), (f"yaml {kind}", items, words)]
    rest = default[1:]
    for kind, v, words in _item_values(tp, meta):
        if kind.startswith("yaml"):
            out.append((f"{kind} entry", [v, *rest], words))
        elif kind != "empty":  # "[]" or "[, x]": a list's own cases
            out.append((f"{kind} entry", f"[{','.join(map(str, [v, *rest]))}]", words))
    return out


def _schema_rows():
    rows = []
    for model, cls in CONFIG_CLASSES.items():
        for f in dataclasses.fields(cls):
            if f.name not in identity_fields(cls):
                rows += [(model, f.name, kind, value, words)
                         for kind, value, words in bad_values(cls, f)]
    return rows


SCHEMA_ROWS = _schema_rows()


@functools.lru_cache(maxsize=None)
def _yaml_base(model, tmp):
    """The model's quickstart config as YAML holds it, writing under ``tmp``."""
    base = to_dict(build_config(YAML_OF[model], "quickstart"), identity=False)
    return dict(base, expdir=f"{tmp}/exp", data_root=f"{tmp}/era5")


def _stat_snapshot(root) -> dict:
    return {os.path.join(d, n): (s.st_size, s.st_mtime_ns, s.st_mode)
            for d, dirs, files in os.walk(root) for n in dirs + files
            for s in [os.lstat(os.path.join(d, n))]}


@pytest.fixture(scope="module")
def yaml_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("yaml_rows")


@pytest.mark.parametrize("model,key,kind,value,words", SCHEMA_ROWS,
                         ids=[f"{m}-{k}-{kind}" for m, k, kind, _, _ in SCHEMA_ROWS])
def test_every_setting_refuses_every_kind_of_wrong_value(tmp, yaml_dir, model, key, kind, value,
                                                         words):
    if kind.startswith("yaml"):
        path = yaml_dir / "bad.yaml"
        path.write_text(yaml.safe_dump({"bad": {**_yaml_base(model, tmp), key: value}}))
        argv = ["--yaml_config", str(path), "--config", "bad"]
    else:
        argv = MODEL_ARGS[model] + ["--expdir", f"{tmp}/exp", "--data_root", f"{tmp}/era5"]
        argv += [f"--{key}"] if value is None else [f"--{key}", value.format(tmp=tmp)]
    before = _stat_snapshot(tmp)
    code, stderr = _error_of(argv)
    line = stderr.strip()
    assert code == 2 and "\n" not in line and line.startswith("error: "), stderr
    assert re.search(rf"(?<![\w]){key}(?![\w])", line), f"the line does not name {key}: {line}"
    assert any(w in line for w in words), f"expected one of {words}: {line}"
    assert _stat_snapshot(tmp) == before


def test_the_table_covers_every_setting_and_every_kind():
    for model, cls in CONFIG_CLASSES.items():
        covered = {key for m, key, *_ in SCHEMA_ROWS if m == model}
        assert covered == {f.name for f in dataclasses.fields(cls)} - set(identity_fields(cls))
    kinds = {(m, k): {kind for mm, kk, kind, _, _ in SCHEMA_ROWS if (mm, kk) == (m, k)}
             for m, k, *_ in SCHEMA_ROWS}
    assert {"nan", "inf", "yaml huge integer", "negative", "at above", "zero"} <= \
        kinds["vit", "layer_norm_eps"] | kinds["vit", "lr"] | kinds["vit", "depth"]
    assert {"zero", "negative", "above max", "huge", "wrong type", "fraction"} <= \
        kinds["vit", "n_in_channels"]
    assert {"unknown choice", "empty", "yaml list"} <= kinds["unet", "device_volume_dtype"]
    assert {"too short", "too long", "empty list", "zero entry"} <= kinds["unet", "synthetic_size"]
    assert {"a file", "below a file"} <= kinds["vit", "data_root"] & kinds["vit", "profile_trace"]
    assert len(SCHEMA_ROWS) > 1000


# ----------------------------------------------------------------------------- hand-written


# Hand-written rows: (argv, expected substring); "{tmp}" is a directory the test makes, holding
# a file "afile", an empty directory "adir", the tiny data set "era5" and the broken YAML files
# of BROKEN_YAML.
CASES = [
    (["--config"], "--config needs a value"),
    (["--yaml_config"], "--yaml_config needs a value"),
    (["--yaml_config", "{tmp}/adir"], "is a directory"),
    (["--yaml_config", "{tmp}/missing.yaml"], "no such file"),
    (["--config", "nonexistent"], "no such config"),
    (["--global_batch_size", "16", "--local_batch_size", "4"], "keep one"),
    (["--enable_amp", "--amp_mode", "bf16"], "--enable_amp means amp_mode=fp16 but amp_mode=bf16"),
    (["--amp_mode", "bf16", "--enable_amp"], "--enable_amp means amp_mode=fp16 but amp_mode=bf16"),
    (["--num_epochs", "2", "--num_iters", "3"], "keep one"),
    (["--no_such_setting", "1"], "unknown setting 'no_such_setting'"),
    (["lr", "1e-3"], "unexpected argument 'lr'"),
]
BROKEN_YAML = {  # file -> (its text, what the one line says after "--yaml_config <file>")
    "tab.yaml": ("quickstart:\n  lr: 1e-3\n\tdepth: 2\n",
                 " is not valid YAML: line 3, column 1: found character '\\t' that cannot start "
                 "any token (indent with spaces, not tabs)"),
    "bracket.yaml": ("quickstart:\n  img_size: [16, 32\n  depth: 2\n",
                     " is not valid YAML: line 3, column 8: expected ',' or ']', but got ':' "
                     "(while parsing a flow sequence that starts at line 2, column 13)"),
    "tag.yaml": ("quickstart:\n  lr: !!python/object/apply:os.system ['touch {tmp}/pwned']\n",
                 " is not valid YAML: line 2, column 7: could not determine a constructor for the "
                 "tag 'tag:yaml.org,2002:python/object/apply:os.system' (tags such as "
                 "!!python/object are not read: write plain values, lists and mappings)"),
    "empty.yaml": ("", " is empty: it must map config names to their settings"),
    "list.yaml": ("- quickstart\n- lr: 1\n", " holds a list, not a mapping of config names"),
    "scalar.yaml": ("quickstart: 3\n", ": config 'quickstart' holds a number, not a mapping"),
}
CASES += [(["--yaml_config", f"{{tmp}}/{name}"], f"--yaml_config {{tmp}}/{name}{words}")
          for name, (_, words) in BROKEN_YAML.items()]


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
    for name, (text, _) in BROKEN_YAML.items():
        (base / name).write_text(text.format(tmp=base))
    return str(base)


@pytest.mark.parametrize("argv,expected", CASES, ids=lambda v: " ".join(v) if isinstance(v, list)
                         else None)
def test_hostile_case(tmp, argv, expected):
    _assert_one_error_line(*_error_of([a.format(tmp=tmp) for a in argv]), expected.format(tmp=tmp))
    assert not os.path.exists(f"{tmp}/pwned")  # the YAML tag ran nothing


# ----------------------------------------------------------------------------- real runs


# Run as "python SETUP_SCRIPT SETUP script args": sets this process up as SETUP (JSON) says, then
# runs the script as "python script args" would. What a fresh process would have had set before
# its interpreter started (a file size limit, root's capabilities dropped) is set here, so that
# such a run, too, forks from the preloaded server instead of loading torch anew.
SETUP_SCRIPT = """import ctypes, json, os, resource, runpy, sys
setup = json.loads(sys.argv[1])
if setup.get("fsize") is not None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (setup["fsize"], setup["fsize"]))
if setup.get("drop_capabilities"):  # as setpriv --inh-caps=-all --bounding-set=-all
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in range(64):
        libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP; EINVAL past the last capability
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    if libc.capset(header, (ctypes.c_uint32 * 6)()) != 0:  # effective, permitted, inheritable
        raise OSError(ctypes.get_errno(), "capset")
sys.argv = sys.argv[2:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="module")
def setup_script(tmp_path_factory):
    path = tmp_path_factory.mktemp("setup") / "setup.py"
    path.write_text(SETUP_SCRIPT)
    return str(path)


def run_script(setup_script, argv, fsize=None, drop_capabilities=False, timeout=300):
    """``python argv`` (a script and its arguments) at the repository root, forked from the
    preloaded server, its files limited to ``fsize`` bytes and, with ``drop_capabilities``,
    without root's capabilities."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    setup = json.dumps({"fsize": fsize, "drop_capabilities": drop_capabilities})
    return preloaded.run([sys.executable, setup_script, setup, *argv], cwd=ROOT,
                         capture_output=True, text=True, env=env, timeout=timeout)


def train(args, check=False, timeout=300, setup_script=None, **setup):
    """``python train.py args``, forked from the preloaded server (through ``setup_script`` where
    ``setup`` sets the process up)."""
    if setup:
        r = run_script(setup_script, ["train.py", *args], timeout=timeout, **setup)
    else:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        r = preloaded.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True,
                          text=True, env=env, timeout=timeout)
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def snapshot(*roots) -> dict:
    """Every file under ``roots`` with its content hash."""
    return {root: file_digests(root) for root in roots}


def _as_a_plain_user() -> bool:
    """Whether a process must drop capabilities for file permissions to apply to it: root's
    capabilities ignore them."""
    return os.geteuid() == 0


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
    (["--yaml_config", "{tmp}/tag.yaml"], "could not determine a constructor for the tag"),
    (["--yaml_config", "{tmp}/tab.yaml"], "line 3, column 1: found character '\\t'"),
]


@pytest.mark.parametrize("argv,expected", SUBPROCESS_CASES,
                         ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_train_refuses_with_one_line_and_changes_nothing(tmp, run_args, argv, expected):
    args, exp = run_args
    before = snapshot(tmp, exp)
    r = train(args + [a.format(tmp=tmp) for a in argv])
    _assert_one_error_line(r.returncode, r.stderr, expected)
    assert snapshot(tmp, exp) == before


def test_unwritable_expdir_is_refused(tmp, run_args, tmp_path, setup_script):
    args, _ = run_args
    ro = tmp_path / "readonly"
    ro.mkdir()
    os.chmod(ro, 0o555)
    r = train(args + ["--expdir", str(ro / "runs")], setup_script=setup_script,
              drop_capabilities=_as_a_plain_user())
    _assert_one_error_line(r.returncode, r.stderr, "is not writable by this user")
    assert os.listdir(ro) == []


@pytest.mark.parametrize("case", ["parent", "itself"])
def test_unwritable_data_root_for_synthesis_is_refused(tmp, run_args, tmp_path, setup_script,
                                                        case):
    """Synthetic data must be written where it cannot be: beside data_root (where it is made and
    renamed into place) or into data_root itself (an existing empty directory)."""
    args, _ = run_args
    ro = tmp_path / "readonly"
    ro.mkdir()
    root = ro / "era5" if case == "parent" else ro
    os.chmod(ro, 0o555)
    r = train(args + ["--data_root", str(root), "--synthesize_if_missing", "true"],
              setup_script=setup_script, drop_capabilities=_as_a_plain_user())
    expected = {"parent": f"data_root={root}: {ro} is not writable by this user: choose a "
                          f"--data_root in a directory you can write to",
                "itself": f"data_root={root} is not writable by this user, and synthetic data "
                          f"must be written there (synthesize_if_missing): choose a --data_root"}
    _assert_one_error_line(r.returncode, r.stderr, expected[case])
    assert "Traceback" not in r.stdout + r.stderr
    assert os.listdir(ro) == [] and sorted(os.listdir(tmp_path)) == ["logs", "readonly"]


@pytest.mark.parametrize("failure,error,words", [
    (OSError(errno.EROFS, "Read-only file system"), ConfigError, "synthetic data cannot be "
     "written there (Read-only file system: {path}): choose a --data_root in a directory you "
     "can write to"),
    (PermissionError(errno.EACCES, "Permission denied"), ConfigError, "(Permission denied: "
     "{path}): choose a --data_root in a directory you can write to"),
    (OSError(errno.ENOSPC, "No space left on device"), DataError, "writing synthetic data failed "
     "(No space left on device: {path}): free space there or choose another --data_root; no "
     "partial data set was left"),
])
def test_synthesis_that_cannot_write_is_one_line(tmp_path, monkeypatch, failure, error, words):
    """As a read-only file system, permissions or a full disk stop the write (root ignores
    permissions, so the failure is injected): one line naming data_root, the path and the fix;
    no partial data set, no staging directory, no lock left."""
    cfg = build_config(VIT_YAML, "quickstart", {"img_size": "[16,32]",
                                                "data_root": str(tmp_path / "era5"),
                                                "expdir": str(tmp_path / "logs")})
    real_rename = os.rename

    def rename(src, dst):  # the step that publishes the finished set
        if os.path.basename(dst) == "era5":
            failure.filename = dst
            raise failure
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(error) as e:
        make_data.make_data_once(cfg)
    message = str(e.value)
    assert message.startswith(f"data_root={cfg.data_root}: ") and "\n" not in message
    assert words.format(path=cfg.data_root) in message, message
    assert os.listdir(tmp_path) == []


def test_model_too_large_to_allocate_names_the_size_settings(tmp, run_args):
    """The model's first weight (the patch embedding's, embed_dim x channels x patch^2 floats:
    some 1e15 bytes) cannot be allocated on any machine: the build fails at once, without first
    filling gigabytes of weights that do fit."""
    args, _ = run_args
    before = snapshot(tmp)
    r = train(args + ["--embed_dim", "1000000000000", "--num_heads", "1"])
    _assert_one_error_line(r.returncode, r.stderr, "out of memory on cpu")
    assert "embed_dim=1000000000000" in r.stderr and "depth=1" in r.stderr
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


def test_checkpoint_that_does_not_fit_keeps_the_previous_one(tmp, run_args, setup_script):
    """The resumed run may write files of at most 64 kB: its logs fit, its checkpoint does not
    (as on a full disk, the write fails part-way)."""
    args, exp = run_args
    train(args, check=True)
    ckpts = os.path.join(exp, "quickstart", "1", "0", "checkpoints")
    first = checkpoint.path_for(ckpts, 2)
    assert os.path.getsize(first) > 64_000
    before = snapshot(ckpts)
    r = train(args + ["--resume", "--num_iters", "4"], setup_script=setup_script, fsize=64_000)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: cannot write the checkpoint "
                               f"{checkpoint.path_for(ckpts, 4)}")
    assert f"needs about {os.path.getsize(first) / 1e6:.1f} MB" in lines[0]
    assert "MB free there" in lines[0] and f"the newest checkpoint {first} is kept" in lines[0]
    assert snapshot(ckpts) == before  # no partial file, no temporary file, the old one intact
    assert checkpoint.load_latest(ckpts)[1] == first


def test_checkpoint_into_an_unwritable_directory(tmp_path, setup_script):
    """checkpoint.save in a process without write permission on the directory."""
    ckpts = tmp_path / "ckpts"
    state = {"model": {"w": torch.zeros(1000)}}
    checkpoint.save(str(ckpts), 1, state, keep=3)
    os.chmod(ckpts, 0o555)
    script = tmp_path / "save.py"
    script.write_text(f"import sys, torch\nsys.path.insert(0, {ROOT!r})\n"
                      "from engine import checkpoint\nfrom settings.errors import TrainingError\n"
                      "try:\n checkpoint.save(sys.argv[1], 2, {'w': torch.zeros(1000)}, 3)\n"
                      "except TrainingError as e:\n print(e)\n")
    r = run_script(setup_script, [str(script), str(ckpts)], drop_capabilities=_as_a_plain_user(),
                   timeout=120)
    assert "cannot write the checkpoint" in r.stdout and "Permission denied" in r.stdout, r
    assert "ckpt_00000001.pt is kept" in r.stdout
    assert sorted(os.listdir(ckpts)) == ["ckpt_00000001.pt"]


def test_state_size_estimates_the_first_checkpoint(tmp_path):
    state = {"model": {"w": torch.zeros(250_000)}, "rng": [torch.zeros(10, dtype=torch.uint8)]}
    assert checkpoint.state_nbytes(state) == 1_000_010
    (tmp_path / "afile").write_text("a file where the checkpoint directory would go\n")
    with pytest.raises(TrainingError, match=r"needs about 1\.0 MB.*no earlier checkpoint"):
        checkpoint.save(str(tmp_path / "afile" / "ckpts"), 1, state, 3)


def test_newest_checkpoint_of_random_bytes_is_skipped_with_one_line(tmp_path, caplog):
    """Bytes that are no checkpoint (random, zip of something else, cut short): the warning is
    one line naming the file, without torch's advice to unpickle it or to file an issue."""
    ckpts = str(tmp_path / "ckpts")
    state = {k: 0 for k in checkpoint.REQUIRED}
    checkpoint.save(ckpts, 1, state, keep=9)
    good = open(checkpoint.path_for(ckpts, 1), "rb").read()
    for i, content in enumerate((os.urandom(4096), b"\x80\x02" + os.urandom(4096),
                                 good[:len(good) // 2], b""), start=2):
        with open(checkpoint.path_for(ckpts, i), "wb") as f:
            f.write(content)
        caplog.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch's own warnings are kept out too
            loaded, path = checkpoint.load_latest(ckpts)
        assert path == checkpoint.path_for(ckpts, 1) and loaded["iteration"] == 0
        (record,) = [r for r in caplog.records if r.levelname == "WARNING"]
        text = record.getMessage()
        assert text.startswith(f"skipping unreadable checkpoint {checkpoint.path_for(ckpts, i)}: "
                               f"it is not a complete checkpoint"), text
        assert "\n" not in text and "issue" not in text and "weights_only" not in text, text
        os.remove(checkpoint.path_for(ckpts, i))


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
    proc = preloaded.Popen(
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
