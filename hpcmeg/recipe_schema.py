"""The recipe schema: nested dataclasses, one docstring per field, every default and every numeric
range in one place (``ranged(default, ge=..., gt=..., le=..., lt=...)`` next to the field; checked by
``hpcmeg.recipe.validate``: counts >= 1, sizes > 0, probabilities and betas in [0, 1), ...).

Section and field names follow Megatron-LM's flags where one exists (``--micro-batch-size`` is
``train.micro_batch_size``), so a Megatron user can guess them; the user guide has the table.
Loading, validation and derived values live in ``hpcmeg.recipe``; the allowed values of every choice
key and the retired keys live in ``hpcmeg.recipe_choices``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

# Re-exported so that ``recipe_schema`` stays the one import for "what a recipe may hold".
from hpcmeg.recipe_choices import CHOICES, RETIRED  # noqa: F401
from hpcmeg.recipe_ranges import Range, field_range, ranged  # noqa: F401


@dataclass
class RunConfig:
    name: str = "hpcmeg"
    """Run name; the run directory is ``<output_root>/<name>`` (job ids, logs, resolved recipe)."""
    output_root: str = "runs"
    """Directory on the shared parallel filesystem under which run directories are created."""


@dataclass
class DataConfig:
    inputs: list[str] = field(default_factory=list)
    """JSONL (.jsonl / .jsonl.gz) files or globs to preprocess; each file is one array task (shard)."""
    json_keys: list[str] = field(default_factory=lambda: ["text"])
    """JSON keys holding the text (Megatron ``--json-keys``); one dataset per key."""
    tokenizer_type: str = "GPT2BPETokenizer"
    """GPT2BPETokenizer (vocab.json + merges.txt) or HuggingFaceTokenizer (a local tokenizer dir)."""
    vocab_file: Optional[str] = None
    """GPT-2 style vocab.json; null = OpenAI's GPT-2 file embedded with hpcmeg (works offline)."""
    merge_file: Optional[str] = None
    """GPT-2 style merges.txt; null = the embedded GPT-2 file."""
    tokenizer_model: Optional[str] = None
    """Directory of a Hugging Face tokenizer (for tokenizer_type HuggingFaceTokenizer)."""
    append_eod: bool = True
    """Append the end-of-document token to every document (Megatron ``--append-eod``)."""
    split_sentences: bool = False
    """Split documents into sentences with NLTK Punkt (output level ``sentence``)."""
    workers: int = ranged(2, ge=1)
    """Tokenizer worker processes per preprocessing task."""
    shards: int = ranged(0, ge=0)
    """Preprocessing array size; 0 = one task per input file."""
    output_prefix: Optional[str] = None
    """Prefix of the tokenized dataset; null = ``<run_dir>/data/<run name>``."""
    data_path: list[str] = field(default_factory=list)
    """Existing datasets to train on (Megatron ``--data-path``): [prefix] or [w1, prefix1, w2, prefix2];
    empty = the output of the preprocess stage."""
    split: str = "949,50,1"
    """Train/valid/test split over sequences (Megatron ``--split``)."""
    seq_length: int = ranged(1024, ge=1)
    """Tokens per training sample (Megatron ``--seq-length``)."""
    index_cache_dir: Optional[str] = None
    """Where the GPT dataset index .npy files are cached; null = ``<run_dir>/index-cache``."""
    num_workers: int = ranged(2, ge=0)
    """Data loader worker processes per rank."""


@dataclass
class ModelConfig:
    num_layers: int = ranged(12, ge=1)
    """Transformer layers (``--num-layers``)."""
    hidden_size: int = ranged(768, ge=1)
    """Model width (``--hidden-size``)."""
    num_attention_heads: int = ranged(12, ge=1)
    """Attention heads (``--num-attention-heads``); must divide hidden_size and be divisible by TP."""
    ffn_hidden_size: Optional[int] = ranged(None, ge=1)
    """MLP width; null = 4 x hidden_size."""
    max_position_embeddings: int = ranged(1024, ge=1)
    """Rows of the learned position table; at least data.seq_length."""
    make_vocab_size_divisible_by: int = ranged(128, ge=1)
    """The vocabulary is padded to a multiple of this x tensor-parallel size (50257 -> 50304)."""
    vocab_size: Optional[int] = ranged(None, ge=1, null="read it from the tokenizer files")
    """Unpadded vocabulary size; null = read from the tokenizer files."""
    hidden_dropout: float = ranged(0.1, ge=0, lt=1)
    """Dropout after attention and MLP outputs."""
    attention_dropout: float = ranged(0.1, ge=0, lt=1)
    """Dropout on attention probabilities."""
    init_method_std: float = ranged(0.02, gt=0)
    """Std of the normal weight init (output projections scaled by 1/sqrt(2 x layers))."""
    layernorm_epsilon: float = ranged(1e-5, gt=0)
    """LayerNorm epsilon."""
    fused: str = "auto"
    """Fused kernels: auto (on for CUDA), on, off (the plain PyTorch twins)."""
    attention_backend: str = "auto"
    """Fused path: the attention kernel (GPTConfig.attention_backend): auto (on Hopper GPUs,
    triton where it takes the shape; elsewhere flash-attn if installed, else PyTorch SDPA, cuDNN
    first), triton (hpcmeg's own, dropout inside, q/k/v in the QKV GEMM's layout; sequence length a
    multiple of 128, head dim 16-128; 12 % faster than cuDNN per layer on an H100), cudnn, flash,
    flash_attn, efficient or math."""
    recompute_gelu_layers: int = ranged(0, ge=0)
    """Fused path: the first this many layers (of each pipeline stage) keep their MLP's
    pre-activation but not its GELU output, which the backward recomputes (the Triton GELU in those
    layers): 2 x ffn bytes per token less per layer (124M at micro batch 16: 100 MB a layer) for one
    GELU pass each in the backward; for a micro batch that would not fit otherwise. At most num_layers."""
    recompute_granularity: Optional[str] = None
    """Activation recompute (``--recompute-granularity``): null, full (whole layers as the two keys below
    pick: their input kept, their forward run again in the backward) or selective (each attention core)."""
    recompute_method: Optional[str] = None
    """full: uniform (each stage's layers in groups of recompute_num_layers) or block (its first ones)."""
    recompute_num_layers: Optional[int] = ranged(None, ge=1)
    """full: the group size (uniform: divides a stage's layers) or the layers per stage (block)."""
    cross_entropy: str = "grad_in_forward"
    """Fused path: the LM head's loss (GPTConfig.fused_ce): grad_in_forward (bf16 logits, which the
    forward's Triton kernel turns into their gradient in place: no fp32 [tokens, vocab] tensor, no
    backward pass over the logits) or backward_in_forward (a memory trade-off: grad_in_forward whose
    backward GEMMs run in the forward, chunk by chunk, so the [tokens, vocab] gradient is never kept:
    ~103 MB less per sequence of 1024 at GPT-2's vocabulary, same FLOPs; what lets 355M run micro
    batch 16 within nanoGPT's memory on an H100)."""


@dataclass
class TrainConfig:
    micro_batch_size: int = ranged(12, ge=1)
    """Samples per rank per forward/backward (``--micro-batch-size``)."""
    global_batch_size: int = ranged(192, ge=1)
    """Samples per optimizer step across all ranks = micro x data-parallel x accumulation."""
    train_iters: Optional[int] = ranged(None, ge=1)
    """Optimizer steps to train (``--train-iters``); set this or train_samples."""
    train_samples: Optional[int] = ranged(None, ge=1)
    """Samples to train (``--train-samples``); set this or train_iters."""
    lr: float = ranged(5e-4, gt=0)
    """Peak learning rate."""
    min_lr: float = ranged(0.0, ge=0)
    """Learning rate at the end of the decay."""
    lr_decay_style: str = "cosine"
    """cosine, linear or constant."""
    lr_decay_iters: Optional[int] = ranged(None, ge=1, null="decay over the whole run")
    """Steps over which the LR decays; null = the whole run. Counted in samples internally."""
    lr_warmup_iters: int = ranged(0, ge=0)
    """Linear warmup steps (``--lr-warmup-iters``)."""
    lr_warmup_fraction: Optional[float] = ranged(None, ge=0, le=1, null="use lr_warmup_iters")
    """Warmup as a fraction of the decay span; overrides lr_warmup_iters when set."""
    adam_beta1: float = ranged(0.9, ge=0, lt=1)
    """AdamW beta1."""
    adam_beta2: float = ranged(0.999, ge=0, lt=1)
    """AdamW beta2."""
    adam_eps: float = ranged(1e-8, gt=0)
    """AdamW epsilon."""
    weight_decay: float = ranged(0.1, ge=0)
    """Decoupled weight decay; never applied to biases and norm weights."""
    clip_grad: float = ranged(1.0, ge=0, zero="no clipping")
    """Clip the global gradient norm to this (0 = off)."""
    precision: str = "bf16"
    """bf16, fp16 (dynamic loss scaling) or fp32."""
    initial_loss_scale: float = ranged(4294967296.0, gt=0)
    """fp16 only: the first loss scale (Megatron's 2^32)."""
    seed: int = ranged(1234, ge=0, le=2**32 - 1)
    """Seed for init, dropout and the data order."""
    log_interval: int = ranged(10, ge=1)
    """Log a metrics line every this many steps."""
    eval_interval: int = ranged(200, ge=0, zero="never evaluate")
    """Evaluate on the validation split every this many steps (0 = never)."""
    eval_iters: int = ranged(10, ge=0)
    """Validation batches per evaluation."""
    compile: str = "auto"
    """torch.compile: auto (on for CUDA), on, off."""
    device: str = "auto"
    """auto (CUDA when available), cuda or cpu."""
    exit_duration_minutes: Optional[float] = ranged(None, gt=0, null="no limit")
    """Save and exit after this many minutes of training (Megatron ``--exit-duration-in-mins``)."""


@dataclass
class ParallelConfig:
    tensor: int = ranged(1, ge=1)
    """Tensor-parallel size (``--tensor-model-parallel-size``); keep it within a node."""
    pipeline: int = ranged(1, ge=1)
    """Pipeline-parallel size (``--pipeline-model-parallel-size``)."""
    virtual_pipeline: Optional[int] = ranged(None, ge=1, null="off")
    """Virtual stages per pipeline rank (interleaved schedule); null = off."""
    sequence_parallel: bool = False
    """Split LayerNorm/dropout activations along the sequence across TP ranks (needs TP > 1)."""
    distributed_optimizer: bool = False
    """Shard optimizer state across data-parallel ranks (ZeRO-1)."""


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None
    """Checkpoint directory (Megatron ``--save``/``--load``); null = ``<run_dir>/checkpoints``."""
    save_interval: int = ranged(1000, ge=0, zero="save only at the end and on preemption")
    """Save every this many steps (0 = only at the end and on preemption)."""
    keep_last: Optional[int] = ranged(None, ge=1, null="keep all")
    """Keep only the newest N checkpoints; null = keep all."""
    async_save: bool = False
    """Write checkpoints in a background thread after a synchronous copy to CPU memory."""
    load: Optional[str] = None
    """Start from this checkpoint directory (e.g. an imported ``release``) when the run has none."""


_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


@dataclass
class ClusterConfig:
    profile: str = "local"
    """Cluster profile (a YAML file with cluster: and container: sections); see ``hpcmeg/profiles``."""
    executor: str = "local"
    """slurm (submit through submitit) or local (ranks as local processes, no Slurm)."""
    partition: Optional[str] = None
    """Slurm partition (``--partition``) of the training job."""
    cpu_partition: Optional[str] = None
    """Partition for the CPU-only stages (preprocess, merge, convert); null = cluster.partition. Name
    your site's CPU partition here to keep GPU nodes free for training."""
    account: Optional[str] = None
    """Slurm account (``--account``)."""
    qos: Optional[str] = None
    """Slurm QOS (``--qos``)."""
    constraint: Optional[str] = None
    """Slurm node features (``--constraint``); with cluster.cpu_partition set, only the training job's."""
    exclusive: bool = False
    """Whole nodes for the training job (``--exclusive``)."""
    nodes: int = ranged(1, ge=1)
    """Nodes for the training job."""
    gpus_per_node: int = ranged(8, ge=0, zero="CPU-only")
    """GPUs per node; one training task per GPU. 0 = CPU-only (then tasks_per_node applies)."""
    cpu_tasks_per_node: int = ranged(1, ge=1)
    """Training tasks per node when gpus_per_node is 0 (CPU ranks, gloo)."""
    cpus_per_task: int = ranged(8, ge=1)
    """CPU cores per training task (data loader workers + tokenization)."""
    mem: Optional[str] = None
    """Memory per node (``--mem``), e.g. 0 (all) or 200G; null = the site default."""
    time: str = "04:00:00"
    """Training job time limit (``--time``)."""
    preprocess_time: str = "02:00:00"
    """Time limit of each preprocessing array task."""
    convert_time: str = "01:00:00"
    """Time limit of each conversion array task."""
    preprocess_cpus: Optional[int] = ranged(None, ge=1, null="data.workers")
    """CPU cores (``--cpus-per-task``) of each task of the CPU stages (preprocess, merge, convert);
    null = data.workers (one core per tokenizer worker). Never fewer than data.workers: submit refuses
    a preprocess job whose tokenizer workers would share fewer cores."""
    signal_lead_s: int = ranged(120, ge=1, le=65535)
    """Seconds before the time limit that Slurm sends the save-and-requeue signal."""
    max_requeues: int = ranged(3, ge=0)
    """Restarts allowed after preemption/time-out (or a hang) before the job gives up."""
    hang_after_steps: float = ranged(10.0, gt=0)
    """Slurm jobs: the training step hangs when no rank has advanced for this many step times (the
    slowest rank's median), at least cluster.hang_min_s. Then the ranks' stacks go into their logs,
    the step is cancelled and the job requeued without the node of the rank(s) behind."""
    hang_min_s: float = ranged(300.0, gt=0)
    """The shortest wait, in seconds, that counts as a hang once training steps run."""
    hang_startup_s: float = ranged(1800.0, gt=0)
    """The wait that counts as a hang before any rank finished its first step (start-up, data index,
    checkpoint load, compilation), in seconds."""
    hang_checkpoint_s: float = ranged(1800.0, gt=0)
    """The wait that counts as a hang while a rank saves a checkpoint or evaluates, in seconds."""
    # The ranks' collective timeout, after their third step, is twice these allowances (training steps;
    # checkpoint and evaluation), so the supervisor acts first; under torchrun it is the only limit.
    heartbeat_s: float = ranged(5.0, gt=0)
    """How often each rank's heartbeat file (``<run_dir>/health/``) is rewritten, in seconds."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run in the batch script before the job starts (module loads...). Shell by design:
    they are NOT quoted."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables for every task (e.g. NCCL_SOCKET_IFNAME); values are quoted literally and
    written into the batch scripts and the recipe copies (readable as your umask allows): put API keys
    in ``env_passthrough`` or ``secret_env`` instead."""
    env_passthrough: list[str] = field(default_factory=list)
    """Names of variables passed from the environment you submit from to every task, value written
    nowhere (Slurm: ``sbatch --export=ALL,NAME``), e.g. [WANDB_API_KEY, HF_TOKEN]; each must be set
    when you submit."""
    secret_env: list[str] = field(default_factory=list)
    """Names of secret variables: passed like ``env_passthrough``, with the value from ``cluster.env``
    (e.g. in a private profile) or else from the submitting environment; the value appears in no file
    hpcmeg writes (recipe copies, scripts, checkpoints, logs, markers, jobs.json, submitit pickles)."""
    master_port: Optional[int] = ranged(None, ge=1, le=65535, null="derived from the job id")
    """Rendezvous port; null = derived from the job id."""
    python: Optional[str] = None
    """The Python interpreter that runs hpcmeg on the compute nodes: the host-side supervisor of every
    job (in the batch shell, outside any container) and, with container.runtime none, the ranks too.
    null = the interpreter running ``hpcmeg submit``. It must exist at the same path on the compute
    nodes, so its environment (a venv with hpcmeg installed) must live on the shared filesystem, not
    under /tmp, /dev/shm, $TMPDIR or a node-local disk, and be built from a Python that runs on the
    nodes. cluster.setup lines (module loads) run before it in the batch script, so a Python that a
    module provides works when the same module is loaded there. An absolute path is checked at
    submit (exists, not node-local, imports the same hpcmeg); a bare name (``python3``) is looked up
    on the node's PATH after cluster.setup."""
    python_check: bool = True
    """Check cluster.python at submit (see there). false = skip the location checks, for an
    interpreter installed at the same path on every node's local disk (e.g. in the node image)."""
    version_check: bool = True
    """Every stage checks at start that the hpcmeg it runs (the supervisor on the node, and the ranks
    inside the container) is the one that wrote the run (version and source hash, recorded in
    ``<run_dir>/hpcmeg_version.json`` at submit) and stops with one line if not. false = run anyway."""

    def hang_policy(self) -> dict:
        """hpcmeg.launch.health.HangPolicy's fields, as the supervisor's task carries them."""
        return {"after_steps": self.hang_after_steps, "min_s": self.hang_min_s, "startup_s": self.hang_startup_s,
                "checkpoint_s": self.hang_checkpoint_s, "beat_s": self.heartbeat_s}

    def tasks_per_node(self) -> int:
        return self.gpus_per_node if self.gpus_per_node > 0 else self.cpu_tasks_per_node

    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node()

    def time_limit_minutes(self, value: Optional[str] = None) -> Optional[float]:
        """Slurm time string -> minutes (None if malformed)."""
        m = _TIME.match(str(value if value is not None else self.time).strip())
        if not m:
            return None
        d, a, b, c = m.groups()
        days = int(d or 0)
        parts = [int(x) for x in (a, b, c) if x is not None]
        if d is not None:  # D-HH[:MM[:SS]]
            h, mi, s = (parts + [0, 0])[:3]
        elif len(parts) == 1:  # MM
            h, mi, s = 0, parts[0], 0
        elif len(parts) == 2:  # MM:SS
            h, mi, s = 0, parts[0], parts[1]
        else:
            h, mi, s = parts
        return days * 1440 + h * 60 + mi + s / 60


@dataclass
class ContainerConfig:
    runtime: str = "none"
    """apptainer, pyxis or none."""
    image: Optional[str] = None
    """Apptainer .sif path, or a pyxis image (``nvcr.io#nvidia/pytorch:24.10-py3`` or a .sqsh path)."""
    binds: list[str] = field(default_factory=list)
    """Filesystem binds, ``/lustre`` or ``/host/path:/container/path`` (the run dir is bound automatically)."""
    python: str = "python3"
    """Python inside the container."""


@dataclass
class ConvertConfig:
    iterations: str = "last"
    """Which checkpoints to convert: last, all, or a comma list of iterations (one array task each)."""
    format: str = "hf"
    """Output format: hf (Hugging Face GPT-2 directory)."""
    dtype: str = "fp32"
    """Weights dtype of the converted model: fp32, bf16 or fp16."""
    output_dir: Optional[str] = None
    """Where converted models go; null = ``<run_dir>/hf``."""
    enabled: bool = True
    """Run the conversion stage after training."""


@dataclass
class Recipe:
    run: RunConfig = field(default_factory=RunConfig)
    """Run name and output location."""
    data: DataConfig = field(default_factory=DataConfig)
    """Inputs, tokenizer, preprocessing, split and sequence length."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """GPT architecture."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Batch sizes, schedule, optimizer, precision, intervals."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Tensor / pipeline / data parallel layout."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Where and how often to save."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Slurm resources (usually from a profile)."""
    container: ContainerConfig = field(default_factory=ContainerConfig)
    """Container runtime and image (usually from a profile)."""
    convert: ConvertConfig = field(default_factory=ConvertConfig)
    """Conversion to Hugging Face after training."""
    source: Optional[str] = field(default=None, metadata={"internal": True})
    """(set by the loader, not a recipe key) the recipe file this came from."""
