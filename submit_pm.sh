#!/bin/bash
#SBATCH -J dl-train
#SBATCH -o %x-%j.out
#SBATCH -C gpu
#SBATCH -q regular
#SBATCH -t 01:00:00
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
##SBATCH -A m0000_g
##SBATCH --reservation=my_reservation
#
# Data-parallel training under Slurm: one rank per task, each task one GPU (4 per Perlmutter
# node), started by srun; every task sources export_DDP_vars.sh, then runs the entry script with
# all the arguments given after submit_pm.sh, unchanged.
#
#   sbatch -n 8 submit_pm.sh --yaml_config config/UNet.yaml --config bs512_opt    # 2 nodes
#   sbatch -N 4 -t 30 submit_pm.sh --config bs256_opt                              # ViT, 16 GPUs
#   SCRIPT=train_mp.py sbatch -N 1 submit_pm.sh --config mp --tensor_parallel 4
#   ENABLE_PROFILING=1 PROFILE_OUTPUT=4gpu sbatch -n 4 submit_pm.sh --config bs64_opt \
#       --num_epochs 4 --local_batch_size 16 --enable_manual_profiling
#
# Options given to sbatch override the #SBATCH lines above (delete a second "#" to enable a
# line). Account and reservation can also come from the environment: SBATCH_ACCOUNT,
# SBATCH_RESERVATION, SBATCH_QOS.
#
# Clusters without GPUs: the #SBATCH lines ask for GPUs, a "gpu" node feature and 32 CPUs per
# task; turn these off on the command line, and the ranks run on CPUs (gloo) with this same script:
#
#   sbatch --gpus-per-node=0 --constraint= --cpus-per-task=1 -n 2 submit_pm.sh --config quickstart
#
# Time limits and preemption: Slurm sends this script USR1 SECONDS before the time limit
# (--signal=B:USR1@SECONDS above, 120; #SBATCH lines cannot read variables, so change SECONDS
# on the command line: sbatch --signal=B:USR1@300 ...). The script passes it on to the ranks,
# which write a checkpoint at their next log point and exit with code 3; the job then requeues
# itself (--requeue) and the requeued job (SLURM_RESTART_COUNT above 0) runs with --resume auto:
# it continues from the newest checkpoint of its run directory. A run that finished (exit 0) or
# failed (exit 1 or 2) is not requeued. Choose SECONDS above 2 x log_every + 2 steps plus a
# checkpoint write; --open-mode=append keeps every attempt's output in one file.
#
# GPU or CPU ranks follow the allocation: with GPUs on the node, each rank uses CUDA device
# LOCAL_RANK and NCCL; without (or with GPUS_PER_NODE=0), CPU and gloo. Which physical GPU is
# CUDA device LOCAL_RANK is chosen so that it sits on the NUMA domain of the rank's cores (see
# "GPU order" below and GPU_ORDER): on Perlmutter, CUDA_VISIBLE_DEVICES=3,2,1,0.
#
# Software: a container (SHIFTER_IMAGE, PODMAN_IMAGE or APPTAINER_IMAGE below; docker/README.md
# builds one from this repository) or the site's PyTorch module, loaded before sbatch so that
# the job inherits it. On Perlmutter, "module avail pytorch" lists the versions:
#
#   module load pytorch && sbatch -n 8 submit_pm.sh --config bs256_opt
#
# Environment (export before sbatch; the job inherits it):
#   SCRIPT            entry script (train.py)
#   PYTHON            interpreter inside the task (python)
#   ERA5_DATA_ROOT    ERA5 directory the ViT configs read ($SCRATCH/era5, else /data/era5)
#   COSMO_DATA_ROOT   cosmology directory the U-Net configs read ($SCRATCH/cosmo, else /data/cosmo)
#   EXPDIR            root of the run directories ($SCRATCH/dl-at-scale/logs, else ./logs)
#   TORCHINDUCTOR_CACHE_DIR  torch.compile's caches, shared by the job's ranks and later jobs
#                     ($SCRATCH/dl-at-scale/torchinductor; else torch's /tmp/torchinductor_$USER,
#                     one per node)
#   SHIFTER_IMAGE     run every rank in this shifter image, e.g. nersc/pytorch:24.06.01
#   SHIFTER_MODULES   shifter modules for it: gpu,nccl-plugin on GPU nodes unless set (the
#                     driver libraries and NCCL's Slingshot plugin, see below); none: no module
#   APPTAINER_IMAGE   run every rank in this apptainer (or singularity) image file; bind data
#                     directories with APPTAINER_BIND=/pscratch
#   PODMAN_IMAGE      run every rank in this podman-hpc (else podman) image, e.g. one built
#                     with podman-hpc build and podman-hpc migrate; it sees the submit
#                     directory, $SCRATCH and the host network, and --gpu with GPUs
#   PODMAN_ARGS       extra podman-hpc run options, e.g. "--nccl" or "-v /global/cfs:/global/cfs"
#   HDF5_USE_FILE_LOCKING  FALSE (the data are only read; locks fail on parallel file systems)
#   FI_MR_CACHE_MONITOR    userfaultfd (libfabric's memory cache monitor for multi-node NCCL
#                          over Slingshot)
#   ENABLE_PROFILING  1: wrap every rank in "nsys profile" (Nsight Systems must be installed)
#   PROFILE_OUTPUT    report name (profile); with several ranks, _rank<N> is appended per rank
#   GPUS_PER_NODE     0: CPU ranks even when the nodes have GPUs; unset: what Slurm allocated
#   GPU_ORDER         the node's GPUs in local-rank order, as CUDA_VISIBLE_DEVICES lists them:
#                     auto (default: by NUMA domain, from nvidia-smi and sysfs, else 3,2,1,0 on
#                     Perlmutter; a CUDA_VISIBLE_DEVICES of your own is kept, but Slurm puts
#                     its own in the job where it manages GPU devices), none (leave
#                     CUDA_VISIBLE_DEVICES as Slurm or you set it), or a list, e.g. 3,2,1,0
#   MASTER_PORT       rendezvous port (29500); jobs sharing a node need different ones
#   SRUN_ARGS         extra srun options, e.g. "--kill-on-bad-exit=1"
set -euo pipefail

die() { echo "submit_pm.sh: error: $*" >&2; exit 1; }

# The time limit's warning (USR1) may come at any moment, even before the ranks run (Slurm may
# send it up to 60 s early): note it here; it is passed on to the ranks once srun runs.
stop_requested=0
trap 'stop_requested=1' USR1

[[ -n ${SLURM_JOB_ID:-} ]] || die "not inside a Slurm job: submit with 'sbatch -n N submit_pm.sh ARGS'"
[[ -f export_DDP_vars.sh ]] || die "export_DDP_vars.sh is not in $PWD: submit from the repository root"
SCRIPT=${SCRIPT:-train.py}
PYTHON=${PYTHON:-python}
[[ -f $SCRIPT ]] || die "SCRIPT=$SCRIPT not found in $PWD"

# Data and run locations: the configs read these variables.
export ERA5_DATA_ROOT=${ERA5_DATA_ROOT:-${SCRATCH:-/data}/era5}
export COSMO_DATA_ROOT=${COSMO_DATA_ROOT:-${SCRATCH:-/data}/cosmo}
if [[ -z ${EXPDIR:-} ]]; then
    if [[ -n ${SCRATCH:-} ]]; then EXPDIR=$SCRATCH/dl-at-scale/logs; else EXPDIR=./logs; fi
fi
export EXPDIR
# torch.compile's caches on the shared file system: every rank and every later job of a config
# finds what the first compiled (docs/performance.md, "Seconds to the first step")
if [[ -z ${TORCHINDUCTOR_CACHE_DIR:-} && -n ${SCRATCH:-} ]]; then
    export TORCHINDUCTOR_CACHE_DIR=$SCRATCH/dl-at-scale/torchinductor
fi
export PYTHONUNBUFFERED=1  # the job's output file follows the run as it goes
# Every rank opens the same read-only HDF5 files; file locking on Lustre/NFS scratch fails or
# serializes the opens, so it is off unless set otherwise.
export HDF5_USE_FILE_LOCKING=${HDF5_USE_FILE_LOCKING:-FALSE}
# Multi-node NCCL over libfabric (Slingshot): the default memory-registration cache monitor
# can miss freed buffers and hang or corrupt transfers; userfaultfd tracks them.
export FI_MR_CACHE_MONITOR=${FI_MR_CACHE_MONITOR:-userfaultfd}
# One thread per allocated CPU of the task (torch would otherwise use every core of the node).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}

# GPUs per node of this allocation (0 on a CPU-only cluster or with GPUS_PER_NODE=0).
gpus=${GPUS_PER_NODE:-}
if [[ -z $gpus ]]; then
    gpus=${SLURM_GPUS_ON_NODE:-}
    if [[ -z $gpus && -n ${SLURM_JOB_GPUS:-} ]]; then
        IFS=, read -ra ids <<<"$SLURM_JOB_GPUS"
        gpus=${#ids[@]}
    fi
    if [[ -z $gpus && ${SLURM_GPUS_PER_NODE:-} =~ ([0-9]+)$ ]]; then gpus=${BASH_REMATCH[1]}; fi
    gpus=${gpus:-0}
fi
[[ $gpus =~ ^[0-9]+$ ]] || die "GPUS_PER_NODE=$gpus is not a number"

srun_args=(-u)
[[ -n ${SLURM_CPUS_PER_TASK:-} ]] && srun_args+=("--cpus-per-task=$SLURM_CPUS_PER_TASK")
if ((gpus > 0)); then
    srun_args+=(--gpu-bind=none)  # every rank sees the node's GPUs and picks GPU LOCAL_RANK
else
    export CUDA_VISIBLE_DEVICES=""  # CPU ranks: gloo, even where GPUs exist
fi
read -ra extra <<<"${SRUN_ARGS:-}"
srun_args+=("${extra[@]}")

# GPU order. Slurm gives each task its own block of cores (--cpus-per-task), local task i the
# i-th block: on a Perlmutter GPU node (one 64-core EPYC in 4 NUMA domains of 16 cores, 4
# A100s, 4 tasks of 32 hardware threads) local task i runs on NUMA domain i. Its GPU is CUDA
# device LOCAL_RANK, the LOCAL_RANK-th GPU of CUDA_VISIBLE_DEVICES (all, in PCI order, when
# unset). But the GPUs are attached the other way round: GPU 0 to the last NUMA domain, GPU 3
# to the first. In the natural order every rank's data loader workers, pinned host buffers and
# host-to-device copies go through another NUMA domain (across the CPU's internal fabric) to
# reach its GPU, and the rank's local memory is not the GPU's; listing the GPUs by the NUMA
# domain they hang off (3,2,1,0 there) gives each rank the GPU next to its cores.
# GPU_ORDER=auto reads that wiring from this node (nvidia-smi: each GPU's PCI address; sysfs:
# each PCI device's NUMA node), so another node type gets its own order, or none where the
# natural one is already right; where it cannot be read, Perlmutter's known wiring is used on
# Perlmutter. All the job's nodes are taken to be wired like this one. A CUDA_VISIBLE_DEVICES
# of the user's own (not Slurm's listing of the allocated GPUs) is kept.
gpus_by_numa() {
    # This node's GPUs (nvidia-smi's numbers, which follow the PCI addresses) sorted by the NUMA
    # node each is attached to, e.g. "3,2,1,0"; fails unless GPUs 0 to $1 - 1, and no others,
    # are found, each with its NUMA node (a job given part of a node may see other numbers).
    local want=$1 sysfs=${GPU_SYSFS_ROOT:-/sys} index bus node
    local -a pairs=() seen=()
    command -v nvidia-smi >/dev/null 2>&1 || return 1
    while IFS=', ' read -r index bus; do
        bus=${bus,,}  # nvidia-smi: 00000000:C1:00.0; sysfs: 0000:c1:00.0
        [[ -r $sysfs/bus/pci/devices/$bus/numa_node ]] || bus=${bus#0000}
        [[ $index =~ ^[0-9]+$ && -r $sysfs/bus/pci/devices/$bus/numa_node ]] || return 1
        node=$(<"$sysfs/bus/pci/devices/$bus/numa_node")
        [[ $node =~ ^[0-9]+$ ]] || return 1  # -1: the firmware does not say
        ((10#$index < want)) && [[ -z ${seen[10#$index]:-} ]] || return 1
        seen[10#$index]=1
        pairs+=("$node $index")
    done < <(nvidia-smi --query-gpu=index,pci.bus_id --format=csv,noheader 2>/dev/null)
    ((${#pairs[@]} == want)) || return 1
    printf '%s\n' "${pairs[@]}" | sort -n -k1,1 -k2,2 | cut -d' ' -f2 | paste -sd, -
}
slurm_listing() {
    # Whether $1 is what Slurm itself puts in CUDA_VISIBLE_DEVICES for the allocated GPUs: their
    # numbers within the job ($2: 0,1,...), or on the node (SLURM_JOB_GPUS), or NoDevFiles.
    [[ -n $1 && ($1 == "$2" || $1 == NoDevFiles || $1 == "${SLURM_JOB_GPUS:-}" ||
                 $1 == "${SLURM_STEP_GPUS:-}") ]]
}
# The ranks' CUDA_VISIBLE_DEVICES also goes to them as DDP_GPU_ORDER, which export_DDP_vars.sh
# puts back in every task: a step's tasks do not simply inherit the variable from this script
# (Slurm 22.05 unsets it in the tasks of "srun --gpu-bind=none", and sets its own listing, e.g.
# 0,1,2,3, in those of a plain srun).
unset DDP_GPU_ORDER
gpu_order=""         # the CUDA_VISIBLE_DEVICES of the ranks; "": left as it is
gpu_note=""
if ((gpus > 0)); then
    natural=$(seq -s, 0 $((gpus - 1)))
    case ${GPU_ORDER:-auto} in
        none) gpu_note="GPU_ORDER=none" ;;
        auto)
            if [[ -n ${CUDA_VISIBLE_DEVICES+set} ]] &&
                ! slurm_listing "$CUDA_VISIBLE_DEVICES" "$natural"; then
                gpu_note="CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES, yours, kept"
                # srun may drop or rewrite it in the tasks: export_DDP_vars.sh puts it back
                if [[ -n $CUDA_VISIBLE_DEVICES ]]; then export DDP_GPU_ORDER=$CUDA_VISIBLE_DEVICES; fi
            elif gpu_order=$(gpus_by_numa "$gpus"); then
                gpu_note="the GPUs' NUMA domains"
            elif ((gpus == 4)) && [[ ${NERSC_HOST:-} == perlmutter ||
                                     ${SLURM_CLUSTER_NAME:-} == perlmutter ]]; then
                gpu_order=3,2,1,0
                gpu_note="Perlmutter's wiring"
            fi
            if [[ $gpu_order == "$natural" ]]; then
                gpu_order=""
                gpu_note="the natural order, which the GPUs' NUMA domains already follow"
            fi
            ;;
        *)
            [[ $GPU_ORDER =~ ^[0-9]+(,[0-9]+)*$ ]] ||
                die "GPU_ORDER=$GPU_ORDER: give auto, none or the GPUs in rank order, e.g. 3,2,1,0"
            IFS=, read -ra ids <<<"$GPU_ORDER"
            (($(printf '%s\n' "${ids[@]}" | sort -u | wc -l) == ${#ids[@]})) ||
                die "GPU_ORDER=$GPU_ORDER names a GPU twice"
            for id in "${ids[@]}"; do
                ((10#$id < gpus)) || die "GPU_ORDER=$GPU_ORDER: this node has GPUs 0 to $((gpus - 1))"
            done
            gpu_order=$GPU_ORDER
            gpu_note="GPU_ORDER"
            ;;
    esac
fi
if [[ -n $gpu_order ]]; then
    export CUDA_VISIBLE_DEVICES=$gpu_order DDP_GPU_ORDER=$gpu_order
    # The numbers are nvidia-smi's, which follow the PCI addresses; CUDA's own default order
    # (fastest first) is the same on a node of identical GPUs, and made the same on any other.
    export CUDA_DEVICE_ORDER=${CUDA_DEVICE_ORDER:-PCI_BUS_ID}
    gpu_note="CUDA_VISIBLE_DEVICES=$gpu_order (local rank i uses its i-th GPU), from $gpu_note"
fi

# Optional container: shifter (NERSC), apptainer/singularity or podman-hpc/podman.
container=()
images=()
for var in SHIFTER_IMAGE APPTAINER_IMAGE PODMAN_IMAGE; do
    if [[ -n ${!var:-} ]]; then images+=("$var"); fi
done
if ((${#images[@]} > 1)); then
    die "${images[*]} are set: choose one"
elif [[ -n ${SHIFTER_IMAGE:-} ]]; then
    command -v shifter >/dev/null || die "SHIFTER_IMAGE is set but shifter is not on this system"
    container=(shifter "--image=$SHIFTER_IMAGE")
    # NERSC's shifter modules for GPU jobs: "gpu" brings the host's GPU driver libraries into
    # the image; "nccl-plugin" the libfabric network plugin for NCCL, without which NCCL cannot
    # use the Slingshot NICs: it falls back to TCP sockets between nodes, with no GPUDirect RDMA
    # (far slower multi-node all-reduces). Set SHIFTER_MODULES to choose others (or "none", or
    # empty, for no module).
    modules=${SHIFTER_MODULES-}
    if [[ -z ${SHIFTER_MODULES+set} ]] && ((gpus > 0)); then modules=gpu,nccl-plugin; fi
    if [[ -n $modules && $modules != none ]]; then container+=("--module=$modules"); fi
elif [[ -n ${APPTAINER_IMAGE:-} ]]; then
    runtime=$(command -v apptainer || command -v singularity) ||
        die "APPTAINER_IMAGE is set but neither apptainer nor singularity is installed"
    container=("$runtime" exec)
    ((gpus > 0)) && container+=(--nv)
    container+=("$APPTAINER_IMAGE")
elif [[ -n ${PODMAN_IMAGE:-} ]]; then
    runtime=$(command -v podman-hpc || command -v podman) ||
        die "PODMAN_IMAGE is set but neither podman-hpc nor podman is installed"
    # podman passes no environment by default: the variables the ranks read, by name.
    container=("$runtime" run --rm --net host -v "$PWD:$PWD" -w "$PWD")
    if [[ -n ${SCRATCH:-} ]]; then container+=(-v "$SCRATCH:$SCRATCH"); fi
    # torch's own (TORCHINDUCTOR_CACHE_DIR, PYTORCH_CUDA_ALLOC_CONF) and the TF32 switch too.
    for var in 'SLURM_*' 'NCCL_*' 'FI_*' EXPDIR ERA5_DATA_ROOT COSMO_DATA_ROOT PYTHONUNBUFFERED \
               OMP_NUM_THREADS HDF5_USE_FILE_LOCKING CUDA_VISIBLE_DEVICES CUDA_DEVICE_ORDER \
               DDP_GPU_ORDER MASTER_PORT 'TORCH*' 'PYTORCH_*' NVIDIA_TF32_OVERRIDE; do
        container+=(-e "$var")
    done
    if ((gpus > 0)) && [[ $runtime == */podman-hpc ]]; then container+=(--gpu); fi
    read -ra podman_args <<<"${PODMAN_ARGS:-}"
    container+=("${podman_args[@]}" "$PODMAN_IMAGE")
fi

# Optional Nsight Systems profile of each rank, recording the window the run brackets with the
# CUDA profiler API (--enable_manual_profiling).
profiler=()
if [[ ${ENABLE_PROFILING:-0} == 1 ]]; then
    "${container[@]}" bash -c 'command -v nsys' >/dev/null 2>&1 ||
        die "ENABLE_PROFILING=1 but nsys (Nsight Systems) is not on PATH${container:+ in the container}: load its module or use an image that has it, or unset ENABLE_PROFILING"
    output=${PROFILE_OUTPUT:-profile}
    ((${SLURM_NTASKS:-1} > 1)) && output+="_rank%q{SLURM_PROCID}"
    profiler=(nsys profile --trace=cuda,nvtx -c cudaProfilerApi --kill none -f true -o "$output")
fi

echo "job $SLURM_JOB_ID: ${SLURM_NTASKS:-1} rank(s) on ${SLURM_JOB_NODELIST:-?}," \
     "$( ((gpus > 0)) && echo "$gpus GPU(s) per node" || echo "CPU only")," \
     "${OMP_NUM_THREADS} thread(s) per rank${container:+, in ${container[*]}}"
echo "data: ERA5_DATA_ROOT=$ERA5_DATA_ROOT COSMO_DATA_ROOT=$COSMO_DATA_ROOT; runs: EXPDIR=$EXPDIR"
if [[ -n $gpu_note ]]; then echo "gpus: $gpu_note"; fi

# A requeued job continues its run; a first submission starts as its arguments say (a fresh run
# is not started over a run directory that holds checkpoints, nor one resumed by accident).
# Without --run_num the run is named after the job (job<id>): a requeued job keeps its id, so
# it continues its own run and never another job's.
resume=()
((${SLURM_RESTART_COUNT:-0} > 0)) && resume=(--resume auto)
run_name=("--run_num" "job$SLURM_JOB_ID")
for arg in "$@"; do
    [[ $arg == --run_num || $arg == --run_num=* ]] && run_name=()
done

# Each task: set RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT, then replace the shell with
# the command; "$@" keeps every argument as given (spaces, quotes, $, *, ;). A rank ignores USR1
# until train.py installs its handler (a default USR1 would kill it while it starts up), and
# this shell, with srun in the background, repeats a warning every 2 s until the ranks end: srun
# forwards it to every task.
stopped=3  # the ranks' exit code after a stop signal: checkpoint written, resumable
srun "${srun_args[@]}" "${container[@]}" \
    bash -c 'trap "" USR1; source ./export_DDP_vars.sh && exec "$@"' ddp-rank \
    "${profiler[@]}" "$PYTHON" "$SCRIPT" "${run_name[@]}" "$@" "${resume[@]}" &
srun_pid=$!
echo "command:$(printf ' %q' "${profiler[@]}" "$PYTHON" "$SCRIPT" "${run_name[@]}" "$@" \
    "${resume[@]}")"
announced=0
poll=0.1  # doubled up to 2 s: a job that ends at once is not held for a whole poll
while kill -0 "$srun_pid" 2>/dev/null; do
    if ((stop_requested)); then
        if ((!announced)); then
            echo "job $SLURM_JOB_ID: USR1 (time limit near): stopping the ranks"
            announced=1
        fi
        kill -USR1 "$srun_pid" 2>/dev/null || true
    fi
    sleep "$poll" &
    wait $! || true  # a USR1 ends this wait at once
    case $poll in 0.1) poll=0.2 ;; 0.2) poll=0.5 ;; 0.5) poll=1 ;; *) poll=2 ;; esac
done
status=0
wait "$srun_pid" || status=$?
if ((status == stopped)); then
    restart=$((${SLURM_RESTART_COUNT:-0} + 1))
    echo "job $SLURM_JOB_ID: stopped with a checkpoint; requeueing (restart $restart)"
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
