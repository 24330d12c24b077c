#!/bin/bash

# Parameters
#SBATCH --account=myproject
#SBATCH --cpus-per-task=8
#SBATCH --dependency=afterok:1001
#SBATCH --exclusive
#SBATCH --gpus-per-node=8
#SBATCH --job-name=hpcmeg-train-codeparrot-small
#SBATCH --kill-on-invalid-dep=yes
#SBATCH --mem=0
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --open-mode=append
#SBATCH --output=/lustre/scratch/hpcmeg/runs/codeparrot-small/logs/train/train.%j.batch.log
#SBATCH --partition=gpu
#SBATCH --requeue
#SBATCH --signal=TERM@300
#SBATCH --time=24:00:00

# setup
export PYTHONUNBUFFERED=1
export NCCL_DEBUG=WARN
export CUDA_DEVICE_MAX_CONNECTIONS=1
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
# cluster.setup (shell by design: copied verbatim from the profile/recipe)
module load apptainer

# command
export SUBMITIT_EXECUTOR=slurm
/opt/hpcmeg/venv/bin/python -u -m submitit.core._submit /lustre/scratch/hpcmeg/runs/codeparrot-small/submitit/train
