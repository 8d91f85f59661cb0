"""The Slurm launch scripts without Slurm: export_DDP_vars.sh against node lists (with and
without scontrol) and submit_pm.sh with srun, nsys and container runtimes stubbed on PATH."""
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

BASH = "/bin/bash"
EXPORT = os.path.join(ROOT, "export_DDP_vars.sh")
SUBMIT = os.path.join(ROOT, "submit_pm.sh")

NODE_LISTS = [
    ("vm", "vm"),
    ("nid001234", "nid001234"),
    ("nid[001-004]", "nid001"),
    ("nid[001-004,007]", "nid001"),
    ("nid[007,001-004]", "nid007"),
    ("a1,b2", "a1"),
    ("gpu[01-02],cpu5", "gpu01"),
    ("cpu5,gpu[01-02]", "cpu5"),
    ("nid00[1-4]", "nid001"),
    ("rack[1-2]-n[07-08]", "rack1-n07"),
    ("login[5]", "login5"),
]


def write_exe(path, text):
    path.write_text(text)
    path.chmod(0o755)
    return str(path)


def source_export(env, path_dir, extra=""):
    """Source export_DDP_vars.sh in a bash whose PATH is only ``path_dir``; print the result."""
    script = (f"set -euo pipefail; source {EXPORT}{extra}; "
              "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $MASTER_ADDR $MASTER_PORT\"")
    return subprocess.run([BASH, "-c", script], env=dict(env, PATH=str(path_dir)),
                          capture_output=True, text=True)


def slurm_env(nodelist, **kw):
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
           "SLURM_JOB_NODELIST": nodelist, "HOME": "/tmp"}
    env.update(kw)
    return env


@pytest.mark.parametrize("nodelist,first", NODE_LISTS)
def test_export_vars_without_scontrol(tmp_path, nodelist, first):
    r = source_export(slurm_env(nodelist), tmp_path)  # PATH holds no scontrol at all
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["5", "8", "1", first, "29500"]


def test_export_vars_use_scontrol_when_present(tmp_path):
    write_exe(tmp_path / "scontrol", '#!/bin/bash\n[ "$1 $2" = "show hostnames" ] && '
                                     'printf "host-from-scontrol\\nother\\n"\n')
    r = source_export(slurm_env("x[1-2]"), tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[3] == "host-from-scontrol"


def test_export_vars_fall_back_when_scontrol_fails(tmp_path):
    write_exe(tmp_path / "scontrol", "#!/bin/bash\nexit 1\n")
    r = source_export(slurm_env("gpu[01-02],cpu5"), tmp_path)
    assert r.returncode == 0 and r.stdout.split()[3] == "gpu01", r.stderr


def test_export_vars_port_override_and_step_nodelist(tmp_path):
    env = slurm_env("a[1-4]", SLURM_STEP_NODELIST="a[3-4]", MASTER_PORT="31000")
    r = source_export(env, tmp_path)
    assert r.stdout.split() == ["5", "8", "1", "a3", "31000"]


def test_export_vars_outside_slurm_fails_without_ending_the_shell(tmp_path):
    script = f"source {EXPORT} || echo still-here"
    r = subprocess.run([BASH, "-c", script], env={"PATH": str(tmp_path)}, capture_output=True,
                       text=True)
    assert r.returncode == 0 and r.stdout.strip() == "still-here"
    assert "source it inside a job step" in r.stderr


# ----------------------------------------------------------------------------- submit_pm.sh

PRINT_ARGS = """import json, os, sys
rank = os.environ.get("RANK")
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
        "EXPDIR", "ERA5_DATA_ROOT", "COSMO_DATA_ROOT", "CUDA_VISIBLE_DEVICES", "PYTHONUNBUFFERED",
        "CUDA_DEVICE_ORDER", "DDP_GPU_ORDER", "TORCHINDUCTOR_CACHE_DIR")
with open(os.path.join(os.environ["STUB_OUT"], f"rank{rank}.json"), "w") as f:
    json.dump({"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keys}}, f)
"""

# srun: note its options, then run the command once per task as SLURM_PROCID/LOCALID i. With
# STUB_TASK_CVD set, each task's CUDA_VISIBLE_DEVICES is replaced by it ("{i}": the task's
# number), or unset ("unset"), as Slurm 22.05 does in a plain srun / an srun --gpu-bind=none.
SRUN = """#!/bin/bash
opts=()
while [[ $# -gt 0 && $1 == -* ]]; do opts+=("$1"); shift; done
printf '%s\\n' "${opts[@]}" > "$STUB_OUT/srun.opts"
for ((i = 0; i < ${SLURM_NTASKS:-1}; i++)); do
    if [[ ${STUB_TASK_CVD:-} == unset ]]; then unset CUDA_VISIBLE_DEVICES
    elif [[ -n ${STUB_TASK_CVD:-} ]]; then export CUDA_VISIBLE_DEVICES=${STUB_TASK_CVD//'{i}'/$i}; fi
    SLURM_PROCID=$i SLURM_LOCALID=$i "$@" || exit $?
done
"""

# A wrapper (nsys, shifter, apptainer): note its arguments; run what follows its options.
WRAPPER = """#!/bin/bash
printf '%s\\n' "$@" > "$STUB_OUT/{name}.args"
while [[ $# -gt 0 && $1 != bash ]]; do shift; done
[[ $# -gt 0 ]] && exec "$@"
exit 0
"""

ODD_ARGS = ["--config", "quickstart", "--run_num", "two words", "--note", "$HOME `id` $(id)",
            "--q", "it's \"quoted\"", "--glob", "*", "--semi", "a;b|c&d", "--empty", "",
            "--newline", "line1\nline2", "--backslash", "a\\b", "--dollar=$1"]


@pytest.fixture
def stubs(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    write_exe(bin_dir / "srun", SRUN)
    script = tmp_path / "print_args.py"
    script.write_text(PRINT_ARGS)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "STUB_OUT": str(out),
           "SLURM_JOB_ID": "42", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "nid[007-008]",
           "SCRIPT": str(script), "PYTHON": sys.executable,
           # an empty sysfs: the GPU order never depends on the machine the tests run on
           "GPU_SYSFS_ROOT": str(tmp_path / "sys")}
    return dict(bin=bin_dir, out=out, env=env)


def submit(stubs, args, **env):
    e = dict(stubs["env"])
    e.update(env)
    return subprocess.run([BASH, SUBMIT, *args], cwd=ROOT, env=e, capture_output=True, text=True)


def rank_record(stubs, rank):
    with open(stubs["out"] / f"rank{rank}.json") as f:
        return json.load(f)


def test_submit_passes_every_argument_intact(stubs):
    r = submit(stubs, ODD_ARGS)
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        rec = rank_record(stubs, rank)
        assert rec["argv"] == ODD_ARGS
        env = rec["env"]
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == (str(rank), "2", str(rank))
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("nid007", "29500")
    assert "job 42: 2 rank(s) on nid[007-008], CPU only" in r.stdout


def test_submit_cpu_cluster_defaults(stubs):
    r = submit(stubs, ["--config", "quickstart"], SLURM_CPUS_PER_TASK="3", GPUS_PER_NODE="")
    assert r.returncode == 0, r.stderr
    env = rank_record(stubs, 0)["env"]
    assert env["OMP_NUM_THREADS"] == "3" and env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["EXPDIR"] == "./logs" and env["ERA5_DATA_ROOT"] == "/data/era5"
    assert env["COSMO_DATA_ROOT"] == "/data/cosmo" and env["PYTHONUNBUFFERED"] == "1"
    assert env["TORCHINDUCTOR_CACHE_DIR"] is None  # no $SCRATCH: torch's own, per node
    opts = (stubs["out"] / "srun.opts").read_text().split()
    assert "--cpus-per-task=3" in opts and not any(o.startswith("--gpu") for o in opts)


def test_submit_gpu_allocation(stubs):
    r = submit(stubs, [], SLURM_GPUS_ON_NODE="4", SCRATCH="/pscratch/u",
               SRUN_ARGS="--kill-on-bad-exit=1")
    assert r.returncode == 0, r.stderr
    opts = (stubs["out"] / "srun.opts").read_text().split()
    assert "--gpu-bind=none" in opts and "--kill-on-bad-exit=1" in opts
    env = rank_record(stubs, 1)["env"]
    assert env["CUDA_VISIBLE_DEVICES"] is None  # all of the node's GPUs; rank picks LOCAL_RANK
    assert env["EXPDIR"] == "/pscratch/u/dl-at-scale/logs"
    assert env["ERA5_DATA_ROOT"] == "/pscratch/u/era5"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/pscratch/u/dl-at-scale/torchinductor"
    assert "4 GPU(s) per node" in r.stdout
    submit(stubs, [], SCRATCH="/pscratch/u", TORCHINDUCTOR_CACHE_DIR="/mine")  # a user's: kept
    assert rank_record(stubs, 0)["env"]["TORCHINDUCTOR_CACHE_DIR"] == "/mine"
    # GPUS_PER_NODE=0 runs CPU ranks on the same allocation
    r = submit(stubs, [], SLURM_GPUS_ON_NODE="4", GPUS_PER_NODE="0")
    assert "CPU only" in r.stdout and rank_record(stubs, 0)["env"]["CUDA_VISIBLE_DEVICES"] == ""


def test_submit_profiling_needs_nsys(stubs):
    r = submit(stubs, ["--config", "x"], ENABLE_PROFILING="1")
    assert r.returncode == 1 and not (stubs["out"] / "srun.opts").exists()
    assert "ENABLE_PROFILING=1 but nsys" in r.stderr


def test_submit_profiling_wraps_each_rank_in_nsys(stubs):
    write_exe(stubs["bin"] / "nsys", WRAPPER.format(name="nsys"))
    r = submit(stubs, ["--config", "a b"], ENABLE_PROFILING="1", PROFILE_OUTPUT="4gpu_baseline")
    assert r.returncode == 0, r.stderr
    args = (stubs["out"] / "nsys.args").read_text().splitlines()
    assert args[:11] == ["profile", "--trace=cuda,nvtx", "-c", "cudaProfilerApi", "--kill",
                         "none", "-f", "true", "-o", "4gpu_baseline_rank%q{SLURM_PROCID}",
                         sys.executable]
    assert args[-2:] == ["--config", "a b"]
    r = submit(stubs, [], ENABLE_PROFILING="1", PROFILE_OUTPUT="one", SLURM_NTASKS="1")
    assert (stubs["out"] / "nsys.args").read_text().splitlines()[9] == "one"


@pytest.mark.parametrize("runtime", ["shifter", "apptainer", "singularity"])
def test_submit_in_container(stubs, runtime):
    write_exe(stubs["bin"] / runtime, WRAPPER.format(name=runtime))
    var = {"shifter": "SHIFTER_IMAGE"}.get(runtime, "APPTAINER_IMAGE")
    extra = {"SHIFTER_MODULES": "gpu,nccl-plugin"} if runtime == "shifter" else {}
    r = submit(stubs, ODD_ARGS, SLURM_GPUS_ON_NODE="4", **{var: "img:1"}, **extra)
    assert r.returncode == 0, r.stderr
    args = (stubs["out"] / f"{runtime}.args").read_text().splitlines()
    head = args[:args.index("bash")]
    if runtime == "shifter":
        assert head == ["--image=img:1", "--module=gpu,nccl-plugin"]
    else:
        assert head == ["exec", "--nv", "img:1"]
    assert rank_record(stubs, 1)["argv"] == ODD_ARGS  # still intact through the container


def test_submit_errors(stubs):
    r = submit(stubs, [], SLURM_JOB_ID="")
    assert r.returncode == 1 and "not inside a Slurm job" in r.stderr
    r = submit(stubs, [], SCRIPT="train_mp_missing.py")
    assert r.returncode == 1 and "SCRIPT=train_mp_missing.py not found" in r.stderr
    r = submit(stubs, [], SHIFTER_IMAGE="a", APPTAINER_IMAGE="b")
    assert r.returncode == 1 and "choose one" in r.stderr
    r = submit(stubs, [], SHIFTER_IMAGE="a")
    assert r.returncode == 1 and "shifter is not on this system" in r.stderr


def test_submit_header_has_perlmutter_defaults_sbatch_reads():
    lines = open(SUBMIT).read().splitlines()
    assert lines[0] == "#!/bin/bash"
    first_command = next(i for i, ln in enumerate(lines) if ln.strip() and not ln.startswith("#"))
    directives = [ln.split(None, 1)[1] for ln in lines if ln.startswith("#SBATCH")]
    late = [ln for ln in lines[first_command:] if ln.startswith("#SBATCH")]
    assert not late, "sbatch ignores #SBATCH lines after the first command"
    for d in ("-o %x-%j.out", "-C gpu", "--ntasks-per-node=4", "--gpus-per-node=4",
              "--cpus-per-task=32"):
        assert d in directives
    assert any(re.match(r"-q \w+", d) for d in directives)
    assert any(re.match(r"-t \d", d) for d in directives)
    assert "sbatch --gpus-per-node=0 --constraint= --cpus-per-task=1" in open(SUBMIT).read()
    r = subprocess.run([BASH, "-n", SUBMIT], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_submit_names_the_run_after_the_job_unless_given(stubs):
    """A requeued job keeps its job id, so job<id> is its own run directory to resume."""
    r = submit(stubs, ["--config", "x"])
    assert r.returncode == 0, r.stderr
    assert rank_record(stubs, 0)["argv"] == ["--run_num", "job42", "--config", "x"]
    for given in (["--run_num", "mine"], ["--run_num=mine"]):
        r = submit(stubs, ["--config", "x", *given])
        assert rank_record(stubs, 0)["argv"] == ["--config", "x", *given]


# ------------------------------------------------------------- GPU order (NUMA) and shifter

# nvidia-smi of a Perlmutter GPU node: 4 A100s, PCI order (STUB_GPUS: only these); their NUMA
# nodes come from sysfs.
NVIDIA_SMI = """#!/bin/bash
[[ "$*" == "--query-gpu=index,pci.bus_id --format=csv,noheader" ]] || exit 2
bus=(03 41 82 C1)
for i in ${STUB_GPUS:-0 1 2 3}; do echo "$i, 00000000:${bus[i]}:00.0"; done
"""
BUS_IDS = ["0000:03:00.0", "0000:41:00.0", "0000:82:00.0", "0000:c1:00.0"]


def wire_gpus(stubs, numa_nodes):
    """A node whose GPU i hangs off NUMA node numa_nodes[i]: nvidia-smi and sysfs as on a real
    one (sysfs names PCI devices with a 4-digit domain and lower-case hex)."""
    write_exe(stubs["bin"] / "nvidia-smi", NVIDIA_SMI)
    sysfs = stubs["env"]["GPU_SYSFS_ROOT"]
    for bus, node in zip(BUS_IDS, numa_nodes):
        os.makedirs(os.path.join(sysfs, "bus", "pci", "devices", bus), exist_ok=True)
        with open(os.path.join(sysfs, "bus", "pci", "devices", bus, "numa_node"), "w") as f:
            f.write(f"{node}\n")


def run_gpus(stubs, ranks=4, **env):
    """submit_pm.sh with ``ranks`` ranks: its output and the CUDA_VISIBLE_DEVICES of each rank."""
    for old in stubs["out"].glob("rank*.json"):
        old.unlink()
    r = submit(stubs, [], SLURM_NTASKS=str(ranks), **env)
    assert r.returncode == 0, r.stderr
    envs = [rank_record(stubs, i)["env"] for i in range(ranks)]
    return r.stdout, envs, {e["CUDA_VISIBLE_DEVICES"] for e in envs}


PERLMUTTER = dict(SLURM_GPUS_ON_NODE="4", NERSC_HOST="perlmutter")


def test_perlmutter_ranks_get_the_gpus_in_numa_order(stubs):
    """Without a readable wiring, a 4-GPU Perlmutter node gets 3,2,1,0 (GPU 3 sits on NUMA 0,
    where Slurm puts local task 0) in every rank, also where srun rewrites the variable."""
    # srun passes the variable on / drops it / rewrites it in every task
    for where, task_cvd in (("NERSC_HOST", ""), ("SLURM_CLUSTER_NAME", "unset"),
                            ("NERSC_HOST", "0,1,2,3")):
        out, envs, seen = run_gpus(stubs, SLURM_GPUS_ON_NODE="4", STUB_TASK_CVD=task_cvd,
                                   **{where: "perlmutter"})
        assert seen == {"3,2,1,0"}, (where, task_cvd)
        assert {e["CUDA_DEVICE_ORDER"] for e in envs} == {"PCI_BUS_ID"}
        assert "gpus: CUDA_VISIBLE_DEVICES=3,2,1,0 (local rank i uses its i-th GPU), from " \
               "Perlmutter's wiring" in out


def test_slurms_own_listing_is_replaced_a_users_own_order_kept(stubs):
    for slurms in ("0,1,2,3", "NoDevFiles"):  # what Slurm may set in the batch step
        assert run_gpus(stubs, CUDA_VISIBLE_DEVICES=slurms, **PERLMUTTER)[2] == {"3,2,1,0"}
    _, _, seen = run_gpus(stubs, CUDA_VISIBLE_DEVICES="4,5,6,7", SLURM_JOB_GPUS="4,5,6,7",
                          **PERLMUTTER)
    assert seen == {"3,2,1,0"}
    for mine, task_cvd in (("1,0,3,2", ""), ("1,0,3,2", "unset"), ("1,0,3,2", "0,1,2,3"),
                           ("", "")):
        out, envs, seen = run_gpus(stubs, CUDA_VISIBLE_DEVICES=mine, STUB_TASK_CVD=task_cvd,
                                   **PERLMUTTER)
        assert seen == {mine}, task_cvd  # also where srun drops or rewrites it
        assert {e["CUDA_DEVICE_ORDER"] for e in envs} == {None}
        assert f"gpus: CUDA_VISIBLE_DEVICES={mine}, yours, kept" in out


@pytest.mark.parametrize("numa,order", [
    ([3, 2, 1, 0], "3,2,1,0"),  # Perlmutter
    ([1, 1, 0, 0], "2,3,0,1"),  # two sockets, the GPUs of socket 0 on the higher PCI addresses
    ([0, 0, 1, 1], None),       # already in order: left alone
    ([0, 1, 2, 3], None),
])
def test_gpu_order_read_from_the_nodes_numa_wiring(stubs, numa, order):
    wire_gpus(stubs, numa)
    out, _, seen = run_gpus(stubs, SLURM_GPUS_ON_NODE="4", STUB_TASK_CVD="0,1,2,3")
    assert seen == {order or "0,1,2,3"}  # None: Slurm's own listing, untouched
    if order:
        assert f"gpus: CUDA_VISIBLE_DEVICES={order} (local rank i uses its i-th GPU), from the " \
               "GPUs' NUMA domains" in out
    else:
        assert "gpus: the natural order" in out
        assert run_gpus(stubs, **PERLMUTTER)[2] == {None}  # the wiring read beats Perlmutter's


def test_unreadable_wiring_falls_back_to_perlmutters_or_nothing(stubs):
    wire_gpus(stubs, [-1, -1, -1, -1])  # firmware that does not say
    assert run_gpus(stubs, SLURM_GPUS_ON_NODE="4")[2] == {None}
    assert run_gpus(stubs, **PERLMUTTER)[2] == {"3,2,1,0"}
    # 2 GPUs allocated: whether nvidia-smi shows the node's 4 or the job's 2 under their node
    # numbers, no order (CUDA numbers the job's 2 GPUs 0 and 1), not even Perlmutter's
    wire_gpus(stubs, [3, 2, 1, 0])
    for shown in ("0 1 2 3", "2 3"):
        _, _, seen = run_gpus(stubs, 2, SLURM_GPUS_ON_NODE="2", NERSC_HOST="perlmutter",
                              STUB_GPUS=shown)
        assert seen == {None}
    # ... but shown as 0 and 1, the job's 2 get their own order (here on NUMA nodes 3 and 2)
    assert run_gpus(stubs, 2, SLURM_GPUS_ON_NODE="2", STUB_GPUS="0 1")[2] == {"1,0"}


def test_gpu_order_variable(stubs):
    out, _, seen = run_gpus(stubs, GPU_ORDER="none", **PERLMUTTER)
    assert seen == {None} and "gpus: GPU_ORDER=none" in out
    # a list wins over the wiring and over a CUDA_VISIBLE_DEVICES of one's own
    wire_gpus(stubs, [3, 2, 1, 0])
    out, _, seen = run_gpus(stubs, GPU_ORDER="1,0,3,2", CUDA_VISIBLE_DEVICES="0,1", **PERLMUTTER)
    assert seen == {"1,0,3,2"}
    assert "gpus: CUDA_VISIBLE_DEVICES=1,0,3,2 (local rank i uses its i-th GPU), from GPU_ORDER" \
        in out
    for bad, why in (("3,2,1,x", "give auto, none or the GPUs"), ("3,3,1,0", "names a GPU twice"),
                     ("4,5,6,7", "this node has GPUs 0 to 3")):
        (stubs["out"] / "srun.opts").unlink(missing_ok=True)
        r = submit(stubs, [], GPU_ORDER=bad, **PERLMUTTER)
        assert r.returncode == 1 and why in r.stderr, (bad, r.stderr)
        assert not (stubs["out"] / "srun.opts").exists()  # refused before srun
    # CPU ranks: no order, whatever GPU_ORDER says
    assert run_gpus(stubs, GPU_ORDER="3,2,1,0", GPUS_PER_NODE="0", **PERLMUTTER)[2] == {""}


def test_export_vars_put_the_order_back_unless_the_task_has_fewer_gpus(tmp_path):
    show = '; echo "${CUDA_VISIBLE_DEVICES-unset}"'
    cases = [({"DDP_GPU_ORDER": "3,2,1,0"}, "3,2,1,0"),
             ({"DDP_GPU_ORDER": "3,2,1,0", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, "3,2,1,0"),
             ({"DDP_GPU_ORDER": "3,2,1,0", "CUDA_VISIBLE_DEVICES": "2"}, "2"),  # --gpus-per-task
             ({"DDP_GPU_ORDER": "3,2,1,0", "CUDA_VISIBLE_DEVICES": ""}, ""),
             ({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, "0,1,2,3"),  # not from submit_pm.sh
             ({}, "unset")]
    for extra, expected in cases:
        r = source_export(slurm_env("nid[1-2]", **extra), tmp_path, show)
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines()[0] == expected, (extra, r.stdout)


@pytest.mark.parametrize("modules,gpus,expected", [
    (None, "4", ["--module=gpu,nccl-plugin"]),  # the default on GPU nodes
    ("gpu", "4", ["--module=gpu"]),
    ("none", "4", []),
    ("", "4", []),
    (None, "", []),                             # CPU ranks: no GPU modules
])
def test_shifter_modules_default_to_gpu_and_nccl_plugin(stubs, modules, gpus, expected):
    write_exe(stubs["bin"] / "shifter", WRAPPER.format(name="shifter"))
    extra = {} if modules is None else {"SHIFTER_MODULES": modules}
    r = submit(stubs, [], SHIFTER_IMAGE="img:1", SLURM_GPUS_ON_NODE=gpus, **extra)
    assert r.returncode == 0, r.stderr
    args = (stubs["out"] / "shifter.args").read_text().splitlines()
    assert args[:args.index("bash")] == ["--image=img:1", *expected]
