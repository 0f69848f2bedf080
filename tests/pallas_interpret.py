"""Shared set-up for Pallas TPU kernels run in TPU interpret mode on CPU (tests import it by name:
``tests/`` is on sys.path through its conftest)."""

from __future__ import annotations

import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret
from jax.experimental.pallas import tpu as pltpu

RACES = pltpu.InterpretParams(detect_races=True)


@pytest.fixture(autouse=True)
def fresh_interpreter():
    """A failed interpret run leaves global simulator state behind; start each test clean.
    Autouse in every module that imports it."""
    pltpu.reset_tpu_interpret_mode_state()
    yield
    pltpu.reset_tpu_interpret_mode_state()


def races_found() -> bool:
    """The interpreter's race verdict for the last kernel (jax keeps it in a module global)."""
    assert tpu_interpret.races is not None, "no kernel ran in TPU interpret mode"
    return bool(tpu_interpret.races.races_found)
