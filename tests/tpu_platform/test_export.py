"""export_hf_dir under concurrency: processes exporting the same GGUF at once (pytest-xdist's
workers, the plugin suites side by side) each get back one whole directory."""

from __future__ import annotations

import os
import subprocess
import sys

from safetensors import safe_open

from tpuserve.tpu_platform.loader.gguf_loader import default_model_path

EXPORT = (
    "import sys\n"
    "from tpuserve.tpu_platform.loader.export import export_hf_dir\n"
    "from tpuserve.tpu_platform.loader.gguf_loader import default_model_path\n"
    "print(export_hf_dir(default_model_path(), sys.argv[1]))\n"
)


def test_two_processes_exporting_at_once_publish_one_whole_directory(tmp_path):
    out = str(tmp_path / "SmolLM2")
    os.makedirs(out)  # a partial export left by an older version (no marker): replaced, not trusted
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        f.write(b"truncated")
    procs = [
        subprocess.Popen([sys.executable, "-c", EXPORT, out], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    for p in procs:
        stdout, _ = p.communicate(timeout=300)
        assert p.returncode == 0 and stdout.strip() == out
    assert sorted(os.listdir(tmp_path)) == ["SmolLM2"]  # no temporary directory left behind
    with open(os.path.join(out, ".exported-from")) as f:
        assert f.read() == os.path.abspath(default_model_path())
    with safe_open(os.path.join(out, "model.safetensors"), "np") as f:
        names = list(f.keys())
        assert "model.embed_tokens.weight" in names and len(names) > 30
        assert f.get_tensor("model.norm.weight").shape == (576,)
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        assert os.path.exists(os.path.join(out, name)), name


def test_nothing_is_written_into_the_published_directory(tmp_path, monkeypatch):
    """Readers of ``out`` see the old contents until the new export is whole (the mechanism the
    concurrent test above relies on: it cannot force the interleaving that would tear a file)."""
    import safetensors.numpy

    out = str(tmp_path / "SmolLM2")
    os.makedirs(out)
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        f.write(b"old")
    real_save = safetensors.numpy.save_file
    seen = []

    def save_file(tensors, path, metadata=None):
        seen.append(os.path.dirname(path))
        with open(os.path.join(out, "model.safetensors"), "rb") as f:
            assert f.read() == b"old"  # the published directory is untouched while we write
        return real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(safetensors.numpy, "save_file", save_file)
    from tpuserve.tpu_platform.loader.export import export_hf_dir

    assert export_hf_dir(default_model_path(), out) == out
    assert seen and all(d != out for d in seen)
    with safe_open(os.path.join(out, "model.safetensors"), "np") as f:
        assert "model.norm.weight" in list(f.keys())
