"""A fork/spawn launcher that returns only the dense weights to the main process.

Lightning's multiprocessing launcher pickles rank 0's full ``state_dict`` back to the parent;
sharded tables (ShardedTensor) cannot travel that way (and rank 0 holds only its shards anyway).
The parent's tables therefore stay on the meta device after ``fit``: load a checkpoint into a
new run to use the trained tables.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Optional

import torch
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn

from lightning_sparselift.sharding import dense_state_dict


class DenseOnlyMultiProcessingLauncher(_MultiProcessingLauncher):
    def _wrapping_function(self, process_idx: int, *args: Any, **kwargs: Any) -> None:
        if self._start_method == "fork":
            # GNU OpenMP's thread pool does not survive fork: a child whose parent already ran a
            # parallel region deadlocks in its first multi-threaded op. Forked ranks therefore
            # run single-threaded ops (use the popen or spawn launcher for more threads per rank).
            torch.set_num_threads(1)
            os.environ["OMP_NUM_THREADS"] = "1"  # else Lightning raises the thread count again
        super()._wrapping_function(process_idx, *args, **kwargs)

    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Optional[_WorkerOutput]:
        checkpoint_callback = trainer.checkpoint_callback
        best_model_path = getattr(checkpoint_callback, "best_model_path", None) if checkpoint_callback else None
        state_dict = dense_state_dict(trainer.lightning_module, self._strategy.sparse_module_paths)
        if self._strategy.local_rank != 0:
            return None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            torch.save(state_dict, weights_path)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, self.get_extra_results(trainer))

    def _recover_results_in_main_process(self, worker_output: _WorkerOutput, trainer: Any) -> None:
        if worker_output.weights_path is not None:
            state = torch.load(worker_output.weights_path, weights_only=True)
            os.remove(worker_output.weights_path)
            os.rmdir(os.path.dirname(worker_output.weights_path))
            # Copied tensor by tensor, not through load_state_dict: that would run the sparse
            # modules' load hooks on their meta tables (a managed-collision module validates its
            # state there and fails).
            module = trainer.lightning_module
            targets = {**dict(module.named_parameters()), **dict(module.named_buffers())}
            with torch.no_grad():
                for name, value in state.items():
                    if name in targets:
                        targets[name].copy_(value)
        super()._recover_results_in_main_process(worker_output._replace(weights_path=None), trainer)
