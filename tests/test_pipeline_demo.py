import subprocess
import sys
from pathlib import Path

PIPELINE = Path(__file__).resolve().parents[1] / "examples" / "pipeline.py"


def test_pipeline_demo_matches_its_reference():
    result = subprocess.run([sys.executable, str(PIPELINE), "--processes", "3", "--microbatches", "4"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "pipeline: outputs match reference" in result.stdout
    assert "rows/s with 4 microbatches" in result.stdout
