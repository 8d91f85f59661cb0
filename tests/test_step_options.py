"""benchmarks/step_options.py without a GPU: a compute-only step of each model runs on the CPU
(the ViT with a named attention kernel, the U-Net in channels-last), the plan keeps the eager
variants first, and the table shows failed variants as rows."""
import pytest

from benchmarks import step_options

TINY_VIT = {"img_size": [16, 32], "patch_size": 4, "embed_dim": 32, "depth": 1, "num_heads": 2,
            "global_batch_size": 2}
TINY_UNET = {"data_size": 32, "full_scale": False, "base_width": 4, "global_batch_size": 2}


def test_a_step_of_each_model_is_timed_on_the_cpu():
    rows = []
    for model, opts in [("vit", {"compile": "eager", "attention": "math",
                                 "overrides": TINY_VIT}),
                        ("unet", {"compile": "eager", "layout": "channels_last",
                                  "overrides": TINY_UNET})]:
        row = step_options.step_row(model, opts, steps=1)
        assert row["model"] == model and row["ms"] > 0 and row["first_step_s"] > 0
        assert row["samples_per_s"] == pytest.approx(2 * 1000 / row["ms"])
        assert row["mfu"] is None and row["peak_gb"] is None  # a CPU has no peak, no CUDA memory
        rows.append({**row, "variant": model})
    rows.append({"variant": "unet channels_last default", "failed": "over its 150 s limit"})
    text = step_options.table({"attention": [], "steps": rows})
    assert text.count("\n| ") == 3 and "| unet channels_last default | failed: over" in text


def test_the_eager_variants_run_before_the_compiled_ones(capsys):
    step_options.main(["--dry-run"])
    names = [line.split(":")[0] for line in capsys.readouterr().out.splitlines()[:-1]]
    assert names[0] == "attention"
    compiled = [i for i, n in enumerate(names) if "eager" not in n and n != "attention"]
    eager = [i for i, n in enumerate(names) if "eager" in n]
    assert max(eager) < min(compiled)


def test_attention_rows_time_each_kernel_and_record_the_missing_ones():
    rows = step_options.attention_rows(batch=1, heads=2, tokens=16, head_dim=8, device="cpu")
    got = {(r["dtype"], r["layout"], r["backend"]): r for r in rows}
    assert len(rows) == 2 * (4 + 4 + 4 + 3)  # dtypes x (qkv, qkv-permuted, contig: 4 backends;
    # pad64: 3)
    for dtype in ("bfloat16", "float16"):
        math = got[(dtype, "qkv", "math")]
        assert math["fwd_ms"] > 0 and math["fwd_bwd_tflops"] > 0
        assert "failed" in got[(dtype, "pad64", "cudnn")]  # no cuDNN kernel on a CPU


@pytest.mark.compile
def test_the_blocks_variant_compiles_one_graph_for_every_block(capsys):
    """``fastest (blocks)``: each transformer block compiled in place, as compile_blocks does;
    the second block reuses the first's graph."""
    import torch
    from torch._dynamo.utils import counters

    step_options.main(["--dry-run", "--only", "vit"])
    assert "vit fastest (blocks): limit 100 s" in capsys.readouterr().out
    torch._dynamo.reset()
    counters.clear()
    row = step_options.step_row("vit", {"compile": "blocks", "attention": "math",
                                        "overrides": {**TINY_VIT, "depth": 2}}, steps=1)
    assert "failed" not in row and counters["stats"]["unique_graphs"] == 1


@pytest.mark.compile
def test_warm_runs_each_compiled_variant_again_on_its_own_caches(tmp_path, monkeypatch):
    """--warm: every compiled variant's row has a second first step, from the caches its first
    run filled in a directory of its own, removed afterwards; eager rows have none."""
    import json
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(step_options, "VIT", step_options.VIT[:1])  # flash eager
    monkeypatch.setattr(step_options, "VIT_COMPILED", step_options.VIT_COMPILED[-1:])  # blocks
    out = tmp_path / "rows.json"
    step_options.main(["--only", "vit", "--vit-overrides", json.dumps(TINY_VIT), "--steps", "1",
                       "--warm", "--json", str(out)])
    rows = {r["variant"]: r for r in json.loads(out.read_text())["steps"]}
    assert "failed" not in rows["vit flash eager"]
    assert "warm_first_step_s" not in rows["vit flash eager"]
    row = rows["vit fastest (blocks)"]
    assert isinstance(row["warm_first_step_s"], float), row  # the warm run gave a row
    assert f" | {row['first_step_s']:.1f} / {row['warm_first_step_s']:.1f} | " in \
        step_options.table({"attention": [], "steps": [row]})
    assert not list(tmp_path.glob("step_options-cache-*"))
