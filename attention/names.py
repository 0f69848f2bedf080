"""Names of the attention implementations (no jax import: the engine config validates against them)."""

from enum import StrEnum


class AttentionImpl(StrEnum):
    """``--attention-impl``. String-valued, so a flag's text and a member compare equal."""

    AUTO = "auto"  # resolved per backend when the engine config meets its platform
    REFERENCE = "reference"
    BLOCKED = "blocked"
    PALLAS_TPU = "pallas_tpu"
    PALLAS_TPU_INTERPRET = "pallas_tpu_interpret"
    PALLAS_GPU = "pallas_gpu"


ATTENTION_IMPLS = tuple(m.value for m in AttentionImpl)
