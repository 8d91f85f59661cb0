"""benchmarks/time_to_answer.py: its commands answer with the exit codes they should, its
torch column tells a command that loads torch from one that does not, and --against times a
second checkout beside this one."""
import re

import pytest

from benchmarks import time_to_answer
from conftest import ROOT


def test_the_table_times_each_command_in_both_trees(capsys):
    time_to_answer.main(["--repeats", "1", "--cases", "train-bad,score-help,torch",
                         "--against", ROOT])
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (.+?) \| (.+?) \| (yes|no) \| ([\d.]+) \| (yes|no) \| ([\d.]+) \| "
                      r"([\d.]+)x \|$", out, re.M)
    assert [r[0] for r in rows] == ["python train.py --lr fast", "python score.py --help",
                                    "import torch"], out
    assert [(r[1], r[2], r[4]) for r in rows] == [("2", "no", "no"), ("0", "no", "no"),
                                                  ("0", "yes", "yes")], out


def test_an_unknown_case_or_a_tree_that_is_no_checkout_is_refused(tmp_path, capsys):
    for argv in (["--cases", "nope"], ["--against", str(tmp_path)]):
        with pytest.raises(SystemExit) as e:
            time_to_answer.main(argv)
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--cases nope" in err and f"--against {tmp_path}: not a checkout" in err
