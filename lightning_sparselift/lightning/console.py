"""The warnings of a run that other libraries' code prints and that nothing on our side can
avoid, filtered narrowly (by message and by the logger or module that emits it). Everything
else a run used to print is fixed where it came from: the planner's topology, storage
reservation and the DDP wrapper (``torchrec_parts.py``), the CLI's arguments (``cli.py``), the
runtime's collectives (``runtime/collectives.py``).

``install()`` runs in every rank process (``SparseLiftStrategy.setup_environment``) and can be
called again: it adds each filter once."""

from __future__ import annotations

import logging
import warnings

# torch.fx: TorchRec's KeyedJaggedTensor / JaggedTensor / Awaitable classes have torch's
# ProxyableClassMeta as metaclass, and its __call__ asks torch.fx._symbolic_trace.is_fx_tracing()
# on every construction; torch 2.13 made that function log, once per process, a notice meant for
# code that asks whether it is being traced. Nothing of ours asks; the call is torch's own
# metaclass on TorchRec's classes, so every process that builds a KJT would print it.
_FX_LOGGER = "torch.fx._symbolic_trace"
_FX_NOTICE = "is_fx_tracing will return true for both fx.symbolic_trace and torch.export"

# Lightning 2.6's lightning/pytorch/utilities/_pytree.py (its CombinedLoader flattens every
# dataloader collection with it) constructs torch.utils._pytree.LeafSpec(), which torch 2.13
# deprecates with this FutureWarning; the call is in Lightning's code, once per process.
_LEAFSPEC_MESSAGE = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
_LEAFSPEC_MODULE = r"lightning\.pytorch\.utilities\._pytree$"

# torch.distributed: TorchRec 1.8's own row-wise path (torchrec/distributed/comm_ops.py: the
# reduce-scatter of pooled partial sums and the all-gather of their gradients; also its batched
# embedding kernels) calls reduce_scatter_tensor / all_gather_into_tensor, which torch 2.13
# deprecates (they forward to reduce_scatter_single / all_gather_single). Our runtime calls the
# _single functions; TorchRec's path runs during warmup, with executor="torchrec" and for short
# batches. The warning is raised from torch's c10d_logger wrapper, so that is the module to
# match (it carries no caller: another library's calls of these two are silenced too); the
# message names exactly these two functions.
_C10D_MESSAGE = r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated"
_C10D_MODULE = r"torch\.distributed\.c10d_logger$"


class _DropFxTracingNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_FX_NOTICE)


def install() -> None:
    logger = logging.getLogger(_FX_LOGGER)
    if not any(isinstance(f, _DropFxTracingNotice) for f in logger.filters):
        logger.addFilter(_DropFxTracingNotice())
    # filterwarnings drops an identical earlier entry before inserting, so calling again adds none
    warnings.filterwarnings("ignore", message=_LEAFSPEC_MESSAGE, category=FutureWarning, module=_LEAFSPEC_MODULE)
    warnings.filterwarnings("ignore", message=_C10D_MESSAGE, category=FutureWarning, module=_C10D_MODULE)
