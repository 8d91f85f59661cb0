"""start_tensorboard.ipynb, executed headless: it finds the runs and starts a TensorBoard that
serves them."""
import json
import os
import shutil
import socket

import nbclient
import nbformat

from conftest import ROOT


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_notebook_starts_tensorboard_on_the_example_runs(tmp_path, monkeypatch):
    work = tmp_path / "repo"
    work.mkdir()
    shutil.copy(os.path.join(ROOT, "start_tensorboard.ipynb"), work)
    shutil.copytree(os.path.join(ROOT, "example_logs"), work / "example_logs")
    port = free_port()
    monkeypatch.setenv("EXPDIR", str(tmp_path / "logs"))
    monkeypatch.setenv("TENSORBOARD_PORT", str(port))
    nb = nbformat.read(work / "start_tensorboard.ipynb", as_version=4)
    # Before the last cell stops it, ask the running TensorBoard which runs it serves.
    probe = nbformat.v4.new_code_cell(
        "import json, urllib.request\n"
        f"print('RUNS', json.dumps(json.load(urllib.request.urlopen('http://localhost:{port}/data/runs'))))")
    nb.cells.insert(len(nb.cells) - 1, probe)
    nbclient.NotebookClient(nb, kernel_name="python3", timeout=180, resources={
        "metadata": {"path": str(work)}}).execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "copied the example runs" in text and "is serving" in text
    runs = json.loads(text.split("RUNS ", 1)[1].splitlines()[0])
    assert any("ViT/quickstart" in r for r in runs) and any("UNet/quickstart" in r for r in runs)
