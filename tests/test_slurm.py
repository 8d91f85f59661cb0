"""submit_pm.sh on a real one-node Slurm cluster: two 2-rank jobs (ViT and U-Net quickstarts on
tiny data), each through sbatch -> srun -> export_DDP_vars.sh -> train.py with gloo ranks.

The cluster is installed (apt-get, first time only) and started by .ci/slurm_cluster.sh, and
stopped again afterwards when this test started it. Needs root; CI runs as root, so there this
test runs (it fails rather than skips when CI is set and it cannot).
"""
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, write_cosmo, write_era5

pytestmark = pytest.mark.slurm

CLUSTER = os.path.join(ROOT, ".ci", "slurm_cluster.sh")
# A CPU-only cluster: no GPUs, no "gpu" node feature, one CPU per rank (see submit_pm.sh).
CPU_OPTS = ["--gpus-per-node=0", "--constraint=", "--cpus-per-task=1"]
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("the Slurm integration test needs root in CI")
        pytest.skip("needs root to install and start a Slurm cluster")
    was_running = subprocess.run([CLUSTER, "status"]).returncode == 0
    r = subprocess.run([CLUSTER, "start"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    yield
    if not was_running:
        subprocess.run([CLUSTER, "stop"], timeout=60)


def job_state(job_id):
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True,
                         text=True).stdout
    fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
    return fields.get("JobState"), fields.get("ExitCode")


def submit(tmp_path, name, args, env):
    r = subprocess.run(["sbatch", "--parsable", "-n", "2", *CPU_OPTS, "-t", "10", "-J", name,
                        "-o", str(tmp_path / "%x-%j.out"), "submit_pm.sh", *args],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def wait(job_ids, timeout=300):
    deadline = time.monotonic() + timeout
    states = {}
    while time.monotonic() < deadline:
        states = {j: job_state(j) for j in job_ids}
        if all(s[0] in TERMINAL for s in states.values()):
            return states
        time.sleep(1)
    for j in job_ids:
        subprocess.run(["scancel", j])
    pytest.fail(f"jobs did not finish within {timeout} s: {states}")


def scalars(directory):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(directory, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_quickstarts_run_as_2_rank_sbatch_jobs(cluster, tmp_path):
    era5 = write_era5(str(tmp_path / "era5"), steps=20)
    cosmo = tmp_path / "cosmo"
    write_cosmo(str(cosmo / "train.h5"), side=32, seed=0)
    write_cosmo(str(cosmo / "valid.h5"), side=32, seed=1)
    common = ["--synthesize_if_missing", "false", "--num_data_workers", "0",
              "--num_epochs", "2", "--log_every", "2", "--checkpoint_every", "0",
              "--run_num", "two words"]  # an argument with a space, through sbatch and srun
    vit = ["--config=quickstart", "--data_root", era5, "--img_size", "[16,32]",
           "--patch_size", "4", "--embed_dim", "32", "--depth", "1", "--num_heads", "2",
           "--global_batch_size", "8", *common]
    unet = ["--yaml_config", "config/UNet.yaml", "--config=quickstart", "--data_root", str(cosmo),
            "--base_width", "4", "--max_width", "16", "--Nsamples", "32", "--Nsamples_val", "8",
            "--global_batch_size", "8", *common]
    logs = tmp_path / "logs"
    jobs = {}
    for model, args in (("vit", vit), ("unet", unet)):
        env = dict(os.environ, PYTHON=sys.executable, EXPDIR=str(logs / model))
        jobs[model] = submit(tmp_path, f"dp-test-{model}", args, env)
    states = wait(list(jobs.values()))
    for model, job in jobs.items():
        out_file = tmp_path / f"dp-test-{model}-{job}.out"  # -o %x-%j.out
        text = out_file.read_text() if out_file.exists() else "(no output file)"
        assert states[job] == ("COMPLETED", "0:0"), f"{model}: {states[job]}\n{text[-4000:]}"
        assert f"job {job}: 2 rank(s)" in text and "CPU only" in text
        assert "2 rank(s), 2 data-parallel" in text and "(4 per rank)" in text
        assert "samples/s" in text and "Avg val loss" in text and "Done:" in text
        assert "error:" not in text and "Traceback" not in text, text[-4000:]
        run_dir = re.search(r"Run directory: (.*)", text).group(1)
        assert run_dir.startswith(str(logs / model)) and run_dir.endswith("/2/two words")
        tags = scalars(os.path.join(run_dir, "tensorboard"))
        expected = ["Loss/train", "Loss/valid", "Learning Rate", "Avg samples per sec"]
        if model == "vit":
            expected.append("RMSE(u10m)/valid")
        for tag in expected:
            assert tags.get(tag), f"{model}: no {tag} in {sorted(tags)}"
            assert all(math.isfinite(v) for v in tags[tag]), (model, tag, tags[tag])
        assert len(tags["Loss/valid"]) == 2  # one validation per epoch


def test_export_parser_matches_scontrol(cluster):
    from test_launch import NODE_LISTS, source_export

    for nodelist, _ in NODE_LISTS:
        real = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                              text=True).stdout.split()[0]
        r = source_export({"SLURM_PROCID": "0", "SLURM_NTASKS": "1",
                           "SLURM_JOB_NODELIST": nodelist}, "/nonexistent")
        assert r.stdout.split()[3] == real, nodelist


def job_ranks(job_id, script="train.py"):
    """The pids of a job's rank processes and their loader workers: the interpreter running
    ``script`` with the job's SLURM_JOB_ID (not srun, which has ``script`` among its own
    arguments)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:  # ended meanwhile
            continue
        if f"SLURM_JOB_ID={job_id}".encode() in env and argv[:2] == [os.fsencode(sys.executable),
                                                                      os.fsencode(script)]:
            pids.append(int(pid))
    return pids


def send(pid, sig):
    """Whether ``sig`` reached ``pid`` (a loader worker may have ended since it was listed)."""
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def wait_for_output(path, pattern, job_id, timeout):
    """The output file's text once ``pattern`` is in it; fails if the job ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        if re.search(pattern, text, re.M):
            return text
        state = job_state(job_id)[0]
        assert state not in TERMINAL, f"job ended ({state}) before {pattern!r}:\n{text[-4000:]}"
        time.sleep(0.05)
    pytest.fail(f"no {pattern!r} in {path} within {timeout} s")


def test_time_limit_stops_requeues_and_resumes_to_the_same_result(cluster, tmp_path):
    """A job with a 1-minute limit and the warning signal 50 s before it: the ranks checkpoint
    and exit 3, the job requeues itself and the requeued job resumes (--resume auto) to the
    weights and losses of an uninterrupted job.

    Slurm checks time limits every 30 s, so the warning comes 10 to 40 s into the job, and the
    run must still be training then, on any machine. The test holds the ranks (SIGSTOP) once
    they train, until the job's script has the warning, and lets them go on (SIGCONT): the
    warning then reaches ranks in the middle of a run, whatever the machine's speed, and the
    run can be short."""
    era5 = write_era5(str(tmp_path / "era5"), years={"train": [2016, 2017], "valid": [2018]},
                      steps=40)
    epochs = 30  # 19 steps per epoch
    steps = 19 * epochs
    args = ["--data_root", era5, "--img_size", "[16,32]", "--patch_size", "4", "--embed_dim",
            "32", "--depth", "1", "--num_heads", "2", "--global_batch_size", "4",
            "--base_batch_size", "4", "--synthesize_if_missing", "false", "--log_every", "2",
            "--num_epochs", str(epochs), "--dropout", "0.1", "--num_data_workers", "1"]
    jobs = {}
    for name, limit in (("ref", ["-t", "10"]), ("limited", ["-t", "1", "--signal=B:USR1@50"])):
        env = dict(os.environ, PYTHON=sys.executable, EXPDIR=str(tmp_path / name))
        r = subprocess.run(["sbatch", "--parsable", "-n", "2", *CPU_OPTS, *limit, "-J", name,
                            "-o", str(tmp_path / "%x-%j.out"), "submit_pm.sh", *args],
                           cwd=ROOT, env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        jobs[name] = r.stdout.strip().split(";")[0]
    limited = jobs["limited"]
    out_file = tmp_path / f"limited-{limited}.out"
    wait_for_output(out_file, r"Epoch \d+ step |Epoch \d+: ", limited, timeout=120)  # training
    held = [pid for pid in job_ranks(limited) if send(pid, signal.SIGSTOP)]
    try:
        assert len(held) >= 2, held  # 2 ranks (and their loader workers)
        text = wait_for_output(out_file, r"USR1 \(time limit near\)", limited, timeout=90)
    finally:
        for pid in held:
            send(pid, signal.SIGCONT)
    assert f"Done: {steps} steps" not in text  # held before the run's end
    # Slurm holds a requeued job for about 2 minutes (its credential's lifetime); the test
    # starts it after 3 s (a credential from the same second as the requeue counts as revoked)
    # and with a longer limit, so that it runs to its end this time.
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        out = subprocess.run(["scontrol", "show", "job", limited], capture_output=True,
                             text=True).stdout
        if "Restarts=1" in out and "JobState=PENDING" in out:
            subprocess.run(["scontrol", "update", f"JobId={limited}", "TimeLimit=10",
                            "StartTime=now+3"], check=True)
            break
        # The requeue passes through COMPLETING (and may show REQUEUED); a final state here means
        # the job ended without requeueing itself.
        state = re.search(r"JobState=(\S+)", out).group(1)
        assert state not in TERMINAL, out
        time.sleep(1)
    states = wait(list(jobs.values()), timeout=600)
    text = out_file.read_text()  # both runs: --open-mode=append
    assert states[limited] == ("COMPLETED", "0:0"), f"{states[limited]}\n{text[-4000:]}"
    assert states[jobs["ref"]] == ("COMPLETED", "0:0")
    assert "USR1 (time limit near)" in text and "requeueing (restart 1)" in text, text[-4000:]
    stop = re.search(r"Stopped on SIGUSR1 after step (\d+): checkpoint (\S+);", text)
    assert stop and f"Resumed from {stop.group(2)} at step {stop.group(1)}" in text, text[-4000:]
    assert f"Done: {steps} steps" in text and "Traceback" not in text
    runs = {name: re.search(r"Run directory: (.*)", (tmp_path / f"{name}-{job}.out").read_text())
            .group(1) for name, job in jobs.items()}
    assert runs["limited"].endswith(f"/2/job{limited}")  # named after the job: its own run
    a, b = (torch.load(os.path.join(runs[n], "checkpoints", f"ckpt_{steps:08d}.pt"),
                       weights_only=True) for n in ("ref", "limited"))
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    ref, got = (scalars(os.path.join(runs[n], "tensorboard")) for n in ("ref", "limited"))
    assert got["Loss/train"] == ref["Loss/train"] and len(ref["Loss/train"]) == 10 * epochs
    assert got["Loss/valid"] == ref["Loss/valid"] and len(ref["Loss/valid"]) == epochs
