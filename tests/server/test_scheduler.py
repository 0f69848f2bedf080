"""Scheduler policy on synthetic sequences (no model)."""

from tpuserve.kv_cache.block_pool import BlockPool
from tpuserve.server.sampling_params import SamplingParams
from tpuserve.server.scheduler import Scheduler
from tpuserve.server.sequence import Sequence, SeqStatus


def _seq(i, prompt_len):
    return Sequence(seq_id=str(i), request_id=str(i), index=0, prompt_token_ids=list(range(prompt_len)),
                    params=SamplingParams(), seed=0, arrival=float(i))


def _run(sched, out):
    """Pretend the model ran: advance computed counts, append a token where a sample is kept."""
    for w in out.work:
        done = w.completes
        w.seq.num_computed += w.num_tokens
        if done:
            w.seq.output_token_ids.append(1)


def test_chunked_prefill_respects_token_budget_and_decodes_first():
    sched = Scheduler(BlockPool(64, 4), max_num_seqs=4, max_num_batched_tokens=8)
    a, b = _seq(0, 3), _seq(1, 20)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(w.seq, w.num_tokens) for w in out.work] == [(a, 3), (b, 5)]
    _run(sched, out)
    out = sched.schedule()  # a decodes (1 token) before b's next chunk (7)
    assert [(w.seq, w.num_tokens) for w in out.work] == [(a, 1), (b, 7)]
    assert sum(w.num_tokens for w in out.work) <= 8


def test_max_num_seqs_limits_running():
    sched = Scheduler(BlockPool(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [_seq(i, 2) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [w.seq for w in out.work] == seqs[:2] and len(sched.waiting) == 1


def test_preemption_frees_newest_and_requeues_it_first():
    pool = BlockPool(5, 4)  # 4 usable pages
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=100)
    a, b = _seq(0, 8), _seq(1, 8)  # 2 pages each: pool full
    sched.add(a)
    sched.add(b)
    _run(sched, sched.schedule())
    assert pool.num_free == 0
    out = sched.schedule()  # a needs a third page for its decode: b is preempted
    assert out.preempted == [b] and b.status is SeqStatus.WAITING and b.num_computed == 0
    assert [w.seq for w in out.work] == [a]
    assert sched.waiting[0] is b and b.page_ids == []


def test_finish_releases_pages():
    pool = BlockPool(10, 4)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=100)
    a = _seq(0, 9)
    sched.add(a)
    sched.schedule()
    assert pool.num_free == 6
    sched.finish(a)
    assert pool.num_free == 9 and a.is_finished and not sched.has_work()
