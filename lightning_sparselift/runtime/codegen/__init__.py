"""Generated lookup kernels: a rank's tables baked into C++ (CPU) or Triton (CUDA) source,
built once and cached by the hash of that source, run on the storage TorchRec's lookup modules own."""

from lightning_sparselift.runtime.codegen.spec import KernelSpec, Unsupported, spec_of
from lightning_sparselift.runtime.codegen.lookup import GeneratedLookup

__all__ = ["GeneratedLookup", "KernelSpec", "Unsupported", "spec_of"]
