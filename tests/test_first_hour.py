"""What a newcomer meets in the first runs: the run's config.yaml repeats it with the README's
command, a run ends with a short summary, the resolved config is a file (one line in the log
says where), and a wrong config name lists the valid ones once."""
import os
import re

import yaml

from conftest import write_era5
from test_training import TINY_VIT, run_dir, train


def test_config_yaml_repeats_the_run_and_the_run_ends_with_a_summary(tmp_path):
    exp, data = str(tmp_path / "logs"), write_era5(str(tmp_path / "era5"), steps=12)
    first = train(["--data_root", data, "--expdir", exp, *TINY_VIT, "--num_iters", "2"]).stdout
    saved = os.path.join(run_dir(exp), "config.yaml")
    # the summary: final validation loss beside the baseline, the wall time, where it is, and how
    # to look at it
    summary = first[first.index("Summary: "):]
    assert re.search(r"Summary: quickstart run 0, [0-9.]+ s of training and validation", summary)
    assert re.search(r"Final validation loss [0-9.e+-]+ \(persistence baseline [0-9.e+-]+\) "
                     r"after 2 steps", summary)
    assert f"Run directory: {run_dir(exp)}" in summary
    assert f"Look at it: tensorboard --logdir {exp}" in summary
    # the resolved config is in the run's file, not printed at every start
    assert f"Resolved config: {saved}" in first and "\n  lr: " not in first
    settings = yaml.safe_load(open(saved))["quickstart"]
    assert settings["run_num"] == "auto" and settings["resume"] is False
    assert "# run: 0" in open(saved).read()
    # the README's command repeats the run: a new run with the same settings and losses
    again = train(["--yaml_config", saved, "--config", "quickstart"]).stdout
    assert f"Run directory: {os.path.join(os.path.dirname(run_dir(exp)), '1')}" in again

    def losses(text):
        return re.findall(r"Avg (?:train|val) loss=([0-9.e+-]+)", text)

    assert losses(again) == losses(first) and losses(first)
    # every line fits a terminal, the log's time stamp included (the 20 variables' RMSE wrap;
    # paths counted as a short one)
    longest = max(first.replace(str(tmp_path), "/tmp/x").splitlines(), key=len)
    assert len(longest) <= 150, longest


def test_a_wrong_config_name_lists_the_configs_once(tmp_path):
    r = train(["--config", "shrt", "--expdir", str(tmp_path)], check=False)
    line = r.stderr.strip()
    assert r.returncode == 2 and "\n" not in line, r.stderr
    assert "did you mean 'short'?" in line and line.count("quickstart") == 1, line


def test_a_rerun_on_synthetic_data_says_so(tmp_path):
    args = ["--data_root", str(tmp_path / "era5"), "--expdir", str(tmp_path / "logs"),
            *TINY_VIT, "--synthesize_if_missing", "true", "--num_iters", "1"]
    first = train(args).stdout
    assert "generating synthetic vit data" in first and "(made by" not in first
    again = train(args).stdout
    assert f"Data: the synthetic vit data under {tmp_path / 'era5'} (made by a training run " \
           f"(synthesize_if_missing): not real data)" in again and "generating synthetic" not in again


def test_the_job_scripts_variable_table_names_every_variable_it_reads():
    """Every variable submit_pm.sh's header lists as its environment (what a user exports
    before sbatch) has a row in docs/parallelism.md's table."""
    from conftest import ROOT

    header = open(os.path.join(ROOT, "submit_pm.sh")).read().split("# Environment", 1)[1]
    names = set()
    for line in header.splitlines()[1:]:
        if not line.startswith("#"):
            break
        names.update(re.findall(r"^#   ([A-Z][A-Z0-9_]+)\b", line))
    doc = open(os.path.join(ROOT, "docs", "parallelism.md")).read()
    rows = "\n".join(line for line in doc.splitlines() if line.startswith("| `"))
    assert {"PODMAN_IMAGE", "PODMAN_ARGS", "SCRIPT", "PYTHON"} <= names, names
    missing = sorted(n for n in names if f"`{n}" not in rows)
    assert not missing, missing


OUTPUTS = [r"--out[ =]([\w./-]+)", r"--profile_trace ([\w./-]+)", r"nsys profile -o ([\w./-]+)",
           r"checkpoint_convert \S+ ([\w./-]+)"]


def test_the_documented_commands_write_where_git_ignores():
    """What the README's and docs' commands write (scores, traces, converted checkpoints,
    profiles) lands under folders the repository ignores, never as untracked files in it."""
    import glob
    import subprocess

    from conftest import ROOT

    paths = set()
    for page in [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md"))]:
        text = open(page).read()
        for pattern in OUTPUTS:
            paths |= {p for p in re.findall(pattern, text) if p != "DIR"}
    paths = sorted(p + ".nsys-rep" if "/" not in p and "." not in p else p for p in paths)
    assert "runs/prof" in paths and len(paths) >= 6, paths
    r = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=ROOT, capture_output=True,
                       text=True)
    assert set(r.stdout.split()) == set(paths), f"not ignored: {set(paths) - set(r.stdout.split())}"
