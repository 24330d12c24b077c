"""ParallelDims: the sizes of a run's parallel layout, checked and derived in one place (no torch).

Bottom layer: recipe validation (hpcmeg.recipe), the parallel context and the trainer all read the
layout from here. It also owns Megatron's micro-batch count rule of the interleaved pipeline
schedule (``validate_schedule``), which both ``batch_problems`` and hpcmeg.parallel.pipeline apply.

Contract
- ``ParallelDims(world, tp=1, pp=1, vpp=1, sequence_parallel=False, distributed_optimizer=False)``
  is plain data. ``problems()`` lists what is wrong with the sizes themselves, as
  ``(recipe key, message)`` pairs so ``recipe.validate`` can prefix the file and line; it never
  raises. Everything below assumes ``problems()`` is empty.
- ``dp = world // (tp * pp)``; ``grad_accum(global_batch, micro_batch)`` is the number of micro
  batches per optimizer step on each rank (ValueError when it does not divide);
  ``batch_problems`` / ``model_problems`` are the checks that tie the layout to the batch and the
  model (heads % tp, ffn % tp, layers % (pp * vpp), seq % tp under sequence parallelism);
  ``placement_warnings`` names layouts that run but put a TP group across nodes.
- Rank order is Megatron's default 'tp-dp-pp', fastest-varying first:
      global_rank = tp_rank + tp * (dp_rank + dp * pp_rank)
  so TP groups are runs of consecutive ranks (keep TP inside a node), DP groups are strided by
  tp, PP groups by tp * dp. Example world 16, tp 2, pp 4 (dp 2): TP [0,1],[2,3],..;
  DP [0,2],[1,3],[4,6],..; PP [0,4,8,12],[1,5,9,13],... ``coords(rank)`` and ``rank_of(...)``
  convert; ``groups()`` lists the members of every group of each kind, in the order every rank
  must create them: 'tp', 'dp', 'pp', and 'embedding' (first and last stage of each pipeline:
  the ranks holding the tied word embeddings, Megatron's embedding group; only when pp > 1).
- ``NOT_IMPLEMENTED`` names the layouts the train job cannot run yet; ``problems()`` refuses them,
  so ``validate`` (and ``submit``, before preprocessing) says so rather than the train job.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

# Layouts the train job cannot run yet (removed as each lands): recipe key -> why. Empty: every
# layout of tensor x pipeline (x virtual pipeline) x data parallelism runs.
NOT_IMPLEMENTED: Mapping[str, str] = MappingProxyType({})  # read-only: nothing is refused today


class Coords(NamedTuple):
    tp: int
    dp: int
    pp: int


@dataclass(frozen=True)
class ParallelDims:
    world: int
    """Processes in the job (nodes x tasks per node)."""
    tp: int = 1
    """Tensor-parallel size (Megatron --tensor-model-parallel-size)."""
    pp: int = 1
    """Pipeline-parallel size (--pipeline-model-parallel-size)."""
    vpp: int = 1
    """Model chunks per pipeline rank (--num-layers-per-virtual-pipeline-stage's result); 1 = no interleaving."""
    sequence_parallel: bool = False
    """Megatron's --sequence-parallel (inside the TP group only)."""
    distributed_optimizer: bool = False
    """Megatron's --use-distributed-optimizer: optimizer state sharded over the data-parallel group."""

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp

    # ------------------------------------------------------------------------------ checks

    def problems(self, check_implemented: bool = True, ranks: str = "ranks") -> list[tuple[str, str]]:
        """`ranks`: what the processes are, for the message ("ranks (cluster.nodes=2 x ...)"); a rank count
        not divisible by tensor x pipeline is keyed on cluster.nodes (the caller knows which of the keys
        was set where)."""
        p: list[tuple[str, str]] = []
        for key, val in (("cluster.nodes", self.world), ("parallel.tensor", self.tp),
                         ("parallel.pipeline", self.pp), ("parallel.virtual_pipeline", self.vpp)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                p.append((key, f"must be an integer >= 1, got {val!r}"))
        if p:
            return p  # the divisibility checks below would divide by zero
        if self.world % (self.tp * self.pp):
            p.append(("cluster.nodes", f"{self.world} {ranks} are not divisible by parallel.tensor x parallel.pipeline = "
                                       f"{self.tp} x {self.pp}; change the node/task count or the layout"))
        if self.sequence_parallel and self.tp == 1:
            p.append(("parallel.sequence_parallel", "needs parallel.tensor > 1 (it splits activations inside the "
                                                    "tensor-parallel group); set it to false"))
        if self.vpp > 1 and self.pp == 1:
            p.append(("parallel.virtual_pipeline", "needs parallel.pipeline > 1; remove it or set parallel.pipeline"))
        if check_implemented:
            p += [(key, why) for key, why in NOT_IMPLEMENTED.items()]
        return p

    def batch_problems(self, global_batch: int, micro_batch: int, ranks: str = "ranks") -> list[tuple[str, str]]:
        """`ranks`: what the processes are, for the message ("GPUs", "CPU ranks")."""
        if self.world % (self.tp * self.pp) or global_batch < 1 or micro_batch < 1:
            return []  # reported by problems() / the field ranges
        per_step = micro_batch * self.dp
        if global_batch % per_step:
            good = max(1, round(global_batch / per_step)) * per_step
            return [("train.global_batch_size",
                     f"{global_batch} is not divisible by train.micro_batch_size={micro_batch} x data-parallel size "
                     f"{self.dp} (= {self.world} {ranks} / (TP {self.tp} x PP {self.pp})); use a multiple of "
                     f"{per_step}, e.g. {good}")]
        if self.pp > 1 and self.vpp > 1:  # the interleaved schedule's micro-batch rule (Megatron's)
            return [("train.global_batch_size", line)
                    for line in validate_schedule(self.pp, self.vpp, global_batch // per_step)]
        return []

    def placement_warnings(self, ranks_per_node: int, nodes: int) -> list[str]:
        """Layouts that run but slowly: a tensor-parallel group split across nodes all-reduces every
        layer's activations over the network (Megatron's advice: TP within a node). With the rank
        order above a TP group stays on one node exactly when ranks_per_node % tp == 0."""
        if nodes > 1 and self.tp > 1 and ranks_per_node % self.tp:
            return [f"parallel.tensor={self.tp} does not divide the {ranks_per_node} ranks per node, so tensor-"
                    f"parallel groups span nodes and every layer's all-reduce crosses the network; keep "
                    f"parallel.tensor a divisor of cluster.gpus_per_node (use parallel.pipeline or data "
                    f"parallelism across nodes)"]
        return []

    def model_problems(self, *, num_layers: int, num_attention_heads: int, ffn_hidden_size: int,
                       seq_length: int) -> list[tuple[str, str]]:
        p: list[tuple[str, str]] = []
        if min(self.tp, self.pp, self.vpp) < 1:
            return p
        if num_attention_heads % self.tp:
            p.append(("model.num_attention_heads", f"{num_attention_heads} heads are not divisible by "
                                                   f"parallel.tensor={self.tp}"))
        if ffn_hidden_size % self.tp:
            p.append(("model.ffn_hidden_size", f"{ffn_hidden_size} is not divisible by parallel.tensor={self.tp}"))
        stages = self.pp * self.vpp
        if num_layers % stages:
            what = f"parallel.pipeline={self.pp}" + (f" x parallel.virtual_pipeline={self.vpp}" if self.vpp > 1 else "")
            p.append(("model.num_layers", f"{num_layers} layers are not divisible by {what}"))
        if self.sequence_parallel and seq_length % self.tp:
            p.append(("data.seq_length", f"{seq_length} is not divisible by parallel.tensor={self.tp} "
                                         f"(sequence parallelism splits the sequence across TP ranks)"))
        return p

    def grad_accum(self, global_batch: int, micro_batch: int) -> int:
        """Micro batches per optimizer step on each rank: global / (micro x dp)."""
        per_step = micro_batch * self.dp
        if per_step < 1 or global_batch % per_step:
            raise ValueError(f"global batch {global_batch} is not divisible by micro batch {micro_batch} x "
                             f"data-parallel size {self.dp}")
        return global_batch // per_step

    # ------------------------------------------------------------------------------ rank grid

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside world size {self.world}")
        return Coords(rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp))

    def rank_of(self, tp: int, dp: int, pp: int) -> int:
        return tp + self.tp * (dp + self.dp * pp)

    def groups(self) -> dict[str, list[list[int]]]:
        """Members of every group, by kind (each list sorted; kinds in creation order)."""
        r = self.rank_of
        out = {
            "tp": [[r(t, d, p) for t in range(self.tp)] for p in range(self.pp) for d in range(self.dp)],
            "dp": [[r(t, d, p) for d in range(self.dp)] for p in range(self.pp) for t in range(self.tp)],
            "pp": [[r(t, d, p) for p in range(self.pp)] for d in range(self.dp) for t in range(self.tp)],
        }
        out["embedding"] = [[g[0], g[-1]] for g in out["pp"]] if self.pp > 1 else []
        return out

    def members(self, rank: int) -> dict[str, list[int]]:
        """This rank's group members, by kind ('embedding': [] when the rank holds no embedding copy)."""
        return {kind: next((g for g in gs if rank in g), []) for kind, gs in self.groups().items()}


# ------------------------------------------------------------------------------ interleaved schedule


def _valid_counts(pp: int, group: int, lo: int, hi: int) -> list[int]:
    return [m for m in range(max(lo, 1), hi + 1) if m >= group and not 0 < m % group < pp]


def validate_schedule(pp: int, vpp: int, M: int, group: int | None = None) -> list[str]:
    """Problem lines (empty = runnable). M = micro batches per step on one pipeline
    (global batch / (micro batch x data-parallel size)); `group` = Megatron's
    microbatch_group_size_per_vp_stage, default pp (its default)."""
    p = []
    for name, v in (("pipeline", pp), ("virtual pipeline", vpp), ("micro batches per step", M)):
        if v < 1:
            p.append(f"{name} must be at least 1, got {v}")
    if p or vpp == 1:
        return p
    if pp < 2:
        return [f"the interleaved schedule (virtual pipeline {vpp}) needs pipeline > 1, got {pp}"]
    n = group or pp
    if n < pp:
        return [f"the interleaved schedule needs a micro-batch group of at least pipeline {pp}, got {n}"]
    if M < n or 0 < M % n < pp:
        ok = _valid_counts(pp, n, M - 2 * n, M + 2 * n)
        below, above = [m for m in ok if m < M], [m for m in ok if m > M]
        near = " or ".join(str(m) for m in (below[-1:] + above[:1]))
        rule = (f"a multiple of pipeline {pp}" if n == pp
                else f"at least {n} with remainder mod {n} of 0 or at least {pp}")
        p.append(f"the interleaved schedule (pipeline {pp} x virtual pipeline {vpp}) cannot run {M} micro "
                 f"batches per step: Megatron's rule needs {rule}; use {near} micro batches per step "
                 f"(= global batch / (micro batch x data-parallel size))")
    return p
