"""benchmarks/first_batch.py: both orders run, and its table is read from their logs."""
import re

from benchmarks import first_batch


def test_both_orders_run_and_the_table_has_every_part(capsys):
    first_batch.main(["--pairs", "1", "--no-compile", "--img_size", "[16,32]"])
    out = capsys.readouterr().out
    rows = {m.group(1): [float(x) for x in m.group(2).split(" | ")] for m in re.finditer(
        r"^\| (at the first fetch \(before\)|before the model \(now\)) \| (.*) \|$", out, re.M)}
    assert len(rows) == 2 and all(len(v) == 4 for v in rows.values()), out
    start, model, first_batch_s, first_epoch = rows["before the model (now)"]
    assert start > 0 and first_epoch > 0 and model >= 0 and first_batch_s >= 0
    assert "| before / now |" in out
