"""Host memory registered with the CUDA driver, so a GPU copies rows straight into it.

A client's shared memory segment is ordinary memory: a copy from the GPU into it goes through a
staging buffer, several times slower than a copy into page-locked memory. Registering the
gateway's mapping of it (`cudaHostRegister`, once per segment) makes it as fast as page-locked
memory (docs/performance.md). Only where an engine already runs CUDA in this process: registering
must not create a CUDA context (hundreds of MB of GPU memory) for engines that use none.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

_PORTABLE = 1  # cudaHostRegisterPortable: for every device's context, not only the current one


class CudaPinner:
    def register(self, address: int, size: int) -> bool:
        try:
            import torch
        except ImportError:
            return False
        if not torch.cuda.is_initialized():
            return False
        error = torch.cuda.cudart().cudaHostRegister(address, size, _PORTABLE)
        if int(error) != 0:
            log.warning("cannot register %d bytes of shared memory with CUDA: %s", size, error)
            return False
        return True

    def unregister(self, address: int) -> None:
        import torch

        error = torch.cuda.cudart().cudaHostUnregister(address)
        if int(error) != 0:
            log.warning("cannot unregister shared memory from CUDA: %s", error)
