"""StructuredOutputManager under concurrent calls (an async scheduler overlapping two steps)."""
import os
import subprocess
import sys
import textwrap
import threading
import time

from logitgate.structured import RequestStatus, StructuredOutputManager, StructuredOutputsParams
from logitgate.structured.xgrammar_backend import XGrammarBackend
from tests.helpers.vocab_helpers import VOCAB_SIZE

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


class OverlapDetectingBackend(XGrammarBackend):
    """Records when two threads step the same grammar at once (xgrammar's matchers are not
    thread-safe: that is what corrupted and crashed them)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.busy: set[int] = set()
        self.overlaps = 0
        self.guard = threading.Lock()

    def accept_batch(self, grammars, tokens):
        with self.guard:
            if any(id(g) in self.busy for g in grammars):
                self.overlaps += 1
            self.busy.update(id(g) for g in grammars)
        time.sleep(0.002)  # widen the window a race needs
        try:
            return super().accept_batch(grammars, tokens)
        finally:
            with self.guard:
                self.busy.difference_update(id(g) for g in grammars)


def _manager(tokenizer_info, engine, ids):
    m = StructuredOutputManager(tokenizer_info, vocab_size=VOCAB_SIZE, num_speculative_tokens=3, backend=engine)
    for r in ids:
        m.add_request(r, StructuredOutputsParams(json_object=True))
    for r in ids:
        assert m.wait(r, timeout=30) is RequestStatus.READY
    return m


def test_overlapping_steps_over_the_same_requests_never_share_a_grammar(tokenizer_info):
    engine = OverlapDetectingBackend(tokenizer_info, vocab_size=VOCAB_SIZE)
    ids = [f"r{i}" for i in range(4)]
    drafts = {r: list(b'{"o') for r in ids}
    with _manager(tokenizer_info, engine, ids) as m:
        expected = m.grammar_bitmask(ids, drafts).clone()
        barrier, results, errors = threading.Barrier(2), [], []

        def step():
            try:
                barrier.wait(timeout=10)
                for _ in range(15):
                    results.append(m.grammar_bitmask(ids, drafts))
                    assert m.validate_tokens("r0", list(b'{"o')) == list(b'{"o')
                    assert not m.is_terminated("r1")
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=step) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors
        assert engine.overlaps == 0
        assert all(bool((b == expected).all()) for b in results)
        assert bool((m.grammar_bitmask(ids, drafts) == expected).all())  # no grammar left corrupted


class BlockingBackend(XGrammarBackend):
    """Fills the rows of the grammars in `blocked` only once `release` is set."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.blocked: set[int] = set()
        self.entered = threading.Event()
        self.release = threading.Event()

    def fill_bitmasks(self, grammars, bitmask, rows):
        if any(id(g.matcher) in self.blocked for g in grammars):
            self.entered.set()
            assert self.release.wait(timeout=30)
        super().fill_bitmasks(grammars, bitmask, rows)


def test_unrelated_requests_do_not_wait_for_each_other(tokenizer_info):
    engine = BlockingBackend(tokenizer_info, vocab_size=VOCAB_SIZE)
    with _manager(tokenizer_info, engine, ["slow", "fast"]) as m:
        m.grammar_bitmask(["slow"])  # resolves the grammar
        engine.blocked.add(id(m._ready("slow").grammar.matcher))
        slow = threading.Thread(target=m.grammar_bitmask, args=(["slow"], {"slow": list(b'{"')}))
        slow.start()
        try:
            assert engine.entered.wait(timeout=30)
            # "slow" is mid-walk and holds its lock; "fast" goes ahead.
            started = time.perf_counter()
            m.grammar_bitmask(["fast"], {"fast": list(b'{"')})
            assert m.accept_tokens("fast", list(b"{"))
            assert time.perf_counter() - started < 10
            assert slow.is_alive()
        finally:
            engine.release.set()
            slow.join(timeout=30)


STRESS = textwrap.dedent(
    """
    import sys, threading, time
    from tests.helpers.vocab_helpers import EOS, VOCAB, VOCAB_SIZE, xgr
    from logitgate import StructuredOutputManager, StructuredOutputsParams
    info = xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, vocab_size=VOCAB_SIZE, stop_token_ids=[EOS])
    m = StructuredOutputManager(info, vocab_size=VOCAB_SIZE, num_speculative_tokens=3)
    ids = [f"r{i}" for i in range(8)]
    for r in ids:
        m.add_request(r, StructuredOutputsParams(json_object=True))
    drafts = {r: list(b'{"o') for r in ids}
    expected = m.grammar_bitmask(ids, drafts).clone()
    bad, stop = [], time.time() + float(sys.argv[1])
    def hammer():
        try:
            while time.time() < stop:
                if not bool((m.grammar_bitmask(ids, drafts) == expected).all()):
                    bad.append("wrong rows")
        except Exception as exc:
            bad.append(repr(exc))
    threads = [threading.Thread(target=hammer) for _ in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    if not bool((m.grammar_bitmask(ids, drafts) == expected).all()):
        bad.append("grammars left corrupted")
    print(len(bad), bad[:3])
    sys.exit(1 if bad else 0)
    """
)


def test_real_xgrammar_matchers_survive_two_threads_stepping_the_same_batch():
    # In a child process: before the fix this crashed the interpreter about half the time and
    # otherwise produced wrong rows within milliseconds.
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", STRESS, "1.5"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
