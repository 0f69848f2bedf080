"""Activation, entry points and SGLang's argument resolution with the tpuserve platform.

SGLang resolves its platform once per process, on ``import sglang``; each SGLang-side check runs in
a fresh subprocess with the environment under test (the ``run_py`` fixture).
"""

from __future__ import annotations

import importlib.util
import json
import textwrap

import pytest

from tpuserve.tpu_platform.sglang_plugin import activation, register_platform

needs_sglang = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None,
    reason='sglang is not installed here; run with "$(bash scripts/sglang_env.sh)"',
)

pytestmark = pytest.mark.timeout(300)


def test_import_has_no_side_effects(run_py):
    """Importing the plugin (as SGLang's entry-point loader does) pulls in neither SGLang, JAX nor torch."""
    out = run_py(
        "import sys, tpu_platform.sglang_plugin\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'sglang', 'jax', 'torch'}))"
    )
    assert out.strip() == "[]"


def test_activation_needs_tpu_or_opt_in(monkeypatch):
    monkeypatch.delenv("SGLANG_PLATFORM", raising=False)
    monkeypatch.setattr(activation, "tpu_visible", lambda: False)
    assert register_platform() is None  # never silently
    monkeypatch.setenv("SGLANG_PLATFORM", "tpuserve")
    assert register_platform() == activation.PLATFORM_QUALNAME
    monkeypatch.setenv("SGLANG_PLATFORM", "someone-else")
    assert register_platform() is None
    monkeypatch.delenv("SGLANG_PLATFORM")
    monkeypatch.setattr(activation, "tpu_visible", lambda: True)
    assert register_platform() == activation.PLATFORM_QUALNAME  # a TPU host activates it


def test_no_tpu_on_this_machine():
    """The probe does not start JAX; on a CPU-only machine it must say no."""
    assert not activation.tpu_visible()


# Resolve SGLang's server arguments the way its launcher does (plugins first, then parse, resolve).
_RESOLVE = textwrap.dedent("""
    import json, sys
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.server_args import prepare_server_args
    import sglang.srt.platforms as platforms
    from tpuserve.tpu_platform.sglang_plugin import activation

    def resolve(*extra):
        sa = prepare_server_args(["--model-path", sys.argv[1], *extra])
        try:
            sa.resolve_once()
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"}
        v = resolving_view(sa)
        keys = ("device", "page_size", "chunked_prefill_size", "max_running_requests",
                "disable_overlap_schedule", "attention_backend")
        if "--speculative-algorithm" in extra:
            keys += ("speculative_num_draft_tokens", "speculative_ngram_max_bfs_breadth")
        return {k: getattr(v, k) for k in keys}

    out = {"platform": type(platforms.current_platform).__name__,
           "oot": platforms.current_platform.is_out_of_tree(),
           "default": resolve(), "device_tpu": resolve("--device", "tpu"),
           "hicache": resolve("--enable-hierarchical-cache"), "hicache_alias": resolve("--enable-hicache"),
           "tp2": resolve("--tp-size", "2"),
           "ngram": resolve("--speculative-algorithm", "NGRAM"),
           "ngram_wide": resolve("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "30"),
           "eagle": resolve("--speculative-algorithm", "EAGLE"),
           "loader_typo": resolve("--model-loader-extra-config", '{"layer_lop": "scan"}'),
           "loader_bad": resolve("--model-loader-extra-config", '{"layer_loop": "loop"}')}
    activation.tpu_visible = lambda: True  # as on a TPU host (no torch device is involved)
    out["device_tpu_on_tpu_host"] = resolve("--device", "tpu")
    print("RESULT" + json.dumps(out))
""")


def _resolve_in_subprocess(run_py, hf_dir, env):
    out = run_py(_RESOLVE.replace("sys.argv[1]", repr(hf_dir)), env=env)
    line = [ln for ln in out.splitlines() if ln.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT") :])


@needs_sglang
def test_sglang_without_opt_in_keeps_its_platform(run_py, hf_dir):
    res = _resolve_in_subprocess(run_py, hf_dir, env={})
    assert res["platform"] != "TpuServeSRTPlatform" and not res["oot"]
    # --device tpu without our platform: a clear message instead of a torch crash.
    assert "served by the 'tpuserve' SGLang platform" in res["device_tpu"]["error"]


@needs_sglang
def test_sglang_resolves_our_defaults(run_py, hf_dir):
    res = _resolve_in_subprocess(run_py, hf_dir, env={"SGLANG_PLATFORM": "tpuserve"})
    assert res["platform"] == "TpuServeSRTPlatform" and res["oot"]
    assert res["default"] == {
        "device": "cpu",
        "page_size": 16,
        "chunked_prefill_size": 256,
        "max_running_requests": 32,
        "disable_overlap_schedule": True,
        "attention_backend": "tpuserve",
    }
    # No TPU here: --device tpu is refused rather than quietly run on the CPU.
    assert "no TPU is visible" in res["device_tpu"]["error"]
    # Where a TPU is visible, --device tpu is served; SGLang's own tensors stay on torch's cpu.
    assert res["device_tpu_on_tpu_host"]["device"] == "cpu"
    # HiCache cannot reach pages held in a JAX array: refused at start-up, naming what to use.
    for key in ("hicache", "hicache_alias"):
        err = res[key]["error"]
        assert "--enable-hierarchical-cache is not supported" in err, err
        assert "--kv-offloading-size" in err, err
    # Our loader options: a typo or a bad value is refused at start-up, naming it.
    assert "unknown key(s) layer_lop" in res["loader_typo"]["error"], res["loader_typo"]
    assert "layer_loop='loop'" in res["loader_bad"]["error"], res["loader_bad"]
    # NGRAM: SGLang's corpus drafts a chain (breadth 1) for our runner to verify; SGLang's default
    # of 12 tokens a verify stands, more than our runner's 16 drafts is refused, as is any other
    # algorithm, naming the flag.
    ngram = res["ngram"]
    assert ngram["speculative_num_draft_tokens"] == 12 and ngram["speculative_ngram_max_bfs_breadth"] == 1, (
        ngram
    )
    assert ngram["page_size"] == 16 and ngram["attention_backend"] == "tpuserve", ngram
    assert "--speculative-num-draft-tokens 30" in res["ngram_wide"]["error"], res["ngram_wide"]
    err = res["eagle"]["error"]
    assert "--speculative-algorithm EAGLE is not supported" in err and "NGRAM" in err, err
    # SGLang's tensor parallelism is process groups of torch ranks: refused, naming ours.
    err = res["tp2"]["error"]
    assert "--tp-size > 1 is not supported" in err and "--tensor-parallel-size N" in err, err


_VERIFY_SEQS = textwrap.dedent("""
    import json
    from types import SimpleNamespace as NS
    import torch
    from tpuserve.tpu_platform.sglang_plugin.worker import verify_seqs

    PAGE = 4
    def row(pages, n):  # the req_to_token row SGLang's paged allocator writes
        return [pages[p // PAGE] * PAGE + p % PAGE for p in range(n)]

    table = torch.zeros((3, 32), dtype=torch.int32)
    table[1, :12] = torch.tensor(row([7, 3, 9], 12))
    table[2, :12] = torch.tensor(row([2, 5, 6], 12))
    sp = NS(top_k=1, temperature=1.0, top_p=1.0, min_p=0.0, sampling_seed=1, repetition_penalty=1.0,
            presence_penalty=0.0, frequency_penalty=0.0, min_new_tokens=0, stop_token_ids=None,
            ignore_eos=True)
    reqs = [NS(rid="a", sampling_params=sp, origin_input_ids=[5, 6], output_ids=[8, 9]),
            NS(rid="b", sampling_params=sp, origin_input_ids=[4, 4, 4, 4, 4, 1], output_ids=[])]
    batch = NS(reqs=reqs, seq_lens=torch.tensor([3, 5]), req_pool_indices=torch.tensor([1, 2]))
    out = {}
    seqs = verify_seqs(batch, [[9, 1, 2, 3], [1, 4]], table, PAGE, 100)
    out["seqs"] = [(s.token_ids, s.draft_token_ids, s.num_computed, s.page_ids) for s in seqs]
    seqs = verify_seqs(batch, [[9, 1, 2, 3], [1, 4]], table, PAGE, 100, max_model_len=5)
    out["capped"] = [(s.token_ids, s.draft_token_ids) for s in seqs]
    try:
        verify_seqs(batch, [[8, 1], [1, 4]], table, PAGE, 100)
    except RuntimeError as e:
        out["bad_root"] = str(e)
    print("RESULT" + json.dumps(out))
""")


@needs_sglang
def test_verify_seqs_put_each_chain_after_its_committed_tokens(run_py):
    """spec_ngram.py's chains as our work items: the root at the committed length, drafts after it,
    pages from SGLang's own slots; drafts past max_model_len dropped; a root that is not the
    request's last token refused (the corpus and the request disagree)."""
    out = run_py(_VERIFY_SEQS)
    res = json.loads([ln for ln in out.splitlines() if ln.startswith("RESULT")][-1][len("RESULT") :])
    assert res["seqs"] == [[[9], [1, 2, 3], 3, [7, 3]], [[1], [4], 5, [2, 5]]]
    assert res["capped"] == [[[9], [1]], [[1], []]]
    assert "root [8] is not the request's last token 9" in res["bad_root"]
