#!/bin/bash

# Parameters
#SBATCH --account=myproject
#SBATCH --cpus-per-task=12
#SBATCH --dependency=afterok:1001
#SBATCH --exclusive
#SBATCH --gpus-per-node=8
#SBATCH --job-name=hpcmeg-train-codeparrot-small
#SBATCH --kill-on-invalid-dep=yes
#SBATCH --mem=0
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --open-mode=append
#SBATCH --output=/lustre/scratch/hpcmeg/runs/codeparrot-small/logs/train/train.%j.batch.log
#SBATCH --partition=batch
#SBATCH --requeue
#SBATCH --signal=TERM@300
#SBATCH --time=24:00:00

# setup
export PYTHONUNBUFFERED=1
export NCCL_DEBUG=WARN
export CUDA_DEVICE_MAX_CONNECTIONS=1
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export PYTHONNOUSERSITE=1
export NLTK_DATA=/opt/hpcmeg/nltk_data
export HPCMEG_CACHE=/opt/hpcmeg/cache
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1

# command
export SUBMITIT_EXECUTOR=slurm
/opt/hpcmeg/venv/bin/python -u -m submitit.core._submit /lustre/scratch/hpcmeg/runs/codeparrot-small/submitit/train
