"""A start that fails in set-up leaves no run behind: the run directory it claimed (and the
parents it made) are removed again, its number is free for the next start, and the reason is the
one line on stderr (where a Slurm job's .out file gets it). Runs that existed stay."""
import os

from conftest import write_era5
from test_training import TINY_VIT, run_dir, train


def test_a_failed_start_leaves_no_run_directory(tmp_path):
    exp = tmp_path / "logs"
    r = train(["--expdir", str(exp), "--data_root", str(tmp_path / "none"),
               "--synthesize_if_missing", "false", *TINY_VIT], check=False)
    err = r.stderr.strip().splitlines()
    assert r.returncode != 0 and err and err[-1].startswith("error: "), r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert not exp.exists(), sorted(str(p) for p in exp.rglob("*"))


def test_a_failed_start_keeps_earlier_runs_and_does_not_use_up_a_number(tmp_path):
    exp, data = str(tmp_path / "logs"), write_era5(str(tmp_path / "era5"), steps=12)
    args = ["--expdir", exp, *TINY_VIT, "--num_iters", "1"]
    train(["--data_root", data, *args])
    first = sorted(os.listdir(run_dir(exp)))
    for _ in range(2):  # data missing: fails in set-up, after the run number was claimed
        r = train(["--data_root", str(tmp_path / "none"), "--synthesize_if_missing", "false",
                   *args], check=False)
        assert r.returncode != 0 and "error: " in r.stderr
    assert sorted(os.listdir(os.path.dirname(run_dir(exp)))) == ["0"]
    assert sorted(os.listdir(run_dir(exp))) == first  # the finished run, untouched
    train(["--data_root", data, *args])
    assert sorted(os.listdir(os.path.dirname(run_dir(exp)))) == ["0", "1"]  # the next number
    # a failed resume of an existing, named run keeps that run
    r = train(["--data_root", str(tmp_path / "none"), "--synthesize_if_missing", "false",
               "--run_num", "0", "--resume", *args], check=False)
    assert r.returncode != 0 and sorted(os.listdir(run_dir(exp))) == first


def test_a_failed_start_in_an_existing_run_directory_adds_no_file_to_it(tmp_path):
    """A bare --resume of a named run directory that exists but holds nothing (made by hand, or
    by a job script) is refused, and leaves that directory as it was: no out.log of the
    refusal."""
    exp = str(tmp_path / "logs")
    empty = run_dir(exp, run="mine")
    os.makedirs(empty)
    r = train(["--expdir", exp, "--data_root", str(tmp_path / "none"), *TINY_VIT,
               "--run_num", "mine", "--resume"], check=False)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: "), r.stderr
    assert os.listdir(empty) == []
