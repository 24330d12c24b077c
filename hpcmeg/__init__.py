"""hpcmeg: Megatron-LM-style GPT pretraining on Slurm clusters.

A recipe YAML goes in; a chain of Slurm jobs comes out (preprocess -> train -> convert).
See README.md for the tour and docs/ for the user guide.
"""

__version__ = "0.1.0"
