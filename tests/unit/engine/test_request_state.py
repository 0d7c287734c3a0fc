"""`RequestState`: the one record of an admitted request (token ids, KV progress, faults)."""

from __future__ import annotations

import threading

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

from omlx.engine.request_state import RequestState
from omlx.engine.sampling import guard_processor, guard_sampler
from omlx.request import Request, SamplingParams


def _state(num_prompt: int = 164) -> RequestState:
    req = Request(model="m", prompt_token_ids=list(range(num_prompt)), sampling=SamplingParams())
    return RequestState.admitted(req, lambda ev: None)


def test_token_ids_are_the_prompt_then_the_output_in_one_list_extended_in_place():
    st = _state(5)
    ids = st.token_ids
    assert ids == [0, 1, 2, 3, 4] and ids is not st.request.prompt_token_ids
    st.add_output_token(9)
    st.add_output_token(8)
    assert st.token_ids is ids and ids == [0, 1, 2, 3, 4, 9, 8]
    assert st.num_output_tokens == 2 and st.output_token_ids == [9, 8]
    assert st.num_computed_tokens == 7  # each emitted token's KV is computed by the step feeding it
    assert st.request.prompt_token_ids == [0, 1, 2, 3, 4]


def test_prefill_progress_counts_computed_tokens_and_prompt_tokens_once_and_again_after_a_retry():
    st = _state(164)
    st.num_cached_tokens = 64
    st.start(uid=3, num_computed_tokens=64, num_prompt_to_prefill=100)
    assert st.uid == 3 and st.num_computed_tokens == 64
    st.count_prefilled(50)
    st.count_prefilled(50)  # a repeated report counts nothing twice
    assert st.num_computed_tokens == 114 and st.request.num_prefilled_tokens == 50
    st.count_prefilled(100)
    assert st.num_computed_tokens == 164 and st.request.num_prefilled_tokens == 100
    for t in range(6):
        st.add_output_token(1000 + t)
    # A batch retry re-inserts prompt + output into a fresh runner: every prompt token counts
    # again as prefilled, the output tokens do not; the computed count restarts from 0.
    st.start(uid=0, num_computed_tokens=0, num_prompt_to_prefill=164)
    st.count_prefilled(170)
    assert st.num_computed_tokens == 170 and st.request.num_prefilled_tokens == 264


def test_a_guarded_sampler_or_processor_records_its_first_error_on_its_own_state():
    a, b = _state(3), _state(3)
    faulted: list[RequestState] = []
    assert guard_sampler(a, greedy_sampler, faulted) is greedy_sampler  # shared, batched

    def bad_sampler(lp):
        raise ValueError("sampler")

    def bad_processor(tokens, logits):
        raise KeyError("processor")

    lp = mx.array([[0.0, 2.0, 1.0]])
    assert guard_sampler(a, bad_sampler, faulted)(lp).tolist() == [1]  # argmax stands in
    assert guard_processor(a, bad_processor, faulted)(mx.array([1]), lp) is lp  # logits pass through
    assert isinstance(a.fault, ValueError) and faulted == [a]  # the first error wins, listed once
    assert b.fault is None


class _FailsOnce:
    """The model, except that its forward pass number ``at`` raises (an unattributable fault)."""

    def __init__(self, model, at: int):
        self._model, self._at, self.num_calls = model, at, 0

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, *args, **kwargs):
        self.num_calls += 1
        if self.num_calls == self._at:
            raise RuntimeError("injected forward failure")
        return self._model(*args, **kwargs)


def test_engine_faults_retries_and_aborts_leave_no_request_state_behind(model, tokenizer):
    """A request whose own processor raises fails alone; a failed batch step is retried with
    unchanged greedy output; an abort mid-decode ends its request; afterwards the engine's one
    table of request states is empty."""
    from omlx.engine.engine import Engine
    from omlx.request import Failed, Finished, TextDelta
    from omlx.scheduler import Scheduler
    from tests.unit.engine.test_runner import prompts, reference

    def bad(tokens, logits):
        raise ValueError("injected processor failure")

    eng = Engine("tiny", _FailsOnce(model, at=6), tokenizer, scheduler=Scheduler(8, 64), block_size=64,
                 prefill_step_size=128, mixed_step_size=32,
                 make_processors=lambda p: [bad] if p.seed == 7 else [])
    eng.start()
    try:
        eos = frozenset(tokenizer.eos_token_ids)
        pa, pb, pc, pd = prompts([40, 33, 21, 50], seed=5)
        sp = SamplingParams(max_tokens=12, temperature=0.0)
        reqs = [Request("tiny", pa, SamplingParams(max_tokens=12, temperature=0.0, seed=7)),
                Request("tiny", pb, sp), Request("tiny", pc, sp)]
        d = Request("tiny", pd, SamplingParams(max_tokens=40, temperature=0.0))
        d_events: list = []
        done = threading.Event()

        def d_sink(ev):  # on the engine thread: abort after its third output token
            d_events.append(ev)
            if sum(len(e.token_ids) for e in d_events if isinstance(e, TextDelta)) >= 3:
                eng.abort(d.request_id)
            if isinstance(ev, (Finished, Failed)):
                done.set()

        eng.submit(d, d_sink)
        evs = eng.run_all(reqs, 120)
        assert done.wait(60)
    finally:
        eng.stop()
    assert isinstance(evs[0][-1], Failed) and "injected processor failure" in str(evs[0][-1].error)
    for r, e in zip(reqs[1:], evs[1:]):
        assert isinstance(e[-1], Finished)
        got = [t for x in e if isinstance(x, TextDelta) for t in x.token_ids]
        assert got == reference(model, r.prompt_token_ids, 12, eos)
    assert isinstance(d_events[-1], Finished) and d_events[-1].finish_reason == "abort"
    assert eng.num_batch_failures == 1 and eng.num_retried_requests >= 2 and eng.num_request_failures == 1
    assert eng.num_active() == 0 and eng.active_requests() == [] and not eng._faulted
