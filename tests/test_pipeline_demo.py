import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.requirements import require

PIPELINE = Path(__file__).resolve().parents[1] / "examples" / "pipeline.py"


def test_pipeline_demo_matches_its_reference():
    result = subprocess.run([sys.executable, str(PIPELINE), "--processes", "3", "--microbatches", "4"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "pipeline: outputs match reference" in result.stdout
    assert "rows/s with 4 microbatches" in result.stdout


def torch_or_requirement():
    """torch, or the suite's rule for a missing requirement (a failure under CI, a skip elsewhere)."""
    try:
        import torch
    except ImportError:
        require("torch", "pip install 'ifrt-topology[torch]' (PyTorch on CPU)")
    return torch


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_pipeline_demo_with_torch_stages_matches_its_reference(dtype):
    torch_or_requirement()
    result = subprocess.run([sys.executable, str(PIPELINE), "--runtime", "torch", "--dtype", dtype, "--processes", "3",
                             "--microbatches", "4"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pipeline: outputs match reference" in result.stdout
    assert f"torch runtime ({dtype})" in result.stdout
    assert "rows/s with 4 microbatches" in result.stdout


def test_torch_tensors_cross_as_numpy_without_copies_and_bfloat16_keeps_its_bits():
    torch = torch_or_requirement()
    spec = importlib.util.spec_from_file_location("pipeline_torch", PIPELINE.with_name("pipeline_torch.py"))
    codec = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(codec)
    for dtype in (torch.float64, torch.bfloat16):
        tensor = torch.linspace(-3, 3, 12, dtype=dtype).reshape(3, 4)
        array = codec.to_numpy(tensor)
        assert array.ctypes.data == tensor.data_ptr() and array.nbytes == tensor.nbytes  # the same memory
        back = codec.from_numpy(array, dtype)
        assert back.dtype == dtype and back.data_ptr() == tensor.data_ptr() and torch.equal(back, tensor)
    assert codec.to_numpy(torch.tensor([1.0], dtype=torch.bfloat16)).view("<u2")[0] == 0x3F80  # 1.0's bit pattern
    with pytest.raises(TypeError, match=r"float32 for an activation of torch\.bfloat16: expected torch\.int16"):
        codec.from_numpy(np.zeros(2, dtype=np.float32), torch.bfloat16)
