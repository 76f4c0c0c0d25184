import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def pytest_configure(config):
    config.addinivalue_line("markers", "distributed: launches real DeepSpeed ranks (slow); deselect with -m 'not distributed'")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A small real corpus (standard-library source), tokenized with a freshly trained 1024-token BPE."""
    from dspipe.data.prepare import prepare
    from dspipe.data.sources import resolve_inputs

    out = tmp_path_factory.mktemp("data") / "stdlib"
    prepare(inputs=resolve_inputs([]), out=out, train_tokenizer=1024, max_bytes=1_500_000, workers=1)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dspipe(*args, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dspipe", *map(str, args)], cwd=cwd, capture_output=True, text=True)
