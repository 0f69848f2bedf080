"""`tpuserve generate`: JSONL in, JSONL out; a bad line fails alone."""

import json

import pytest

from tpuserve.cli import main

pytestmark = pytest.mark.timeout(300)


def test_generate_jsonl_roundtrip(random_checkpoints, tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text(
        "\n".join(
            [
                json.dumps({"prompt": "Hello"}),
                json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
                json.dumps({"prompt": "x", "sampling_params": {"top_p": 7}}),
                json.dumps({"prompt_token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}),
            ]
        )
        + "\n"
    )
    out = tmp_path / "out.jsonl"
    rc = main(
        [
            "generate",
            random_checkpoints["qwen2"],
            "--input",
            str(inp),
            "--output",
            str(out),
            "--max-tokens",
            "4",
            "--max-model-len",
            "128",
            "--quiet",
        ]
    )
    assert rc == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in recs] == [0, 1, 2, 3]
    assert len(recs[0]["outputs"][0]["token_ids"]) <= 4 and "error" not in recs[0]
    assert "outputs" in recs[1]
    assert "top_p" in recs[2]["error"]
    assert len(recs[3]["outputs"][0]["token_ids"]) <= 2


def test_generate_rejects_bad_input(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json}\n")
    with pytest.raises(SystemExit, match="not valid JSON"):
        main(["generate", "--input", str(bad)])
    assert main(["generate", str(tmp_path / "missing-model"), "--prompt", "hi"]) == 2
    assert "does not exist" in capsys.readouterr().err
