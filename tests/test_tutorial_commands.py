"""The README's "Coming from the tutorial" table, checked row by row.

- Every command of the "Here" column parses: its script exists and its settings are valid for
  its config (the same parser the script uses).
- Every alias the "Differs" column states (`X` is `Y`) gives the same config as what it stands
  for, on that row's command.
- Every command that can run on one CPU (one rank; not fp16, nsys, train_graph.py or
  torch.compile) trains two steps with its own settings on a tiny model and tiny data, in a
  process of its own.
"""
import os
import re
import shlex
import sys

import pytest

import preloaded
from conftest import ROOT, write_cosmo_pair, write_era5
from settings.cli import from_argv

SECTION = "## Coming from the tutorial"
TINY = {
    "vit": ["--img_size", "[16,32]", "--patch_size", "4", "--embed_dim", "32", "--depth", "1",
            "--num_heads", "2", "--global_batch_size", "4", "--base_batch_size", "4"],
    "unet": ["--base_width", "4", "--max_width", "16", "--full_scale", "false", "--data_size",
             "32", "--Nsamples", "16", "--Nsamples_val", "8", "--global_batch_size", "4",
             "--base_batch_size", "4", "--train_file", "train.h5", "--val_file", "valid.h5"],
}
RANKS_PER_NODE = 4  # submit_pm.sh's --ntasks-per-node


def table():
    text = open(os.path.join(ROOT, "README.md")).read()
    assert SECTION in text, f"README.md has no section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        tutorial, here, differs = (c.strip() for c in line.strip().strip("|").split(" | "))
        rows.append((re.search(r"`([^`]+)`", here).group(1), differs))
    assert len(rows) >= 15, rows
    return rows


ROWS = table()


def split(command: str):
    """(script, settings, ranks, runs under a profiler) of a command of the table."""
    tokens = shlex.split(command)
    env = {}
    while tokens and re.match(r"^[A-Z_]+=", tokens[0]):
        k, v = tokens.pop(0).split("=", 1)
        env[k] = v
    ranks, profiled = 1, False
    if tokens[0] == "sbatch":
        at = next(i for i, t in enumerate(tokens) if t.endswith("submit_pm.sh"))
        opts = " ".join(tokens[1:at])
        n = re.search(r"-n ?(\d+)", opts)
        nodes = re.search(r"(?:-N|--nodes) ?(\d+)", opts)
        ranks = int(n.group(1)) if n else int(nodes.group(1)) * RANKS_PER_NODE if nodes else 1
        profiled = env.get("ENABLE_PROFILING") == "1"
        return env.get("SCRIPT", "train.py"), tokens[at + 1:], ranks, profiled
    if tokens[0] == "nsys":
        tokens = tokens[tokens.index("python"):]
        profiled = True
    if tokens[0] != "python":
        return None, tokens, 0, False
    return tokens[1], tokens[2:], ranks, profiled


def parse(script, args):
    return from_argv(args, prog=script)


@pytest.mark.parametrize("command,differs", ROWS, ids=[c[:70] for c, _ in ROWS])
def test_each_command_parses_and_each_alias_means_what_it_says(command, differs):
    script, args, _, _ = split(command)
    if script is None:  # a notebook, not a command
        assert os.path.exists(os.path.join(ROOT, args[0])), args
        return
    assert os.path.exists(os.path.join(ROOT, script)), script
    cfg = parse(script, args)
    for alias, meaning in re.findall(r"`([^`]+)` is `([^`]+)`", differs):
        if alias.startswith("--") != meaning.startswith("--"):
            continue  # a description (`--enable_jit` is `torch.compile`), not a setting
        spelled = []
        for t in args:
            key, eq, value = t.partition("=")
            if t == alias or key == alias:
                spelled += meaning.split() if not eq else [f"{meaning}={value}"]
            elif eq and value == alias:
                spelled.append(f"{key}={meaning}")
            else:
                spelled.append(t)
        assert spelled != args, f"{alias} does not occur in {command}"
        assert parse(script, spelled) == cfg, f"{alias} is not {meaning}"


def _runnable(command):
    script, args, ranks, profiled = split(command)
    if script not in ("train.py", "train_mp.py") or ranks != 1 or profiled:
        return False
    cfg = parse(script, args)
    return cfg.amp_mode != "fp16" and not cfg.enable_jit


RUNNABLE = [c for c, _ in ROWS if _runnable(c)]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    base = tmp_path_factory.mktemp("tutorial_data")
    return {"vit": write_era5(str(base / "era5"), steps=20),
            "unet": write_cosmo_pair(base / "cosmo", side=32)}


@pytest.mark.parametrize("command", RUNNABLE, ids=[c[:70] for c in RUNNABLE])
def test_each_command_that_runs_on_a_cpu_trains(command, tiny_data, tmp_path):
    script, args, _, _ = split(command)
    model = parse(script, args).model
    # the command's own settings, then a tiny model on tiny data for two steps
    args = [a for i, a in enumerate(args) if not (a.startswith("--num_epochs") or
                                                  (i and args[i - 1] == "--num_epochs"))]
    args += TINY[model] + ["--data_root", tiny_data[model], "--synthesize_if_missing", "false",
                           "--expdir", str(tmp_path), "--num_iters", "2"]
    cfg = parse(script, args)
    # as a user runs it: its own process (and its own loader workers)
    r = preloaded.run([sys.executable, script, *args], cwd=ROOT, capture_output=True, text=True,
                      env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    run_num = "0" if cfg.run_num == "auto" else cfg.run_num  # the first run of the config
    assert os.path.exists(os.path.join(tmp_path, cfg.name, "1", run_num, "checkpoints",
                                       "ckpt_00000002.pt"))


def test_the_table_covers_every_chapter():
    joined = " ".join(c for c, _ in ROWS)
    for needle in ("train_mp.py", "train_graph.py", "--context_parallel", "dali",
                   "--enable_benchy", "--enable_manual_profiling", "--row_parallel_size",
                   "config/UNet.yaml", "--noddp", "--bucket_cap_mb"):
        assert needle in joined, needle
    assert len(RUNNABLE) >= 8, RUNNABLE
