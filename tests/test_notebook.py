"""start_tensorboard.ipynb, executed headless against a log root that already holds a run: it
finds the job script's log root, serves that run and the examples side by side on a free local
port, says where to open it, and writes nothing into the run or the examples."""
import hashlib
import json
import os
import shutil
import socket

import pytest

from conftest import ROOT

# (requirements-test.txt installs them; a GPU node's bare environment may not have them, and
# `pytest -m gpu` collects this file too)
nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (requirements-test.txt)")
nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (requirements-test.txt)")

EXAMPLE_RUN = os.path.join("ViT", "quickstart", "1", "0")  # where a user's run sits in the log root
EXAMPLE_SOURCE = os.path.join("quickstart", "quickstart", "1", "vit")  # in example_logs/


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_free_port_from_6006():
    for port in range(6006, 6106):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port in 6006-6105")


def snapshot(root):
    """{relative path: (sha256, mtime)} of every file under root."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = (hashlib.sha256(fh.read()).hexdigest(),
                                                 os.stat(p).st_mtime_ns)
    return out


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A copy of the notebook and the examples, and a clean environment for the log root."""
    work = tmp_path / "repo"
    work.mkdir()
    shutil.copy(os.path.join(ROOT, "start_tensorboard.ipynb"), work)
    shutil.copytree(os.path.join(ROOT, "example_logs"), work / "example_logs")
    for var in ("EXPDIR", "SCRATCH", "TENSORBOARD_PORT", "TENSORBOARD_BIND_ALL",
                "TENSORBOARD_MODEL", "TENSORBOARD_EXAMPLES",
                "JUPYTERHUB_SERVICE_PREFIX", "JUPYTERHUB_PUBLIC_URL", "JUPYTERHUB_HOST"):
        monkeypatch.delenv(var, raising=False)
    return work


def existing_run(log_root):
    """A user's finished run: a copy of an example run, at the path train.py writes."""
    run = log_root / EXAMPLE_RUN
    shutil.copytree(os.path.join(ROOT, "example_logs", EXAMPLE_SOURCE), run)
    (run / "out.log").write_text("the user's own log\n")
    return run


def execute(work, cells=None, probe=False):
    """Runs the notebook (or its first `cells` code cells); with probe, asks the running
    TensorBoard for its runs and settings before the last cell stops it. Returns the text."""
    nb = nbformat.read(work / "start_tensorboard.ipynb", as_version=4)
    if cells is not None:
        code = [c for c in nb.cells if c.cell_type == "code"]
        nb.cells = code[:cells]
    if probe:
        nb.cells.insert(len(nb.cells) - 1, nbformat.v4.new_code_cell(
            "for what in ('runs', 'environment'):\n"
            "    with urllib.request.urlopen(f'http://127.0.0.1:{PORT}/data/{what}') as r:\n"
            "        print(what.upper(), json.dumps(json.load(r)))"))
    nbclient.NotebookClient(nb, kernel_name="python3", timeout=180, resources={
        "metadata": {"path": str(work)}}).execute()
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def probed(text, what):
    return json.loads(text.split(what.upper() + " ", 1)[1].splitlines()[0])


def nothing_listens_on(port):
    """No socket listens on ``port``. A connection the stopped server closed may still hold it in
    TIME_WAIT for a minute; a server binds it all the same (SO_REUSEADDR, as TensorBoard's does),
    and so does this check."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_serves_the_users_run_beside_the_examples_and_changes_neither(repo, tmp_path,
                                                                      monkeypatch):
    scratch = tmp_path / "scratch"
    log_root = scratch / "dl-at-scale" / "logs"
    existing_run(log_root)
    monkeypatch.setenv("SCRATCH", str(scratch))  # the job script's log root on Perlmutter
    monkeypatch.setenv("TENSORBOARD_MODEL", "all")  # every model's runs,
    monkeypatch.setenv("TENSORBOARD_EXAMPLES", "1")  # and the examples beside them
    monkeypatch.setenv("JUPYTERHUB_SERVICE_PREFIX", "/user/alice/gpu/")
    monkeypatch.setenv("JUPYTERHUB_PUBLIC_URL", "https://hub.example.org/")
    before_runs, before_examples = snapshot(log_root), snapshot(repo / "example_logs")
    busy = first_free_port_from_6006()
    with socket.socket() as taken:  # the port a default TensorBoard would take is in use
        taken.bind(("127.0.0.1", busy))
        taken.listen()
        text = execute(repo, probe=True)
    port = probed(text, "environment")["debug"]["flags"]["port"]
    assert port != busy and 6006 <= port < 6106
    assert f"your runs: 1 run(s) under {log_root}" in text
    examples = sum(os.path.basename(d) == "tensorboard" for d, _, _ in os.walk(repo / "example_logs"))
    assert examples >= 10 and f"examples: {examples} run(s) under {repo / 'example_logs'}" in text
    assert f"https://hub.example.org/user/alice/gpu/proxy/{port}/" in text
    runs = probed(text, "runs")
    assert f"runs/{EXAMPLE_RUN}/tensorboard" in runs
    assert {"examples/quickstart/quickstart/1/vit/tensorboard",
            "examples/quickstart/quickstart/1/unet/tensorboard",
            "examples/data_parallel/quickstart/4/0/tensorboard",
            "examples/model_parallel/mp_cpu/2/0/tensorboard"} <= set(runs)
    flags = probed(text, "environment")["debug"]["flags"]
    assert flags["host"] == "127.0.0.1" and not flags["bind_all"]
    assert f"port {port} is free again" in text and nothing_listens_on(port)
    assert snapshot(log_root) == before_runs
    assert snapshot(repo / "example_logs") == before_examples
    assert sorted(os.listdir(repo)) == ["example_logs", "start_tensorboard.ipynb"]


def test_explicit_port_and_all_interfaces_only_when_asked(repo, tmp_path, monkeypatch):
    port = free_port()
    monkeypatch.setenv("EXPDIR", str(tmp_path / "none-yet"))
    monkeypatch.setenv("TENSORBOARD_PORT", str(port))
    monkeypatch.setenv("TENSORBOARD_BIND_ALL", "1")
    text = execute(repo, probe=True)
    flags = probed(text, "environment")["debug"]["flags"]
    assert flags["port"] == port and flags["bind_all"]
    assert "all interfaces" in text and f"http://localhost:{port}/" in text
    assert "does not exist yet" in text and not (tmp_path / "none-yet").exists()


def test_a_taken_port_is_an_error_not_someone_elses_tensorboard(repo, tmp_path, monkeypatch):
    monkeypatch.setenv("EXPDIR", str(tmp_path))
    with socket.socket() as taken, pytest.raises(nbclient.exceptions.CellExecutionError) as e:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setenv("TENSORBOARD_PORT", str(port))
        execute(repo)
    assert e.value.ename == "RuntimeError"
    assert e.value.evalue.startswith(f"TENSORBOARD_PORT={port} is taken")


def test_a_port_a_stopped_server_left_in_time_wait_is_used(repo, tmp_path, monkeypatch):
    """The notebook run again within a minute of stopping its TensorBoard: the connections that
    server closed hold its port in TIME_WAIT, and a new TensorBoard binds it all the same."""
    port = first_free_port_from_6006()
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # the server's side closes first: it waits in TIME_WAIT
        client.close()
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))  # TIME_WAIT is there: a bind without SO_REUSEADDR fails
    monkeypatch.setenv("EXPDIR", str(tmp_path))
    monkeypatch.setenv("TENSORBOARD_PORT", str(port))
    text = execute(repo, probe=True)
    assert probed(text, "environment")["debug"]["flags"]["port"] == port
    assert nothing_listens_on(port)


@pytest.mark.parametrize("env, expected", [
    ({"EXPDIR": "{tmp}/exp", "SCRATCH": "{tmp}/scratch"}, "{tmp}/exp"),
    ({"SCRATCH": "{tmp}/scratch"}, "{tmp}/scratch/dl-at-scale/logs"),
    ({}, "{repo}/logs"),
])
def test_log_root_is_the_job_scripts(repo, tmp_path, monkeypatch, env, expected):
    for var, value in env.items():
        monkeypatch.setenv(var, value.format(tmp=tmp_path))
    expected = expected.format(tmp=tmp_path, repo=repo)
    existing_run(tmp_path / "exp")
    existing_run(tmp_path / "scratch" / "dl-at-scale" / "logs")
    existing_run(repo / "logs")
    monkeypatch.setenv("TENSORBOARD_MODEL", "all")
    text = execute(repo, cells=1)
    assert f"your runs: 1 run(s) under {expected}\n    {EXAMPLE_RUN}\n" in text


def test_by_default_one_models_runs_and_no_examples(repo, tmp_path, monkeypatch):
    """The ViT's runs (the UNet's when asked), the examples only when asked."""
    monkeypatch.setenv("EXPDIR", str(tmp_path / "exp"))
    existing_run(tmp_path / "exp")  # a ViT run
    unet = tmp_path / "exp" / "UNet" / "quickstart" / "1" / "0"
    shutil.copytree(tmp_path / "exp" / EXAMPLE_RUN, unet)
    nb = nbformat.read(repo / "start_tensorboard.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    spec = code[1].source.split("def logdir_spec", 1)[1].split("\n\n\n", 1)[0]
    code[0].source += f"\n\n\ndef logdir_spec{spec}\n\n\nprint('SPEC', logdir_spec())"
    nbformat.write(nb, repo / "start_tensorboard.ipynb")
    text = execute(repo, cells=1)  # the listing and what TensorBoard would read; none started
    vit = tmp_path / "exp" / "ViT"
    assert f"your ViT runs: 1 run(s) under {vit}\n    quickstart/1/0\n" in text
    assert "examples:" not in text and "set EXAMPLES = True to show them too" in text
    assert f"SPEC runs:{vit}\n" in text  # no examples in what TensorBoard reads
    monkeypatch.setenv("TENSORBOARD_MODEL", "UNet")
    text = execute(repo, cells=1)
    assert f"your UNet runs: 1 run(s) under {tmp_path / 'exp' / 'UNet'}" in text


def test_runs_of_train_py_in_logs_are_shown_beside_the_job_scripts(repo, tmp_path, monkeypatch):
    """On Perlmutter the log root is $SCRATCH's (submit_pm.sh), while python train.py without
    EXPDIR writes to ./logs: both are listed and served; with EXPDIR set, only EXPDIR."""
    scratch_root = tmp_path / "scratch" / "dl-at-scale" / "logs"
    existing_run(scratch_root)
    existing_run(repo / "logs")
    monkeypatch.setenv("SCRATCH", str(tmp_path / "scratch"))
    nb = nbformat.read(repo / "start_tensorboard.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    spec = code[1].source.split("def logdir_spec", 1)[1].split("\n\n\n", 1)[0]
    code[0].source += f"\n\n\ndef logdir_spec{spec}\n\n\nprint('SPEC', logdir_spec())"
    nbformat.write(nb, repo / "start_tensorboard.ipynb")
    text = execute(repo, cells=1)
    vit, local = scratch_root / "ViT", repo / "logs" / "ViT"
    assert f"your ViT runs: 1 run(s) under {vit}\n" in text
    assert f"your runs of python train.py without EXPDIR: 1 run(s) under {local}\n" in text
    assert f"SPEC runs:{vit},local:{local}\n" in text
    monkeypatch.setenv("EXPDIR", str(scratch_root))  # chosen: nothing else is added
    text = execute(repo, cells=1)
    assert f"SPEC runs:{vit}\n" in text and "without EXPDIR" not in text
