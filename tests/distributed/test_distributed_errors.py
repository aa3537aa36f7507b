"""Errors in expert parallelism never hang: an exception of any type on one rank, raised
while it checks its call or while it computes between the all-to-alls, is an error on
every rank within seconds; afterwards the ranks are still in step (the same call gives
the same bits); and no process is left behind.

One world of two processes (``tests/distributed/ep_worker.py --serve``, gloo on localhost) answers
every case over its stdin; a case that does not answer within CASE_TIMEOUT fails (a hang
is a failure, not a stuck suite) and the next case gets a fresh world.
"""
import builtins
import importlib.util
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import mxfp4x

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the multi-process tests run on Linux (gloo over TCP)")

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "ep_worker.py")
WORLD = 2
CASE_TIMEOUT = 10.0   # every rank must have raised (and made one clean call) by then
START_TIMEOUT = 120.0  # two processes importing torch on a busy machine

# every public entry point and module with group= / expert_range=
ENTRIES = ["experts", "slots", "parallel", "mxfp4experts", "gptoss", "kimi"]
GRAD_ENTRIES = ["experts-grad", "slots-grad"]


def _exceptions():
    """Every builtin exception type that takes a message (KeyboardInterrupt, SystemExit
    and GeneratorExit included), and two of the worker's own: ``Boom`` (a type no code
    expects) and ``Unprintable`` (a ValueError whose message raises)."""
    names = set()
    for obj in vars(builtins).values():
        if isinstance(obj, type) and issubclass(obj, BaseException):
            try:
                obj("injected on this rank")
            except Exception:  # noqa: BLE001 - needs other arguments
                continue
            names.add(obj.__name__)  # IOError is OSError
    return sorted(names) + ["Boom", "Unprintable"]


EXCEPTIONS = _exceptions()


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Hang(Exception):
    pass


class _World:
    """WORLD worker processes serving cases; answers read with a deadline."""

    def __init__(self):
        self.scratch = tempfile.mkdtemp(prefix="mxfp4x-ep-errors-")
        port = _port()
        self.errs = [open(os.path.join(self.scratch, f"rank{r}.err"), "w+b")
                     for r in range(WORLD)]
        self.procs = []
        for rank in range(WORLD):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                       EP_TMP=self.scratch)
            self.procs.append(subprocess.Popen([sys.executable, WORKER, "--serve"], env=env,
                                               stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                               stderr=self.errs[rank]))
        self.buffers = [b""] * WORLD
        self.broken = False
        self._answers(START_TIMEOUT)  # {"ready": rank}

    def stderr(self, rank):
        self.errs[rank].flush()
        self.errs[rank].seek(0)
        return self.errs[rank].read().decode(errors="replace")[-2000:]

    def _answers(self, timeout):
        deadline = time.monotonic() + timeout
        answers = [None] * WORLD
        while True:
            for r in range(WORLD):
                if answers[r] is None and b"\n" in self.buffers[r]:
                    line, self.buffers[r] = self.buffers[r].split(b"\n", 1)
                    answers[r] = json.loads(line)
            waiting = [r for r in range(WORLD) if answers[r] is None]
            left = deadline - time.monotonic()
            if not waiting or left <= 0:
                break
            fds = {self.procs[r].stdout.fileno(): r for r in waiting}
            ready, _, _ = select.select(list(fds), [], [], left)
            for fd in ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:  # the rank exited without answering
                    self.broken = True
                    raise _Hang(f"rank {fds[fd]} exited: {self.stderr(fds[fd])}")
                self.buffers[fds[fd]] += chunk
        if waiting:
            self.broken = True
            raise _Hang(f"ranks {waiting} did not answer within {timeout:.0f} s; "
                        + " | ".join(f"rank {r}: {self.stderr(r)}" for r in waiting))
        return answers

    def ask(self, case, timeout=CASE_TIMEOUT):
        line = (json.dumps(case) + "\n").encode()
        try:
            for p in self.procs:
                p.stdin.write(line)
                p.stdin.flush()
        except BrokenPipeError:
            self.broken = True
            raise _Hang("a rank is gone") from None
        answers = self._answers(timeout)
        errors = [a["error"] for a in answers if "error" in a]
        assert not errors, errors[0]
        return answers

    def close(self):
        """Ends the world: asks it to quit, kills what did not; returns the ranks that
        had to be killed."""
        killed = []
        if not self.broken:
            try:
                for p in self.procs:
                    p.stdin.write(b'{"quit": true}\n')
                    p.stdin.flush()
            except BrokenPipeError:
                pass
        for rank, p in enumerate(self.procs):
            try:
                p.wait(timeout=0 if self.broken else 30)
            except subprocess.TimeoutExpired:
                pass
            if p.poll() is None:
                killed.append(rank)
                p.kill()
                p.wait()
            for f in (p.stdin, p.stdout):
                f.close()
        for f in self.errs:
            f.close()
        shutil.rmtree(self.scratch, ignore_errors=True)
        return killed


class _Worlds:
    """The current world, replaced after a hang so that one regression fails its own
    cases without stalling the others."""

    def __init__(self):
        self.world = None
        self.all = []

    def ask(self, case):
        if self.world is None or self.world.broken:
            if self.world is not None:
                self.world.close()
            self.world = _World()
            self.all.append(self.world)
        try:
            return self.world.ask(case)
        except _Hang as exc:
            self.world.close()
            pytest.fail(f"a rank hung or died ({case}): {exc}")


@pytest.fixture(scope="module")
def worlds():
    holder = _Worlds()
    try:
        yield holder
    finally:
        killed = holder.world.close() if holder.world is not None else []
        leftover = [p.pid for w in holder.all for p in w.procs if p.poll() is None]
        assert not leftover, f"processes left behind: {leftover}"
        assert not killed, f"ranks {killed} did not exit when the world was closed"


def _check_every_rank_raised(answers, case):
    bad = case["bad_rank"]
    for rank, a in enumerate(answers):
        assert a["raised"], (rank, case, a)
        assert a["seconds"] < CASE_TIMEOUT, (rank, case, a)
        if rank != bad:
            assert a["raised"] == "RuntimeError" and f"rank {bad} " in a["message"], \
                (rank, case, a)
        assert a["clean"], ("the ranks are out of step after the error", rank, case, a)
    return answers[bad]


_WHERE = [(e, "check") for e in ENTRIES + GRAD_ENTRIES] + \
    [(e, "products") for e in ENTRIES + GRAD_ENTRIES] + \
    [(e, "backward") for e in GRAD_ENTRIES]


# no shrinking: a failing example leaves a world behind that must be restarted, and the
# first failing example already names the entry, the step and the exception
@settings(phases=[Phase.explicit, Phase.reuse, Phase.generate], deadline=None)
@given(where=st.sampled_from(_WHERE), exception=st.sampled_from(EXCEPTIONS),
       bad_rank=st.integers(0, WORLD - 1))
def test_an_exception_of_any_type_on_one_rank_is_an_error_on_every_rank(
        worlds, where, exception, bad_rank):
    """The property: an injected exception of any type on one rank, while it checks its
    call (before the agreement) or while it computes between the all-to-alls (products,
    local_fn, gradient products), makes every rank raise within CASE_TIMEOUT, the bad
    rank its own exception, the others a RuntimeError naming it; the next call of every
    rank gives the same bits as before."""
    entry, fault = where
    case = {"entry": entry, "fault": fault, "exception": exception, "bad_rank": bad_rank}
    mine = _check_every_rank_raised(worlds.ask(case), case)
    assert mine["raised"] == exception, mine


@pytest.mark.parametrize("entry,fault", _WHERE)
@pytest.mark.parametrize("exception", ["Boom", "KeyboardInterrupt"])
def test_every_entry_and_step(worlds, entry, fault, exception):
    """Each entry point and module at each step, for a custom Exception and for an
    interrupt (posted without waiting, re-raised, never swallowed)."""
    case = {"entry": entry, "fault": fault, "exception": exception,
            "bad_rank": len(entry) % WORLD}
    mine = _check_every_rank_raised(worlds.ask(case), case)
    assert mine["raised"] == exception, mine


@pytest.mark.parametrize("entry,fault,want", [
    # expert_range=(e0, inf): an OverflowError once, a TypeError now
    ("experts", "range", "TypeError"),
    ("slots", "range", "TypeError"),
    ("parallel", "range", "TypeError"),
    ("mxfp4experts", "range", "TypeError"),
    ("gptoss", "range", "TypeError"),
    # isa="bogus": expert_parallel checks it before the first collective; KimiK3Experts
    # passes its own (set here after construction) to it
    ("parallel", "isa", "ValueError"),
    ("kimi", "isa", "ValueError"),
    # a module's own preparation before (or between) its distributed calls: latents that
    # are no array when MXFP4Experts makes the zero shared output (its TypeError naming
    # latent_tokens); routing weights torch cannot read between GptOssExperts' two calls
    ("mxfp4experts", "prep", "TypeError"),
    ("gptoss", "prep", "RuntimeError"),
])
def test_a_bad_argument_on_one_rank_is_an_error_on_every_rank(worlds, entry, fault, want):
    case = {"entry": entry, "fault": fault, "bad_rank": 1}
    mine = _check_every_rank_raised(worlds.ask(case), case)
    assert mine["raised"] == want, mine


def test_inputs_the_single_process_ops_take_work_on_every_rank(worlds):
    """Nested lists as the shared output of a rank holding no experts (an AttributeError
    on that rank once), numpy latents for expert_parallel and KimiK3Experts (an
    AttributeError once): they work, and give the bits of tensors."""
    for special in ("lists-on-an-empty-rank", "numpy-latents"):
        answers = worlds.ask({"special": special})
        assert all(a["equal"] for a in answers), (special, answers)


def test_disagreements_are_named_readably(worlds):
    """One rank float64 latents, the other float32: named dtypes, not codes; one rank
    expert_parallel, the other mxfp4_experts: an error on both, naming the ops."""
    answers = worlds.ask({"special": "dtype-disagreement"})
    for a in answers:
        assert a["raised"] == "ValueError", a
        assert "the latents' dtype (float32 on rank 0; float64 on rank 1)" in a["message"], a
    answers = worlds.ask({"special": "op-disagreement"})
    for a in answers:
        assert a["raised"] == "ValueError", a
        assert "mxfp4_experts on rank 0; expert_parallel on rank 1" in a["message"], a


def test_a_routing_that_fails_on_one_rank_fails_on_every_rank(worlds):
    """ExpertRouting (public) built with an expert id outside the plan on one rank: that
    rank's failure rides in the counts exchange, and every rank raises there."""
    answers = worlds.ask({"special": "routing-bad-id"})
    assert answers[WORLD - 1]["raised"] == "IndexError", answers
    for a in answers[:WORLD - 1]:
        assert a["raised"] == "RuntimeError" and f"rank {WORLD - 1} " in a["message"], a
    assert all(a["seconds"] < CASE_TIMEOUT for a in answers), answers


def test_kimi_experts_check_their_isa_at_construction():
    """KimiK3Experts(..., isa="bogus", group=...) raises where it is built, before any
    collective (the check lives in mxfp4x/models/kimi_k3/experts.py)."""
    import torch
    packed = torch.zeros((2, 32, 1, 16), dtype=torch.uint8)
    scales = torch.full((2, 32, 1), 127, dtype=torch.uint8)
    with pytest.raises(ValueError, match="bogus"):
        mxfp4x.nn.KimiK3Experts((packed, scales), (packed, scales), (packed, scales),
                                isa="bogus", group=object())


def _worker_module():
    spec = importlib.util.spec_from_file_location("ep_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_WORKER = _worker_module()
_STACK_WHERE = [(kind, point) for kind in _WORKER.STACKS for point in _WORKER.POINTS[kind]]


def _check_stack(answers, case):
    """Every rank raised in the faulted request (the bad rank its own exception, within
    CASE_TIMEOUT); no request on any rank returned bits other than a clean run's; the
    requests before and after it ran clean."""
    bad = case["bad_rank"]
    for rank, a in enumerate(answers):
        assert a["one_process"], ("the clean expert-parallel run differs from one process",
                                  rank, case)
        first, faulted, last = a["requests"]
        for req in (first, last):
            assert req["raised"] is None and req["equal"], (rank, case, a)
        assert faulted["raised"], ("a rank returned from the faulted request", rank, case, a)
        assert faulted["equal"] is None, (rank, case, a)
        assert faulted["seconds"] < CASE_TIMEOUT, (rank, case, a)
        if rank == bad:
            assert faulted["raised"] == case["exception"], (rank, case, a)
        else:
            assert faulted["raised"] == "RuntimeError" and f"rank {bad} " in \
                faulted["message"], (rank, case, a)


@pytest.mark.parametrize("kind,point", _STACK_WHERE)
@pytest.mark.parametrize("exception", ["Boom", "KeyboardInterrupt"])
def test_a_fault_anywhere_in_two_stacked_layers_is_an_error_on_every_rank(
        worlds, kind, point, exception):
    """Two stacked expert-parallel layers of each kind (KimiK3MoE, GptOssMoE,
    GptOssExperts, KimiK3Experts, MXFP4Experts, two op calls under run_layer), three
    requests served in a loop; one rank's layer B fails in the middle request at every
    point of its forward and backward (entering it, its router, projections, products,
    the work between two exchanges, its norm, shared experts, leaving it, and in its
    backward's first and last steps and the owners' gradient products): every rank
    raises in that request, and the others run clean with the bits of one process."""
    case = {"stack": kind, "point": point, "exception": exception,
            "bad_rank": len(kind + point) % WORLD}
    _check_stack(worlds.ask(case), case)


@settings(phases=[Phase.explicit, Phase.reuse, Phase.generate], deadline=None,
          max_examples=40)
@given(where=st.sampled_from(_STACK_WHERE), exception=st.sampled_from(EXCEPTIONS),
       bad_rank=st.integers(0, WORLD - 1))
def test_an_exception_of_any_type_anywhere_in_a_block_is_an_error_on_every_rank(
        worlds, where, exception, bad_rank):
    """The property over every builtin exception type, every kind of layer, every point
    and either rank."""
    kind, point = where
    case = {"stack": kind, "point": point, "exception": exception, "bad_rank": bad_rank}
    _check_stack(worlds.ask(case), case)
