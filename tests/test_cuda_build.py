"""Where a CUDA toolkit exists (this machine has nvcc), the CUDA sources are
compiled (STREAMLOAD_CUDA=AUTO) and the module imports without a GPU."""

from __future__ import annotations

import shutil

import pytest

from streamload.io import _native


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no CUDA toolkit on this machine")
def test_cuda_extension_built_and_importable_without_gpu() -> None:
    cuda = _native.cuda_module()
    assert cuda is not None, "nvcc is here but the CUDA extension was not built"
    assert cuda.device_count() >= 0  # 0 on a machine without a GPU: no crash, no driver needed
    assert callable(cuda.widen_to_f32)
