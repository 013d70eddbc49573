"""Checks on the sparse input of every sharded EmbeddingBagCollection, before any collective.

fbgemm's CPU lookup kernels do not bounds-check ids by default (an id past a table's end reads
or updates memory that belongs to another table), and a KJT with missing or extra keys fails
deep inside the input all-to-all. These checks turn both into clear errors naming the feature.

With more than one rank, a problem on one rank must stop every rank: a rank that raises alone
leaves the others waiting in the module's all-to-all until the collective timeout, and inputs
that differ across ranks (batch sizes with row-wise tables, a 0-sample batch on one rank, id
dtypes) make gloo abort or the all-to-alls disagree. So every rank shares what it found in one
small all-gather before the module's first collective, and all raise the same error.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

# dtypes a KJT's ids and lengths may have, by the code the ranks exchange
_INDEX_DTYPES = (torch.int32, torch.int64)


class SparseInputError(ValueError):
    pass


def kjt_problem(kjt: Any, rows_per_feature: dict[str, int], variable_batch_ok: bool = True,
                single_id: frozenset[str] = frozenset(), weighted: bool = False) -> Optional[str]:
    """What is wrong with ``kjt`` as the input of a module whose features have these row counts
    (None: nothing). ``variable_batch_ok``: whether the module takes a variable batch per feature;
    ``single_id``: features whose bags must hold exactly one id; ``weighted``: the module weights
    every id (``EmbeddingBagCollection(is_weighted=True)``)."""
    keys = list(kjt.keys())
    if not variable_batch_ok and kjt.variable_stride_per_key():
        return ("the KeyedJaggedTensor has a variable batch per feature (VBE), which TorchRec's data-parallel lookup "
                "does not take on CPU (it reads the wrong rows or out of bounds); shard those tables another way "
                "(sharding_types) or pass one batch size for every feature")
    # Keys beyond the module's features are allowed: TorchRec's modules select their own keys, so
    # one batch KJT can feed several collections; each checks the ids of its own features.
    missing = sorted(set(rows_per_feature) - set(keys))
    duplicated = sorted({k for k in keys if keys.count(k) > 1})
    if missing or duplicated:
        return (f"the batch's KeyedJaggedTensor keys do not match the model's features (missing {missing}, "
                f"duplicated {duplicated}; the KJT's keys: {keys})")
    values, lengths, weights = kjt.values(), kjt.lengths(), kjt.weights_or_none()
    for name, tensor in (("ids", values), ("lengths", lengths)):
        if tensor.dtype not in _INDEX_DTYPES:
            return f"the KeyedJaggedTensor's {name} are {tensor.dtype}, expected int32 or int64"
    # with a variable batch per feature (VBE) each key has its own number of samples
    strides = kjt.stride_per_key() if kjt.variable_stride_per_key() else None
    if (lengths.numel() != sum(strides) if strides is not None else lengths.numel() % max(len(keys), 1)) or \
            (lengths.numel() and bool((lengths < 0).any())):
        return (f"the KeyedJaggedTensor has {lengths.numel()} lengths for {len(keys)} keys (not a whole number of "
                f"samples per key) or negative lengths")
    total = int(lengths.sum()) if lengths.numel() else 0
    if total != values.numel():
        return f"the KeyedJaggedTensor's lengths add up to {total} but it holds {values.numel()} ids"
    if weights is not None and weights.numel() != values.numel():
        return f"the KeyedJaggedTensor holds {values.numel()} ids but {weights.numel()} weights"
    if weighted and weights is None:  # (TorchRec's lookup would silently pool the ids unweighted)
        return ("the module is weighted (EmbeddingBagCollection(is_weighted=True)) but the KeyedJaggedTensor has no "
                "weights: pass one weight per id (KeyedJaggedTensor(..., weights=...)), or build the collection with "
                "is_weighted=False")
    for key in sorted(single_id & set(keys)):
        bags = kjt[key].lengths()
        if bool((bags != 1).any()):
            return (f"feature {key!r} has bags of {int(bags.min())}-{int(bags.max())} ids, but its table is a "
                    f"data-parallel table of an EmbeddingCollection on CPU, where TorchRec's lookup (fbgemm's dense "
                    f"kernel) pools each bag into one row instead of returning a row per id; give it one id per "
                    f"sample, shard the table another way (sharding_types), or train on CUDA")
    if values.numel() == 0:
        return None
    bounds = torch.tensor([rows_per_feature.get(k, 0) for k in keys], dtype=values.dtype, device=values.device)
    per_key = (torch.stack([part.sum() for part in lengths.split(strides)]) if strides is not None
               else lengths.view(len(keys), -1).sum(dim=1))
    limit = torch.repeat_interleave(bounds, per_key)
    bad = (values < 0) | (values >= limit)
    foreign = [k not in rows_per_feature for k in keys]
    if any(foreign):  # (another collection's ids: its own check covers them)
        bad &= ~torch.repeat_interleave(torch.tensor(foreign, device=values.device), per_key)
    if bool(bad.any()):
        owner = torch.repeat_interleave(torch.arange(len(keys), device=values.device), per_key)
        first = int(bad.nonzero()[0])
        key = keys[int(owner[first])]
        return (f"id {int(values[first])} of feature {key!r} is outside its table's range "
                f"[0, {rows_per_feature[key]}) ({int(bad.sum())} bad id(s) in this batch)")
    return None


def check_kjt(module_path: str, kjt: Any, rows_per_feature: dict[str, int], variable_batch_ok: bool = True,
              single_id: frozenset[str] = frozenset(), weighted: bool = False) -> None:
    problem = kjt_problem(kjt, rows_per_feature, variable_batch_ok, single_id, weighted)
    if problem is not None:
        raise SparseInputError(f"{module_path}: {problem}")


def _summary(kjt: Any, problem: Optional[str]) -> torch.Tensor:
    """What the ranks compare: [problem found, batch size, ids dtype, lengths dtype] (-1: unknown)."""
    def code(tensor: torch.Tensor) -> int:
        return _INDEX_DTYPES.index(tensor.dtype) if tensor.dtype in _INDEX_DTYPES else -1

    stride = kjt.stride() if problem is None else -1  # (a malformed KJT's batch size is not defined)
    return torch.tensor([problem is not None, stride, code(kjt.values()), code(kjt.lengths())], dtype=torch.int64,
                        device=kjt.values().device)


class RankComparison:
    """The ranks' comparison of one module call's input: every rank's summary in one all-gather
    (started by the constructor, possibly as ``async_op``), judged by :meth:`finish`. Every rank
    must create one for the same module call (it is a collective)."""

    def __init__(self, kjt: Any, problem: Optional[str], group: Any, async_op: bool = False) -> None:
        self.problem, self.group = problem, group
        local = _summary(kjt, problem)
        self.gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        self.work = dist.all_gather(self.gathered, local, group=group, async_op=async_op)

    def finish(self, module_path: str, row_wise: tuple[str, ...] = ()) -> None:
        """Raise the same :class:`SparseInputError` on every rank when any rank's input has a
        problem or the ranks' inputs cannot go through one collective together."""
        if self.work is not None:
            self.work.wait()
        rows = [g.tolist() for g in self.gathered]
        if any(row[0] for row in rows):
            problems: list[Any] = [None] * len(rows)
            dist.all_gather_object(problems, self.problem, group=self.group)
            raise SparseInputError(f"{module_path}: " + "; ".join(f"rank {r}: {p}" for r, p in enumerate(problems)
                                                                  if p))
        sizes = [row[1] for row in rows]
        if len(set(sizes)) > 1:
            per_rank = ", ".join(f"rank {r}: {s}" for r, s in enumerate(sizes))
            if 0 in sizes:
                raise SparseInputError(f"{module_path}: some ranks have a batch with 0 samples and others not "
                                       f"({per_rank}); drop empty batches on every rank alike (e.g. drop_last=True)")
            if row_wise:
                pinned = ", ".join(f"{t!r}: 'table_wise'" for t in row_wise)
                raise SparseInputError(f"{module_path}: ranks passed different batch sizes ({per_rank}), which its "
                                       f"row-wise sharded tables {list(row_wise)} cannot take in training (TorchRec's "
                                       f"row-wise backward needs one batch size); use the same batch size on every "
                                       f"rank (drop_last=True), or pin another sharding type for those tables: "
                                       f"SparseLiftStrategy(sharding_types={{{pinned}}})")
        for column, name in ((2, "ids"), (3, "lengths")):
            dtypes = {row[column] for row in rows}
            if len(dtypes) > 1:
                per_rank = ", ".join(f"rank {r}: {_INDEX_DTYPES[row[column]]}" for r, row in enumerate(rows))
                raise SparseInputError(f"{module_path}: the KeyedJaggedTensor's {name} have different dtypes on "
                                       f"different ranks ({per_rank}); use one dtype everywhere")


class InputCheck:
    """The forward pre-hook that checks one sharded module's input.

    A KJT whose tensors were checked last (the same objects, not changed in place since: same
    version counters; in the same mode) is not checked again: the lifted executor runs a module's
    pre-hooks itself when it starts the module's work early (latency hiding) and the module's own
    call runs them again on the same features. And when the executor knows a step ahead which
    features a call will get (the next-batch schedule announces them), :meth:`start` checks them
    then and leaves the ranks' all-gather in flight until that call, which only waits for it.
    Every rank passes the same objects around, so all ranks decide alike."""

    def __init__(self, path: str, rows_per_feature: dict[str, int], group: Any, row_wise: tuple[str, ...] = (),
                 data_parallel: bool = False, single_id_on_cpu: frozenset[str] = frozenset(),
                 weighted: bool = False) -> None:
        self.path, self.rows, self.group, self.row_wise = path, rows_per_feature, group, row_wise
        self.data_parallel, self.single_id_on_cpu, self.weighted = data_parallel, single_id_on_cpu, weighted
        self._checked: Optional[tuple] = None  # the identity (see _identity) of the KJT checked last
        self._started: Optional[tuple[tuple, RankComparison]] = None  # a check started ahead of its call

    def start(self, kjt: Any, backward: bool) -> None:
        """Begin checking ``kjt``, which a later call (in mode ``backward``) will pass."""
        if self._compares_ranks():
            comparison = RankComparison(kjt, self._problem(kjt), self.group, async_op=True)
            self._started = (self._identity(kjt, backward), comparison)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        kjt = args[0] if args else kwargs.get("features")
        # (only the row-wise backward needs one batch size: evaluation takes uneven batches)
        backward = module.training and torch.is_grad_enabled()
        identity = self._identity(kjt, backward)
        if self._checked is not None and _same_identity(self._checked, identity):
            return
        started, self._started = self._started, None
        row_wise = self.row_wise if backward else ()
        if started is not None and _same_identity(started[0], identity):
            started[1].finish(self.path, row_wise)
        elif self._compares_ranks():
            RankComparison(kjt, self._problem(kjt), self.group).finish(self.path, row_wise)
        else:
            check_kjt(self.path, kjt, self.rows, *self._rules(kjt), self.weighted)
        self._checked = identity

    def _rules(self, kjt: Any) -> tuple[bool, frozenset[str]]:
        """Whether a variable batch per feature is taken, and the features whose bags must hold one id."""
        cpu = kjt.values().device.type == "cpu"
        return not (self.data_parallel and cpu), self.single_id_on_cpu if cpu else frozenset()

    def _problem(self, kjt: Any) -> Optional[str]:
        return kjt_problem(kjt, self.rows, *self._rules(kjt), self.weighted)

    def _compares_ranks(self) -> bool:
        return dist.is_initialized() and dist.get_world_size(self.group) > 1

    @staticmethod
    def _identity(kjt: Any, backward: bool) -> tuple:
        tensors = (kjt.values(), kjt.lengths())
        return tuple(weakref.ref(t) for t in tensors), tuple(t._version for t in tensors), list(kjt.keys()), backward


def _same_identity(a: tuple, b: tuple) -> bool:
    return all(x() is not None and x() is y() for x, y in zip(a[0], b[0])) and a[1:] == b[1:]


def install_input_checks(model: nn.Module, module_paths: list[str], tables: dict[str, Any], group: Any,
                         row_wise_tables: dict[str, tuple[str, ...]], data_parallel_paths: set[str],
                         single_id_on_cpu: dict[str, frozenset[str]], weighted_paths: set[str]) -> None:
    """Register an :class:`InputCheck` on each (sharded) embedding module at ``module_paths``.
    ``row_wise_tables`` are the row-wise sharded tables per module (one batch size on all ranks
    in training), ``data_parallel_paths`` those with data-parallel tables (no variable batch per
    feature on CPU), ``single_id_on_cpu`` per module the features whose bags must hold one id on
    CPU, ``weighted_paths`` the modules that weight every id (their KJTs must carry weights)."""
    for path in module_paths:
        rows = {f: t.id_bound for t in tables.values() if t.module_path == path for f in t.feature_names}
        check = InputCheck(path, rows, group, row_wise_tables.get(path, ()), path in data_parallel_paths,
                           single_id_on_cpu.get(path, frozenset()), path in weighted_paths)
        model.get_submodule(path).register_forward_pre_hook(check, with_kwargs=True)
