"""Fixtures and markers only; shared helpers are in tests/helpers.py. Every test under tests/distributed/ is marked
`distributed` (real DeepSpeed ranks, slow), so `-m "not distributed"` selects exactly the unit tests. Those also marked
`solo` need the machine to themselves (4 or more ranks, or a figure measured in time): scripts/test.sh runs them one at
a time after the other distributed tests, which it runs two at once."""

import os
from pathlib import Path

import pytest

# plan and gen-config use the catalog's figures in tests (the same on every machine), not a measurement of this one
# (dspipe.tools.machine); the tests of the measurement ask for it, with their own cache directory
os.environ.setdefault("DSPIPE_MEASURE", "never")

DISTRIBUTED_DIR = Path(__file__).resolve().parent / "distributed"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "distributed: launches real DeepSpeed ranks (slow); deselect with -m 'not distributed'"
    )
    config.addinivalue_line(
        "markers",
        "solo: a distributed test that needs the machine to itself (4+ ranks, or a time "
        "it measures); scripts/test.sh runs these one at a time",
    )


def pytest_collection_modifyitems(config, items):
    for item in items:
        if DISTRIBUTED_DIR in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.distributed)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A small real corpus (standard-library source), tokenized with a freshly trained 1024-token BPE."""
    from dspipe.data.prepare import prepare
    from dspipe.data.sources import resolve_inputs

    out = tmp_path_factory.mktemp("data") / "stdlib"
    prepare(inputs=resolve_inputs([]), out=out, train_tokenizer=1024, max_bytes=1_500_000, workers=1)
    return out
