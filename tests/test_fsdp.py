"""Sharded data parallelism (--fsdp, FSDP2) on real gloo ranks against the serial run, and
checkpoints that resume on another number of ranks and across DDP and FSDP.

Each world size is spawned once and runs its scenarios in a row; the serial references run in
this process. The tiny ViT takes 6 steps of 2 micro-batches each with the gradient clipped to a
norm below its own (every step clips), checkpoints at steps 2, 4 and 6; the tiny U-Net takes 2
plain steps. Resumes:

- 4 -> 2 -> 1: the 4-rank FSDP run's step-2 checkpoint continued by 2 FSDP ranks, whose step-4
  checkpoint is continued by one process;
- 1 -> 2: the serial run's step-2 checkpoint continued by 2 FSDP ranks;
- FSDP -> DDP and DDP -> FSDP: the 4-rank FSDP checkpoint continued by 2 DDP ranks, and a 2-rank
  DDP run's step-2 checkpoint continued by 2 FSDP ranks.

Each resumed run must hold exactly the weights and optimizer state that were saved (read back
in the serial layout, every rank taking part) and then take the serial run's steps.

Tolerances: float32 sums in another order (the reduce-scatter adds the ranks' gradients in
another order than one process adds the samples): losses and gradient norms to 1e-5 relative,
weights after 6 Adam steps to 1e-5 relative (+2e-6 absolute, for weights near zero).
"""
import copy
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
import torch

import preloaded
from conftest import ROOT
from distributed_harness import run_ranks
from engine import checkpoint
from engine.checkpoint_convert import convert
from engine.runtime import setup_runtime
from engine.sharding import resharded
from observe.memory import tensor_bytes
from test_ddp import CLIP, Recording, assert_close, unet_cfg, vit_cfg, write_data

STEPS = 6
VIT = dict(num_iters=STEPS, checkpoint_every=2, grad_accum_steps=2, max_grad_norm=CLIP)


def ckpt(run_dir, step):
    """The checkpoint of ``step``: a DCP directory from an FSDP run, a file from the others."""
    path = checkpoint.written_for(os.path.join(run_dir, "checkpoints"), step)
    assert path is not None, f"no checkpoint of step {step} in {run_dir}"
    return path


def run_vit(data, expdir, fsdp, resume_from="", **kw):
    cfg = vit_cfg(data, expdir, fsdp=fsdp, resume_from=resume_from, **(VIT | kw))
    tr = Recording(cfg, setup_runtime(cfg))
    # what each rank of the resumed run holds, in the serial layout (collective), copied (Adam's
    # step counts go on counting)
    start = copy.deepcopy(dict(model=tr.sharding.model_state(tr.model), iteration=tr.iteration,
                               optimizer=tr.sharding.optimizer_state(tr.model, tr.optimizer)))
    tr.fit()
    resharded(tr.model)
    held = dict(params=tensor_bytes(tr.model.parameters()), adam=tensor_bytes(
        v for st in tr.optimizer.state.values() for v in st.values() if torch.is_tensor(v)))
    return dict(losses=tr.step_losses, norms=tr.step_norms, run_dir=tr.run_dir, held=held,
                start=start if resume_from else None,
                final=tr.sharding.model_state(tr.model), kind=type(tr.model).__name__)


def run_unet(data, expdir, fsdp):
    cfg = unet_cfg(data, expdir, fsdp=fsdp, num_iters=2)
    tr = Recording(cfg, setup_runtime(cfg))
    tr.fit()
    return dict(losses=tr.step_losses, final=tr.sharding.model_state(tr.model))


def rank_scenarios(era5, cosmo, exp, resumes):
    """Every rank of one spawn: the FSDP runs, then the resumes ``{name: checkpoint}``."""
    out = {"vit": run_vit(era5, os.path.join(exp, "vit"), True),
           "unet": run_unet(cosmo, os.path.join(exp, "unet"), True)}
    for name, path in resumes.items():
        fsdp = name != "ddp_from_fsdp"
        out[name] = run_vit(era5, os.path.join(exp, name), fsdp, path)
    if not resumes:  # (the 4-rank spawn) FSDP over dp = 2 of a tp = 2 and of a cp = 2 model
        out["tp_dp"] = run_vit(era5, os.path.join(exp, "tp_dp"), True, tensor_parallel=2)
        out["cp_dp"] = run_vit(era5, os.path.join(exp, "cp_dp"), True, context_parallel=2)
    else:  # (the 2-rank spawn) activation checkpointing, bf16 weights for compute, tp = 2
        # with one data-parallel rank (nothing for FSDP to shard over: DDP's hook sums over tp)
        out["tp_only"] = run_vit(era5, os.path.join(exp, "tp"), True, num_iters=2,
                                 tensor_parallel=2)
        out["checkpointed"] = run_vit(era5, os.path.join(exp, "ac"), True, num_iters=2,
                                      activation_checkpointing="true")
        out["bf16"] = run_vit(era5, os.path.join(exp, "bf16"), True, num_iters=2,
                              amp_mode="bf16")
    return out


def rank_3d(era5, exp, dcp_checkpoint):
    """FSDP over dp = 2 of a tp = 2 x cp = 2 model (8 ranks), fresh and from a sharded checkpoint
    of FSDP alone."""
    layout = dict(tensor_parallel=2, context_parallel=2)
    return dict(tp_cp_dp=run_vit(era5, os.path.join(exp, "fresh"), True, **layout),
                dcp_to_tp_cp=run_vit(era5, os.path.join(exp, "resumed"), True, dcp_checkpoint,
                                     **layout))


def rank_ddp_then_fsdp(era5, exp):
    """A 2-rank DDP run, and its step-2 checkpoint continued by the same ranks under FSDP."""
    ddp = run_vit(era5, os.path.join(exp, "ddp"), False)
    return dict(ddp=ddp, fsdp_from_ddp=run_vit(era5, os.path.join(exp, "fsdp_from_ddp"), True,
                                               ckpt(ddp["run_dir"], 2)))


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("fsdp_data"))


@pytest.fixture(scope="module")
def serial(data):
    exp = str(data["base"] / "serial")
    torch.manual_seed(0)
    return dict(vit=run_vit(data["era5"], os.path.join(exp, "vit"), False),
                unet=run_unet(data["cosmo"], os.path.join(exp, "unet"), False))


@pytest.fixture(scope="module")
def fsdp4(data):
    exp = str(data["base"] / "ws4")
    return run_ranks(rank_scenarios, 4, data["era5"], data["cosmo"], exp, {}, timeout=400)


@pytest.fixture(scope="module")
def fsdp2(data, serial, fsdp4):
    exp = str(data["base"] / "ws2")
    resumes = {"from4": ckpt(fsdp4[0]["vit"]["run_dir"], 2),
               "from1": ckpt(serial["vit"]["run_dir"], 2),
               "ddp_from_fsdp": ckpt(fsdp4[0]["vit"]["run_dir"], 2),
               "from_tp_dp": ckpt(fsdp4[0]["tp_dp"]["run_dir"], 2)}
    ranks = run_ranks(rank_scenarios, 2, data["era5"], data["cosmo"], exp, resumes, timeout=400)
    mixed = run_ranks(rank_ddp_then_fsdp, 2, data["era5"], str(data["base"] / "mixed"),
                      timeout=300)
    for r, m in zip(ranks, mixed):
        r.update(m)
    return ranks


@pytest.fixture(scope="module")
def fsdp8(data, fsdp4):
    return run_ranks(rank_3d, 8, data["era5"], str(data["base"] / "ws8"),
                     ckpt(fsdp4[0]["vit"]["run_dir"], 2), timeout=600)


@pytest.fixture(params=[2, 4], ids=["2ranks", "4ranks"])
def fsdp(request):
    return request.getfixturevalue(f"fsdp{request.param}")


# ----------------------------------------------------------------------------- helpers


def assert_same_state(got: dict, saved: dict, what: str):
    """Weights and optimizer state (per-parameter tensors, step counts, hyperparameters) equal."""
    assert_close(got["model"], saved["model"], 0, 0, f"{what}: weight")
    g, s = got["optimizer"], saved["optimizer"]
    assert g["state"].keys() == s["state"].keys()
    for name in s["state"]:
        assert_close(g["state"][name], s["state"][name], 0, 0, f"{what}: Adam state of {name}")
    assert g["param_groups"] == s["param_groups"], what
    assert got["iteration"] == saved["iteration"]


def mean_losses(ranks, key):
    return np.mean([r[key]["losses"] for r in ranks], axis=0)


# ----------------------------------------------------------------------------- equivalence


def test_ranks_hold_fsdp_shards(fsdp):
    assert all(r["vit"]["kind"] == "FSDPViT" for r in fsdp)


def test_fsdp_vit_with_accumulation_and_clipping_equals_serial(fsdp, serial):
    ser = serial["vit"]
    assert min(ser["norms"]) > CLIP and ser["losses"][-1] < ser["losses"][0]  # every step clipped
    np.testing.assert_allclose(mean_losses(fsdp, "vit"), ser["losses"], rtol=1e-5)
    for r in fsdp:  # the norm of the whole gradient, the same on every rank
        np.testing.assert_allclose(r["vit"]["norms"], ser["norms"], rtol=1e-5)
        assert_close(r["vit"]["final"], ser["final"], 1e-5, 2e-6, "ViT weight after 6 steps")


@pytest.mark.parametrize("key", ["tp_dp", "cp_dp"])
def test_fsdp_over_tensor_or_context_parallel_model_equals_serial(fsdp4, serial, key):
    """FSDP over dp = 2 of the hand-written tp = 2 (or cp = 2) layers: the serial run, with
    accumulation and clipping (the ranks of a replica report the replica's loss)."""
    ser = serial["vit"]
    assert all(r[key]["kind"] == "FSDPParallelViT" for r in fsdp4)
    np.testing.assert_allclose(mean_losses(fsdp4, key), ser["losses"], rtol=1e-5)
    for r in fsdp4:
        np.testing.assert_allclose(r[key]["norms"], ser["norms"], rtol=1e-5)
        assert_close(r[key]["final"], ser["final"], 1e-5, 2e-6, f"{key} weight after 6 steps")


def test_fsdp_x_tp_x_cp_equals_serial_and_reads_sharded_checkpoints(fsdp8, fsdp4, serial):
    ser = serial["vit"]
    np.testing.assert_allclose(mean_losses(fsdp8, "tp_cp_dp"), ser["losses"], rtol=1e-5)
    for r in fsdp8:
        np.testing.assert_allclose(r["tp_cp_dp"]["norms"], ser["norms"], rtol=1e-5)
        assert_close(r["tp_cp_dp"]["final"], ser["final"], 1e-5, 2e-6, "tp x cp x dp weight")
        assert_same_state(r["dcp_to_tp_cp"]["start"], saved(ckpt(fsdp4[0]["vit"]["run_dir"], 2)),
                          "FSDP on 4 ranks -> FSDP x tp x cp on 8")
    np.testing.assert_allclose(mean_losses(fsdp8, "dcp_to_tp_cp"), ser["losses"][2:], rtol=1e-5)


def test_fsdp_x_tp_checkpoint_resumes_on_fsdp_alone(fsdp2, fsdp4, serial):
    for r in fsdp2:
        assert_same_state(r["from_tp_dp"]["start"], saved(ckpt(fsdp4[0]["tp_dp"]["run_dir"], 2)),
                          "FSDP x tp -> FSDP")
    np.testing.assert_allclose(mean_losses(fsdp2, "from_tp_dp"), serial["vit"]["losses"][2:],
                               rtol=1e-5)


def test_fsdp_with_one_data_parallel_rank_under_tp_equals_serial(fsdp2, serial):
    assert fsdp2[0]["tp_only"]["kind"] == "ParallelViT"
    np.testing.assert_allclose(mean_losses(fsdp2, "tp_only"), serial["vit"]["losses"][:2],
                               rtol=1e-5)
    for r in fsdp2:
        np.testing.assert_allclose(r["tp_only"]["norms"], serial["vit"]["norms"][:2], rtol=1e-5)


def test_fsdp_with_activation_checkpointing_equals_serial(fsdp2, serial):
    np.testing.assert_allclose(mean_losses(fsdp2, "checkpointed"), serial["vit"]["losses"][:2],
                               rtol=1e-5)


def test_fsdp_in_bf16_keeps_fp32_shards_and_follows_fp32(fsdp2, serial):
    """Weights are gathered in bf16 for compute; the shards, and so the checkpoints, stay fp32."""
    for r in fsdp2:
        assert all(t.dtype == torch.float32 for t in r["bf16"]["final"].values())
    np.testing.assert_allclose(mean_losses(fsdp2, "bf16"), serial["vit"]["losses"][:2], rtol=2e-2)


def test_fsdp_unet_equals_serial(fsdp, serial):
    ser = serial["unet"]
    np.testing.assert_allclose(mean_losses(fsdp, "unet"), ser["losses"], rtol=1e-5)
    for r in fsdp:
        assert_close(r["unet"]["final"], ser["final"], 1e-5, 2e-6, "U-Net weight after 2 steps")


def test_memory_model_predicts_each_ranks_shards(fsdp, data):
    """Parameters and Adam state on each rank: benchmarks.memory_model's FSDP prediction."""
    from benchmarks.memory_model import predict_config

    n = len(fsdp)
    p = predict_config(vit_cfg(data["era5"], "/tmp", fsdp="true", **VIT), n, "flash", "cpu")
    assert all(r["vit"]["held"]["params"] == p.params for r in fsdp)
    # Adam's moments are the unpadded shards: pos_embed's on rank 0 alone, the largest rank
    assert max(r["vit"]["held"]["adam"] for r in fsdp) == fsdp[0]["vit"]["held"]["adam"] == p.adam
    whole = predict_config(vit_cfg(data["era5"], "/tmp", **VIT), 1, "flash", "cpu")
    assert p.params < whole.params / n * 1.1  # 1/N, plus pos_embed's padding


def test_every_rank_writes_its_shards_of_the_checkpoints(fsdp):
    ckpts = os.path.join(fsdp[0]["vit"]["run_dir"], "checkpoints")
    assert sorted(os.listdir(ckpts)) == [f"ckpt_{s:08d}.dcp" for s in (2, 4, 6)]
    files = sorted(os.listdir(os.path.join(ckpts, "ckpt_00000006.dcp")))
    assert files == sorted([".metadata", "train_state.pt"]
                           + [f"__{r}_0.distcp" for r in range(len(fsdp))])


# ----------------------------------------------------------------------------- resharding


def saved(path):
    """A checkpoint's contents in the serial layout: a DCP directory through the converter."""
    if os.path.isdir(path):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "converted.pt")
            convert(path, out)
            return torch.load(out, weights_only=True)
    return torch.load(path, weights_only=True)


def test_fsdp_4_ranks_resume_on_2_then_on_1(fsdp4, fsdp2, serial, data):
    ser = serial["vit"]
    first = ckpt(fsdp4[0]["vit"]["run_dir"], 2)
    for r in fsdp2:
        assert_same_state(r["from4"]["start"], saved(first), "4 -> 2 ranks")
    np.testing.assert_allclose(mean_losses(fsdp2, "from4"), ser["losses"][2:], rtol=1e-5)
    second = ckpt(fsdp2[0]["from4"]["run_dir"], 4)
    one = run_vit(data["era5"], str(data["base"] / "ws1"), True, second)
    assert_same_state(one["start"], saved(second), "2 -> 1 rank")
    np.testing.assert_allclose(one["losses"], ser["losses"][4:], rtol=1e-5)
    assert_close(one["final"], ser["final"], 1e-5, 2e-6, "weight after 4 -> 2 -> 1 ranks")


def test_serial_checkpoint_resumes_on_2_fsdp_ranks(fsdp2, serial):
    ser = serial["vit"]
    for r in fsdp2:
        assert_same_state(r["from1"]["start"], saved(ckpt(ser["run_dir"], 2)), "1 -> 2 ranks")
        assert_close(r["from1"]["final"], ser["final"], 1e-5, 2e-6, "weight after 1 -> 2 ranks")
    np.testing.assert_allclose(mean_losses(fsdp2, "from1"), ser["losses"][2:], rtol=1e-5)


def test_fsdp_and_ddp_checkpoints_load_into_each_others_runs(fsdp4, fsdp2, serial):
    ser = serial["vit"]
    for r in fsdp2:
        assert r["ddp_from_fsdp"]["kind"] == "ViT" and r["fsdp_from_ddp"]["kind"] == "FSDPViT"
        assert_same_state(r["ddp_from_fsdp"]["start"], saved(ckpt(fsdp4[0]["vit"]["run_dir"], 2)),
                          "FSDP -> DDP")
        assert_same_state(r["fsdp_from_ddp"]["start"], saved(ckpt(r["ddp"]["run_dir"], 2)),
                          "DDP -> FSDP")
    for key in ("ddp_from_fsdp", "fsdp_from_ddp"):
        np.testing.assert_allclose(mean_losses(fsdp2, key), ser["losses"][2:], rtol=1e-5)


# ----------------------------------------------------------------------------- stops and kills


def test_fsdp_stop_signal_and_kill_9_resume_exactly(tmp_path, data):
    """A stop signal on one rank: both write the step's sharded checkpoint and exit 3. kill -9 of
    both ranks while they write a sharded checkpoint every step. Each resumed run ends with the
    uninterrupted run's weights, Adam state and losses."""
    from distributed_harness import find_free_port
    from test_preemption import driver, launch_ranks
    from test_training import TINY_VIT, run_dir, tb_scalars

    args = TINY_VIT + ["--data_root", data["era5"], "--num_iters", "8", "--dropout", "0.1",
                       "--num_data_workers", "0", "--fsdp", "true"]
    ref_exp, exp = str(tmp_path / "ref"), str(tmp_path / "stopped")
    codes, outs = launch_ranks(tmp_path, args + ["--expdir", exp], SIGNAL_AT_STEP="3",
                               SIGNAL_RANK="1")
    assert codes == [3, 3], outs
    assert "Stopped on SIGUSR1 after step 6: checkpoint " in outs[0][0]
    assert "ckpt_00000006.dcp" in outs[0][0]
    ckpts = os.path.join(run_dir(exp, ws=2), "checkpoints")
    assert os.listdir(ckpts) == ["ckpt_00000006.dcp"]
    codes, outs = launch_ranks(tmp_path, args + ["--expdir", exp, "--resume", "auto"])
    assert codes == [0, 0], outs
    codes, outs = launch_ranks(tmp_path, args + ["--expdir", ref_exp])
    assert codes == [0, 0], outs
    a, b = (saved(ckpt(run_dir(e, ws=2), 8)) for e in (ref_exp, exp))
    assert_same_state(b, a, "resumed after a stop")
    ref_tb, got_tb = (tb_scalars(os.path.join(run_dir(e, ws=2), "tensorboard"))
                      for e in (ref_exp, exp))
    assert [e.value for e in got_tb.Scalars("Loss/train")] == \
        [e.value for e in ref_tb.Scalars("Loss/train")]

    killed = str(tmp_path / "killed")
    ckpts = os.path.join(run_dir(killed, ws=2), "checkpoints")
    port = find_free_port()
    procs = [preloaded.Popen(
        [sys.executable, driver(tmp_path), *args, "--expdir", killed, "--checkpoint_every", "1"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1"))
        for r in range(2)]
    try:
        deadline = time.monotonic() + 120
        while not (os.path.isdir(ckpts) and os.listdir(ckpts)):  # the first write has begun
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline
            time.sleep(0.005)
        time.sleep(random.uniform(0, 0.3))
    finally:
        for p in procs:
            p.kill()
            p.wait()
    written = os.listdir(ckpts)
    assert "ckpt_00000008.dcp" not in written, f"the run finished before it was killed: {written}"
    # killed while its first checkpoint was being written, the run left none to continue: then
    # --resume auto starts afresh in the next run directory, leaving run 0 as it was
    resumed = run_dir(killed, ws=2, run="0" if checkpoint.list_checkpoints(ckpts) else "1")
    codes, outs = launch_ranks(tmp_path, args + ["--expdir", killed, "--checkpoint_every",
                                                 "1", "--resume", "auto"])
    assert codes == [0, 0], outs
    assert f"Run directory: {resumed}\n" in outs[0][0] + outs[0][1], outs[0]
    assert_same_state(saved(ckpt(resumed, 8)), a, f"resumed after kill -9 {written}")
    got_tb = tb_scalars(os.path.join(resumed, "tensorboard"))
    assert [e.value for e in got_tb.Scalars("Loss/train")] == \
        [e.value for e in ref_tb.Scalars("Loss/train")]


def test_partial_and_damaged_sharded_checkpoints_fall_back(fsdp4, tmp_path):
    """A directory still being written (.tmp, as a kill -9 leaves it) is never a checkpoint;
    one whose shard file was cut short is skipped for the previous one."""
    src = os.path.dirname(ckpt(fsdp4[0]["vit"]["run_dir"], 6))
    ckpts = tmp_path / "checkpoints"
    shutil.copytree(src, ckpts)
    shutil.copytree(ckpts / "ckpt_00000006.dcp", ckpts / "ckpt_00000008.dcp.tmp")
    assert checkpoint.load_latest(str(ckpts))[1].endswith("ckpt_00000006.dcp")
    shard = ckpts / "ckpt_00000006.dcp" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    state, path = checkpoint.load_latest(str(ckpts))
    assert path.endswith("ckpt_00000004.dcp") and state["iteration"] == 4
    os.remove(ckpts / "ckpt_00000004.dcp" / "train_state.pt")
    assert checkpoint.load_latest(str(ckpts))[1].endswith("ckpt_00000002.dcp")


def test_init_from_a_sharded_checkpoint_starts_a_serial_run(fsdp4, data, tmp_path):
    """``--init_from ckpt_<step>.dcp``: the FSDP run's weights, read whole in one process (not its
    Adam state), start a new run; a damaged one or another directory is refused in one line."""
    src = ckpt(fsdp4[0]["vit"]["run_dir"], 6)
    cfg = vit_cfg(data["era5"], str(tmp_path / "tuned"), fsdp=False, init_from=src, num_iters=1)
    tr = Recording(cfg, setup_runtime(cfg))
    assert tr.iteration == 0 and not tr.optimizer.state
    assert_close(tr.model.state_dict(), fsdp4[0]["vit"]["final"], 0, 0, "weight from the shards")
    tr.fit()
    tr.loaders.close()
    assert tr.iteration == 1
    renamed = tmp_path / "pretrained"  # any name: a directory of DCP shards with .metadata
    shutil.copytree(src, renamed)
    cfg = vit_cfg(data["era5"], str(tmp_path / "renamed"), fsdp=False, init_from=renamed)
    assert_close(Recording(cfg, setup_runtime(cfg)).model.state_dict(),
                 fsdp4[0]["vit"]["final"], 0, 0, "weight from the renamed shards")
    damaged = tmp_path / "ckpt_00000006.dcp"
    shutil.copytree(src, damaged)
    os.remove(damaged / "train_state.pt")
    for bad, why in ((damaged, "does not load"), (tmp_path, "is a directory but not a sharded "
                                                             "checkpoint")):
        cfg = vit_cfg(data["era5"], str(tmp_path / "bad"), fsdp=False, init_from=str(bad))
        with pytest.raises(ValueError, match=f"init_from={bad} {why}"):
            Recording(cfg, setup_runtime(cfg))


def test_convert_command(fsdp4, tmp_path):
    run_ckpts = os.path.dirname(ckpt(fsdp4[0]["vit"]["run_dir"], 6))
    out = tmp_path / "newest.pt"
    p = preloaded.run([sys.executable, "-m", "engine.checkpoint_convert", run_ckpts, str(out)],
                      cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert f"{out}: step 6" in p.stdout
    whole = torch.load(out, weights_only=True)
    assert whole["iteration"] == 6 and whole["world_size"] == 4
    assert_close(whole["model"], fsdp4[0]["vit"]["final"], 0, 0, "converted weight")
    for bad in (str(out), str(tmp_path / "missing")):
        p = preloaded.run([sys.executable, "-m", "engine.checkpoint_convert", bad,
                           str(tmp_path / "x.pt")], cwd=ROOT, capture_output=True, text=True)
        assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
        assert p.stderr.startswith("error: ") and bad in p.stderr


def rank_compiled(era5, exp):
    return {"model": run_vit(era5, os.path.join(exp, "model"), True, num_iters=2,
                             enable_jit="true"),
            "blocks": run_vit(era5, os.path.join(exp, "blocks"), True, num_iters=2,
                              enable_jit="true", compile_blocks="true")}


@pytest.mark.compile
def test_compiled_fsdp_equals_serial(data, serial):
    """torch.compile of the sharded model (compiled after fully_shard), whole or block by block
    (compile_blocks: each sharded block compiled in place, FSDP's gathers around it eager)."""
    ranks = run_ranks(rank_compiled, 2, data["era5"], str(data["base"] / "compiled"), timeout=900)
    for scope in ("model", "blocks"):
        assert ranks[0][scope]["kind"] == "FSDPViT"
        np.testing.assert_allclose(np.mean([r[scope]["losses"] for r in ranks], axis=0),
                                   serial["vit"]["losses"][:2], rtol=1e-4, err_msg=scope)
