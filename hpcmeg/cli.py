"""The ``hpcmeg`` command: argument parsing and dispatch only.

Each subcommand's work is a function in the package that a library user can call too; this
file maps subcommands to them (imported lazily, so ``hpcmeg --help`` and ``submit --dry-run``
stay fast and never import torch). Recipe problems exit with status 2 and one line each; so do
command-line errors (argparse's usage block is left out: `--help` shows it). A file-system fault
(OSError) that a subcommand did not report itself is one line naming the path, exit status 1.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommands that are drop-ins for existing tools keep their own parser (same flags as
# Megatron's scripts), so their arguments are passed through untouched.
PASSTHROUGH = {
    "preprocess": ("hpcmeg.data.preprocess_cli", "main",
                   "tokenize JSONL into Megatron .bin/.idx (drop-in for tools/preprocess_data.py)"),
    "merge-datasets": ("hpcmeg.data.indexed", "merge_main",
                       "merge several .bin/.idx datasets into one (tools/merge_datasets.py)"),
    "tokenizer": ("hpcmeg.data.tokenizer_train", "main", "train a byte-level BPE tokenizer: hpcmeg tokenizer train ..."),
    "corpus": ("hpcmeg.data.corpus", "main", "write the Python standard library as a JSONL code corpus"),
}

# subcommand -> (module, function taking the parsed args and returning an exit code)
HANDLERS = {
    "submit": ("hpcmeg.launch.submit", "cli_submit"),
    "train": ("hpcmeg.train.entry", "cli_train"),
    "prepare-cache": ("hpcmeg.train.entry", "cli_prepare_cache"),
    "convert": ("hpcmeg.convert.hf", "cli_convert"),
    "reshard": ("hpcmeg.convert.reshard", "cli_reshard"),
    "import-hf": ("hpcmeg.convert.import_hf", "cli_import_hf"),
    "status": ("hpcmeg.launch.status", "cli_status"),
    "logs": ("hpcmeg.launch.status", "cli_logs"),
    "cancel": ("hpcmeg.launch.status", "cli_cancel"),
    "plot": ("hpcmeg.train.plot", "cli_plot"),
    "doctor": ("hpcmeg.doctor", "cli_doctor"),
    "validate": ("hpcmeg.cli", "cli_validate"),
    "demo": ("hpcmeg.demo", "cli_demo"),
    "smoke": ("hpcmeg.launch.smoke", "cli_smoke"),
    "smoke-probe": ("hpcmeg.launch.smoke_probe", "cli_probe"),
}

DESCRIPTION = """\
hpcmeg: pretrain GPT models the Megatron-LM way on Slurm clusters.

A recipe YAML goes in; a chain of Slurm jobs comes out:
  preprocess (array over shards) -> train (N nodes x G GPUs, requeued on preemption)
  -> convert (array job, to Hugging Face format).

Typical use:
  hpcmeg submit recipes/codeparrot_small.yaml --dry-run    # see the scripts, submit nothing
  hpcmeg submit recipes/codeparrot_small.yaml              # submit the chain
  hpcmeg status runs/codeparrot-small                      # watch it
  hpcmeg logs runs/codeparrot-small -f --stage train       # tail it
"""


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (argparse prints the usage block too): the house rule for
    bad input is one line naming what is wrong and what to do, exit status 2."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message}; see '{self.prog} --help'\n")


def _count(minimum: int):
    """argparse type: an integer >= minimum (sizes, iterations, line counts)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{v} is below {minimum}")
        return v
    parse.__name__ = f"integer >= {minimum}"
    return parse


def _add_recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", metavar="RECIPE", help="recipe YAML file (see recipes/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one recipe value, e.g. --set train.lr=3e-4 (repeatable)")
    p.add_argument("--profile", default=None, metavar="NAME",
                   help="cluster profile name or YAML path (overrides cluster.profile)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hpcmeg", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_recipe_commands(sub)
    _add_checkpoint_commands(sub)
    _add_run_commands(sub)
    _add_check_commands(sub)
    for name, (_, _, help_) in PASSTHROUGH.items():
        sub.add_parser(name, help=help_, add_help=False)
    return parser


def _add_recipe_commands(sub) -> None:
    """submit, train, prepare-cache, validate: the commands that take a recipe."""
    p = sub.add_parser("submit", help="build and submit the preprocess -> train -> convert job chain",
                       description="Validate RECIPE, write every sbatch script and the resolved recipe into the "
                                   "run directory, and submit the chain through submitit (or run it locally "
                                   "with the 'local' profile).")
    _add_recipe_args(p)
    p.add_argument("--dry-run", action="store_true", help="write and print the scripts and derived values; submit nothing")
    p.add_argument("--stages", default="preprocess,train,convert",
                   help="comma list of stages to run (default: all three)")
    p.add_argument("--wait", action="store_true", help="block until the chain finishes (local profile always waits)")

    p = sub.add_parser("train", help="train from a recipe on this process group (1 process, torchrun or srun)",
                       description="Train RECIPE. Ranks come from the environment (torchrun's RANK/WORLD_SIZE or "
                                   "Slurm's SLURM_PROCID/SLURM_NTASKS); resumes from the latest checkpoint.")
    _add_recipe_args(p)

    p = sub.add_parser("prepare-cache", help="build the GPT dataset index cache ahead of time (on a login node)")
    _add_recipe_args(p)

    p = sub.add_parser("validate", help="run submit's checks on a recipe and print it resolved, with derived values",
                       description="Run every check 'hpcmeg submit' runs (recipe, inputs and their first "
                                   "document, scripts, environment variables) without writing or submitting "
                                   "anything; print the resolved recipe and the derived values.")
    _add_recipe_args(p)
    p.add_argument("--stages", default="preprocess,train,convert",
                   help="the stages submit would run (default: all three); inputs are checked for preprocess")


def _add_checkpoint_commands(sub) -> None:
    """convert, reshard, import-hf: the commands that read or write a checkpoint directory."""
    p = sub.add_parser("convert", help="convert Megatron-layout checkpoints to a Hugging Face GPT-2 directory")
    p.add_argument("ckpt_dir", metavar="CKPT_DIR", help="checkpoint directory (holds latest_checkpointed_iteration.txt)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="output directory (with --all: one sub-directory per iteration)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--iteration", type=_count(0), default=None, help="iteration to convert (default: latest)")
    g.add_argument("--all", action="store_true", help="convert every iteration found")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="weights dtype (default fp32)")
    p.add_argument("--pytorch-bin", action="store_true", help="also write pytorch_model.bin for older tools")
    p.add_argument("--tokenizer-dir", default=None, help="take tokenizer files from here instead of the checkpoint's recipe")

    p = sub.add_parser("reshard", help="split or merge a checkpoint between tensor/pipeline layouts")
    p.add_argument("ckpt_dir", metavar="CKPT_DIR")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--tp", type=_count(1), required=True, help="target tensor-parallel size")
    p.add_argument("--pp", type=_count(1), required=True, help="target pipeline-parallel size")
    p.add_argument("--vpp", type=_count(1), default=1,
                   help="target model chunks per pipeline rank (interleaved schedule: model0..model{V-1}); default 1")
    p.add_argument("--iteration", type=_count(0), default=None, help="iteration to reshard (default: latest)")

    p = sub.add_parser("import-hf", help="write a Megatron-layout 'release' checkpoint from a Hugging Face GPT-2 dir")
    p.add_argument("hf_dir", metavar="HF_DIR")
    p.add_argument("ckpt_dir", metavar="CKPT_DIR")
    p.add_argument("--tp", type=_count(1), default=1)
    p.add_argument("--pp", type=_count(1), default=1)
    p.add_argument("--make-vocab-size-divisible-by", type=_count(1), default=128)


def _add_run_commands(sub) -> None:
    """status, logs, cancel, plot: the commands that look at or stop a run directory."""
    p = sub.add_parser("status", help="show the state of a run's jobs (works without Slurm accounting)")
    p.add_argument("run", metavar="RUN", help="run directory (printed by submit)")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("logs", help="print or follow a run's logs")
    p.add_argument("run", metavar="RUN")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing as the logs grow")
    p.add_argument("--stage", choices=["preprocess", "train", "convert"], default=None)
    p.add_argument("--rank", type=_count(0), default=None, help="only this task/rank's log")
    p.add_argument("-n", "--lines", type=_count(0), default=40, help="lines from the end of each log (default 40)")

    p = sub.add_parser("cancel", help="cancel every job of a run's chain")
    p.add_argument("run", metavar="RUN")

    p = sub.add_parser("plot", help="draw loss and throughput curves of a run to a PNG")
    p.add_argument("run", metavar="RUN", help="run directory (or a metrics.jsonl file)")
    p.add_argument("-o", "--output", default=None, help="PNG path (default: RUN/curves.png)")


def _add_check_commands(sub) -> None:
    """doctor, demo, smoke (and smoke-probe, its per-rank step): the commands that check a machine or a cluster."""
    sub.add_parser("doctor", help="report the software, GPUs, Slurm and container tools, and the fast paths in use")

    p = sub.add_parser("demo", help="run the whole pipeline on the embedded default (stdlib code, tiny GPT)")
    p.add_argument("--profile", default=None, help="local-slurm or local (default: local-slurm when Slurm runs here)")
    p.add_argument("--output-root", default="runs", help="where the demo run directory goes")
    p.add_argument("--force", action="store_true",
                   help="delete an earlier demo run directory and run again (default: a finished run is kept)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one value of recipes/codeparrot_tiny.yaml, e.g. --set train.train_iters=50")

    p = sub.add_parser("smoke", help="check a new cluster: a minutes-long chain through the real scheduler",
                       description="Submit a small preprocess -> train (every rank of one node) -> convert chain with "
                                   "your profile and report each check (interpreter and hpcmeg on the node, container "
                                   "start, GPUs per rank, all-reduce, run directory, first loss, converted model) as "
                                   "one PASS/FAIL line. Run it before the first real submission on a cluster.")
    p.add_argument("--profile", required=True, metavar="NAME", help="your cluster profile (name or YAML path)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a value, e.g. --set cluster.partition=debug (repeatable)")
    p.add_argument("--output-root", default="runs", help="where the smoke run directory goes (shared filesystem)")
    p.add_argument("--timeout", type=float, default=1800, help="give up after this many seconds (default 1800)")
    p = sub.add_parser("smoke-probe")  # run by `hpcmeg smoke`'s train step on every rank; not for users
    p.add_argument("run", metavar="RUN")


def _call(module: str, func: str, *a) -> int:
    fn = getattr(importlib.import_module(module), func)
    rc = fn(*a)
    return int(rc or 0)


def cli_validate(args) -> int:
    """The checks of ``hpcmeg submit`` (hpcmeg.launch.submit.prepare, the same function), nothing
    written or submitted; prints the resolved recipe, the derived values and the plan's notes."""
    from hpcmeg.launch.checks import DataError
    from hpcmeg.launch.submit import parse_stages, prepare
    from hpcmeg.recipe import dump_yaml, read_recipe

    stages = parse_stages(args.stages)
    loaded = read_recipe(args.recipe, args.overrides, args.profile)  # its problems are reported with prepare's
    try:
        prep = prepare(loaded, stages)
    except DataError as e:
        print(f"hpcmeg validate: {e.lines[0]}", file=sys.stderr)
        return 1
    print(dump_yaml(prep.recipe), end="")
    print("# derived")
    for k, v in vars(prep.derived).items():
        print(f"#   {k}: {v}")
    for note in prep.plan.notes if prep.plan else []:
        print(f"# {note}")
    return 0


def no_blas_threads() -> None:
    """For the data tools, which use numpy but no linear algebra: before numpy is first imported,
    ask its OpenBLAS for no worker threads (unless the user chose a number). Otherwise numpy's
    import starts one per further core, which busy-waits ~0.1 s of CPU before it sleeps: on 2
    cores, 0.1 of the ~3.5 CPU seconds of `hpcmeg preprocess` on the stdlib corpus, taken from the
    core the parent is not on while it builds the tokenizer. Too late once numpy is imported."""
    import os

    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def _recipe_error() -> type:
    # called by main's except clause, i.e. only while an exception is being matched: so the
    # passthrough tools (`hpcmeg preprocess` on every shard of an array job), which never raise
    # it, start without importing hpcmeg.recipe (yaml, the schema: ~50 ms of a ~2 s run)
    from hpcmeg.recipe import RecipeError

    return RecipeError


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from hpcmeg.launch.provenance import check_from_env

    why = check_from_env()  # inside a job step: is this the hpcmeg that wrote the run?
    if why:
        print(f"hpcmeg: {why}", file=sys.stderr)
        return 1
    try:
        if argv and argv[0] in PASSTHROUGH:
            module, func, _ = PASSTHROUGH[argv[0]]
            no_blas_threads()
            return _call(module, func, argv[1:])
        args = build_parser().parse_args(argv)
        if args.version:
            from hpcmeg import __version__

            print(f"hpcmeg {__version__}")
            return 0
        if not args.command:
            build_parser().print_help()
            return 2
        module, func = HANDLERS[args.command]
        return _call(module, func, args)
    except _recipe_error() as e:
        for line in e.problems:
            print(f"hpcmeg: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `hpcmeg logs ... | head`: the reader left; not an error worth a line
        _silence_stdout()
        return 141
    except OSError as e:
        # a user's path that cannot be read or written (permissions, a full disk, a file where a
        # directory is needed): one line naming the path and what to do. Subcommands report their
        # own expected failures; this is the net for file-system faults anywhere below them.
        from hpcmeg.errors import os_error_line

        cmd = argv[0] if argv and not argv[0].startswith("-") else ""
        print(f"hpcmeg{' ' + cmd if cmd else ''}: {os_error_line(e)}", file=sys.stderr)
        return 1


def _silence_stdout() -> None:
    import os

    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
