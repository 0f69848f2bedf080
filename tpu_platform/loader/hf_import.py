"""transformers, imported whole by whichever thread asks first.

The engine starts the import on a thread of its own at once (it takes seconds on a TPU host and
can run beside the backend's start). A second thread must then wait for the whole import: Python
hands it the half-initialized module, whose lazy attributes (``AutoTokenizer``...) fail there
(seen on a TPU host, 2026-12-06).
"""

from __future__ import annotations

import threading
from types import ModuleType

_LOCK = threading.Lock()


def transformers_module() -> ModuleType:
    with _LOCK:
        import transformers
    return transformers
