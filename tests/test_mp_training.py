"""The model-parallel engine end to end: train_mp.py's Trainer on real gloo ranks.

* Per-step losses and gradient norms (before clipping to 0.5) of 10 optimizer steps
  (two epochs, validation, checkpoints: ``Trainer.fit``) of
  a tiny ViT at tp=2, cp=2 and tp=2 x cp=2 (world = tp x cp, dp = 1) follow the serial run
  (``Trainer`` on one rank, the serial ``networks.vit.ViT``).
  Tolerance: rtol 1e-5, atol 1e-7 (float32; the sharded model sums in another order and Adam
  carries the rounding from step to step; observed relative differences are below 5e-7).
  The same for padded sequence parallelism (tp x cp does not divide the patch rows, tp not the
  27 tokens of a cp band: tp=2 and tp=4 on 3 patch rows of 9 columns, tp=2 x cp=2 on 6), for
  ``--sequence_parallel false`` (tp=2 x cp=2 on 6 rows) and for cp=4 on 6 patch rows (bands of
  2, 2, 1 and 1 rows, each rank reading only its rows); the engine logs one line saying which
  layout it runs. Runs of one world size share one spawn of ranks.
* The checkpoint the tp=2 x cp=2 run writes at step 6 (serial layout) resumes on one rank with
  ``--resume_from``: the resumed model holds exactly the checkpoint's weights, and steps 7..10
  repeat the uninterrupted runs' losses (same tolerance).
* ``benchmarks.memory_model`` predicts the engine's CPU byte count (``observe.memory.MemoryProbe``)
  exactly: the tensors saved for backward, and parameters + Adam state + activations after the
  forward pass, at tp 1, 2, cp 2 and tp 2 x cp 2, and the padded and unsharded layouts above;
  plus AMP (bf16), math attention and activation checkpointing at tp 1 and 2 on the parallel
  layers directly, in row bands, padded and without sequence parallelism.
* Invalid layouts make train_mp.py exit with code 2 and one line on stderr, before any process
  group exists.
"""
import os
import sys

import pytest
import torch

import preloaded
from conftest import ROOT, write_era5

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distributed_harness import run_ranks  # noqa: E402

YAML = os.path.join(ROOT, "config", "ViT.yaml")
TINY = {"img_size": "[16,32]", "patch_size": "4", "embed_dim": "32", "depth": "2", "num_heads": "4",
        "global_batch_size": "4", "base_batch_size": "4", "synthesize_if_missing": "false", "lr": "3e-3",
        "warmup_steps": "0", "num_iters": "10", "checkpoint_every": "6", "log_every": "1", "device": "cpu",
        "max_grad_norm": str(CLIP := 0.5)}  # clips the steps whose gradient norm is above 0.5
LAYOUTS = {  # name: (tensor_parallel, context_parallel, img_size or None for TINY's, the serial run to follow)
    "serial": (1, 1, None, None), "tp2": (2, 1, None, "serial"), "cp2": (1, 2, None, "serial"),
    "tp2-cp2": (2, 2, None, "serial"),
    # padded sequence parallelism: tp x cp does not divide the patch rows (9 columns: 27 tokens per cp band)
    "serial-rows3": (1, 1, "[12,36]", None), "tp2-rows3": (2, 1, "[12,36]", "serial-rows3"),
    "tp4-rows3": (4, 1, "[12,36]", "serial-rows3"),
    "serial-rows6": (1, 1, "[24,36]", None), "tp2-cp2-rows6": (2, 2, "[24,36]", "serial-rows6"),
    # --sequence_parallel false
    "tp2-cp2-rows6-off": (2, 2, "[24,36]", "serial-rows6"),
    # cp bands of different lengths: 6 patch rows over 4 ranks are 2, 2, 1 and 1 rows
    "cp4-rows6": (1, 4, "[24,36]", "serial-rows6"),
}
PARALLEL = [name for name, lay in LAYOUTS.items() if lay[3]]
NO_SP = ("tp2-cp2-rows6-off",)
PADDED = ("tp2-rows3", "tp4-rows3", "tp2-cp2-rows6")
UNEVEN = ("cp4-rows6",)  # ranks hold different amounts: not a single per-rank memory prediction
LOSS_TOL = dict(rtol=1e-5, atol=1e-7)
RESUME_AT = 6


def _train_rank(overrides, record_start=False):
    """Build the engine from the config, run ``fit``; per-step losses and the probe's bytes."""
    from settings.parse import build_config
    from observe.memory import NullProbe, tensor_bytes
    from engine.runtime import setup_runtime
    from train import Trainer

    cfg = build_config(YAML, "quickstart", overrides)
    rt = setup_runtime(cfg)
    trainer = Trainer(cfg, rt)
    start = trainer.sharding.model_state(trainer.model) if record_start else None
    losses, norms, step = [], [], trainer.train_step

    def recording(x, y, probe=NullProbe()):
        loss, grad_norm = step(x, y, probe)
        losses.append(loss.item())
        norms.append(grad_norm.item())
        return loss, grad_norm

    trainer.train_step = recording
    trainer.fit()
    opt_state = [v for st in trainer.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    log_path = os.path.join(trainer.run_dir, "out.log")
    mode_lines = []
    if os.path.exists(log_path):  # rank 0 writes the run log
        with open(log_path) as f:
            mode_lines = [line.split(" - INFO - ", 1)[-1].rstrip("\n") for line in f if "Sequence parallelism" in line]
    return dict(losses=losses, norms=norms, start=start, ckpt_dir=trainer.ckpt_dir, model=type(trainer.model).__name__,
                after_forward=trainer.run_log.probe.after_forward, peak=trainer.run_log.probe.peak,
                params=tensor_bytes(trainer.model.parameters()), adam=tensor_bytes(opt_state),
                sequence_parallel=getattr(trainer.model, "sequence_parallel", None), mode_lines=mode_lines)


def _train_runs(runs):
    """Several engine runs, one after the other, in the same ranks: {name: result}."""
    return {name: _train_rank(ov) for name, ov in runs}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("mp_training")
    years = {"train": [2016, 2017], "valid": [2018]}
    data = write_era5(str(base / "era5"), years=years, steps=12, h=16, w=32)
    data24 = write_era5(str(base / "era5_24"), years=years, steps=12, h=24, w=36)  # cropped to each img_size
    by_world = {}
    for name, (tp, cp, img, _) in LAYOUTS.items():
        ov = dict(TINY, data_root=data if img is None else data24, expdir=str(base / name), tensor_parallel=str(tp),
                  context_parallel=str(cp), **({"img_size": img} if img else {}),
                  **({"sequence_parallel": "false"} if name in NO_SP else {}))
        by_world.setdefault(tp * cp, []).append((name, ov))
    out = {}
    for world, group in by_world.items():
        per_rank = run_ranks(_train_runs, world, group, timeout=300)
        for name, _ in group:
            out[name] = [res[name] for res in per_rank]
    ckpt = os.path.join(out["tp2-cp2"][0]["ckpt_dir"], f"ckpt_{RESUME_AT:08d}.pt")
    ov = dict(TINY, data_root=data, expdir=str(base / "resumed"), resume_from=ckpt)
    out["resumed"] = run_ranks(_train_rank, 1, ov, True, timeout=120)
    out["checkpoint"] = ckpt
    return out


@pytest.mark.parametrize("layout", PARALLEL)
def test_parallel_losses_follow_serial(runs, layout):
    serial = runs[LAYOUTS[layout][3]][0]
    assert serial["model"] == "ViT" and len(serial["losses"]) == 10
    assert serial["losses"][-1] < 0.9 * serial["losses"][0], f"the serial run does not learn: {serial['losses']}"
    for rank, res in enumerate(runs[layout]):
        assert res["model"] == "ParallelViT"
        assert res["sequence_parallel"] is (layout not in NO_SP)
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(serial["losses"]), **LOSS_TOL,
                                   msg=lambda m: f"{layout} rank {rank}: {m}")


@pytest.mark.parametrize("layout", PARALLEL)
def test_gradient_norm_and_clipping_follow_serial(runs, layout):
    """Every rank reports the norm of the whole (serial) gradient, and clipping to it keeps the
    sharded run on the serial run's path (the losses above)."""
    serial = runs[LAYOUTS[layout][3]][0]["norms"]
    assert len(serial) == 10 and min(serial) < CLIP < max(serial), f"clipping never or always acts: {serial}"
    for rank, res in enumerate(runs[layout]):
        torch.testing.assert_close(torch.tensor(res["norms"]), torch.tensor(serial), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{layout} rank {rank}: {m}")


@pytest.mark.parametrize("layout", ["tp2", "tp2-rows3", "tp4-rows3", "tp2-cp2-rows6", "tp2-cp2-rows6-off"])
def test_engine_logs_the_sequence_parallel_mode(runs, layout):
    tp, cp, img, _ = LAYOUTS[layout]
    rows = int((img or TINY["img_size"]).strip("[]").split(",")[0]) // 4
    want = {"tp2": "Sequence parallelism on: the 4 patch rows divide by tensor_parallel x context_parallel = 2; "
                   "LayerNorm/residual activations are split over the tensor-parallel ranks (2 patch rows per rank)",
            "tp2-rows3": "Sequence parallelism on, padded: the 3 patch rows do not divide by tensor_parallel x "
                         "context_parallel = 2, so the 27 tokens of each context-parallel band are split into 2 "
                         "chunks of 14, 1 padding token per band (an img_size whose patch rows divide by 2, e.g. "
                         "[8, 36], also splits the image bands over tensor_parallel)",
            "tp2-cp2-rows6-off": "Sequence parallelism off (sequence_parallel=False): LayerNorm/residual activations "
                                 "are whole on each tensor-parallel rank (27 tokens per context-parallel rank)"}
    lines = runs[layout][0]["mode_lines"]
    assert len(lines) == 1, lines
    if layout in want:
        assert lines[0] == want[layout]
    else:
        assert lines[0].startswith(f"Sequence parallelism on, padded: the {rows} patch rows do not divide by "
                                   f"tensor_parallel x context_parallel = {tp * cp}, so the 27 tokens")


def test_tp2_cp2_checkpoint_resumes_serially(runs):
    from engine import checkpoint

    state, _ = checkpoint.load_file(runs["checkpoint"])
    assert state is not None and state["iteration"] == RESUME_AT and state["world_size"] == 4
    resumed = runs["resumed"][0]
    assert resumed["model"] == "ViT"
    assert set(resumed["start"]) == set(state["model"])
    for name, value in state["model"].items():  # the serial model starts from the sharded run's weights
        assert torch.equal(resumed["start"][name], value), name
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(runs["tp2-cp2"][0]["losses"][RESUME_AT:]),
                               **LOSS_TOL)
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(runs["serial"][0]["losses"][RESUME_AT:]),
                               **LOSS_TOL)


def _tiny_config(tp, cp, **extra):
    from settings.parse import build_config

    return build_config(YAML, "quickstart", dict(TINY, tensor_parallel=str(tp), context_parallel=str(cp), **extra))


@pytest.mark.parametrize("layout", [lay for lay in LAYOUTS if lay not in UNEVEN])
def test_memory_model_matches_engine_probe(runs, layout):
    """The last measured step (first of epoch 2) has Adam state; gradients were set to None."""
    from benchmarks.memory_model import predict_config

    tp, cp, img, _ = LAYOUTS[layout]
    p = predict_config(_tiny_config(tp, cp, **({"img_size": img} if img else {}),
                                    **({"sequence_parallel": "false"} if layout in NO_SP else {})), 1, "flash", "cpu")
    assert p.sequence_parallel is (layout not in NO_SP)
    assert (p.padding > 0) is (layout in PADDED)
    for rank, res in enumerate(runs[layout]):
        saved = res["after_forward"] - res["params"] - res["adam"]
        assert saved == p.activations, f"rank {rank}: saved {saved} B, model {p.activations} B"
        assert (res["params"], res["adam"]) == (p.params, p.adam), f"rank {rank}"
        assert (res["after_forward"], res["peak"]) == (p.after_forward, p.peak), f"rank {rank}"


# ---- the model's dtype, attention and checkpointing cases, on the parallel layers directly ----------

VARIANTS = [("bf16", "flash", False), ("none", "math", False), ("bf16", "math", False),
            ("none", "flash", True), ("bf16", "flash", True)]


def _saved_bytes_rank(tp, cp, variants, imgs=((None, True),)):
    """Bytes saved for backward by one forward pass of the engine's model and loss, per
    (image size (``None``: TINY's), sequence parallelism) and variant."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from distributed.groups import build_groups
    from distributed.parallelize import parallelize_vit, sharded_loss
    from settings.parse import build_config
    from observe.memory import MemoryProbe
    from tasks import make_task

    groups = build_groups(tp * cp, tp, cp)
    out = []
    for (img, sp), (amp, attention, ckpt) in [(img, v) for img in imgs for v in variants]:
        cfg = build_config(YAML, "quickstart", dict(TINY, amp_mode=amp, **({"img_size": img} if img else {})))
        torch.manual_seed(0)
        model = parallelize_vit(make_task(cfg).build_model(), groups, activation_checkpointing=ckpt,
                                sequence_parallel=sp)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(4, 20, *cfg.img_size, generator=g), torch.randn(4, 20, *cfg.img_size, generator=g)
        probe = MemoryProbe(torch.device("cpu"), model, torch.optim.Adam(model.parameters()))
        backend = SDPBackend.MATH if attention == "math" else SDPBackend.FLASH_ATTENTION
        with probe.step(), sdpa_kernel(backend):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp == "bf16"):
                loss = sharded_loss(make_task(cfg).loss, model(model.shard_image(x)), model.shard_image(y), groups,
                                    model.layout).mean()
            probe.forward_done()
            loss.backward()
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        out.append(probe.after_forward - params)
    return out


@pytest.mark.parametrize("tp,cp,imgs", [
    (1, 1, ((None, True),)),
    (2, 1, ((None, True), ("[12,36]", True), ("[12,36]", False))),
    (1, 2, ((None, True),)),
], ids=["tp1", "tp2-rows-padded-off", "cp2"])
def test_memory_model_dtypes_attention_checkpointing(tp, cp, imgs):
    """At tp=2 in row bands, padded (3 patch rows of 9 columns) and without sequence parallelism."""
    from benchmarks.memory_model import predict_config

    measured = run_ranks(_saved_bytes_rank, tp * cp, tp, cp, VARIANTS, imgs, timeout=120)
    cases = [(img, v) for img in imgs for v in VARIANTS]
    for ((img, sp), (amp, attention, ckpt)), *per_rank in zip(cases, *measured):
        cfg = _tiny_config(tp, cp, amp_mode=amp, activation_checkpointing=str(ckpt).lower(),
                           sequence_parallel=str(sp).lower(), **({"img_size": img} if img else {}))
        p = predict_config(cfg, 1, attention, "cpu")
        assert p.sequence_parallel is (sp or tp == 1)
        assert (p.padding > 0) is (img is not None and sp and tp > 1)
        assert per_rank == [p.activations] * (tp * cp), \
            f"img={img} sequence_parallel={sp} amp={amp} attention={attention} checkpointing={ckpt}"


# ---- invalid layouts ------------------------------------------------------------------------------

@pytest.mark.parametrize("args,world,message", [
    (["--num_heads", "8", "--tensor_parallel", "3"], 3,
     "error: tensor_parallel=3 does not divide num_heads=8: choose 1, 2, 4 or 8"),
    (["--img_size", "[24,64]", "--context_parallel", "8"], 8,
     "error: context_parallel=8 exceeds the 6 patch rows (img height 24 / patch_size 4): tokens are "
     "sharded over cp in whole patch rows, at least one per rank; choose context_parallel <= 6"),
    (["--tensor_parallel", "2", "--context_parallel", "2"], 6,
     "error: tensor_parallel=2 x context_parallel=2 = 4 does not divide world size 6"),
    (["--tensor_parallel", "2"], 1,
     "error: tensor_parallel=2 x context_parallel=1 splits each model over 2 ranks, and this is one "
     "process: start them with torchrun: torchrun --nproc_per_node 2 train_mp.py --config quickstart "),
    (["--noddp", "--tensor_parallel", "2"], 2,
     "error: noddp turns off the data-parallel gradient all-reduce for timing; it cannot be combined with "
     "tensor_parallel/context_parallel"),
], ids=["heads", "patch-rows", "world-size", "no-launcher", "noddp"])
def test_invalid_layout_exits_2_with_one_message(tmp_path, args, world, message):
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", WORLD_SIZE=str(world), RANK="0", LOCAL_RANK="0")
    r = preloaded.run([sys.executable, "train_mp.py", "--config", "quickstart", "--expdir", str(tmp_path),
                       "--device", "cpu", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), r.stderr
    assert not os.listdir(tmp_path), "nothing is written for a refused layout"
