import subprocess
import sys

from tests.helpers import ROOT


def test_layout_block_is_generated_from_the_package():
    """docs/contributing.md's layout block (scripts/readme_layout.py --check)."""
    r = subprocess.run(
        [sys.executable, "scripts/readme_layout.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
