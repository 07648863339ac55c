"""What a ``%%distributed`` cell sends back, through a real kernel, real ipyparallel engines and
real torch.distributed (gloo on CPU), on the server's own (simulated) GPUs: no broker.

The engines send only what the kernel shows (``engine.quiet_cells``) and flush their output
streams only when something is waiting (``engine.gate_flushes``): these check that what a user
sees and what each rank keeps stay the same, and the gate itself on a real ipykernel stream.
"""

import threading

import pytest
import zmq
from ipykernel.iostream import IOPubThread, OutStream
from jupyter_client.session import Session

from gpu_magics.engine.rank import gate_flushes

from .kerneltools import own_gpus_env, run_notebook


@pytest.fixture
def kernel_env(tmp_path):
    return own_gpus_env(tmp_path, "t:0,t:1,t:2")


def test_rank_0s_value_is_the_result_and_every_rank_keeps_its_own(kernel_env):
    head = "%%distributed --gpus 3 --timeout 30\n"
    cells = run_notebook(
        [
            head + 'print("before", rank)\nrank * 10 + 7',
            head + 'print("kept", _, Out[max(Out)])\nimport sys\nprint("err", rank, file=sys.stderr)',
            head.replace("\n", " --targets 1,2\n") + "[rank] * 2",
            head + 'print("kept", _)\n{"rank": rank}',
            "%distributed shutdown",
        ],
        kernel_env,
    )
    for i, c in enumerate(cells):
        assert c.error is None, (i, c)
    first, kept, targeted, again, _ = cells
    assert first.result == 7  # rank 0's, as before
    assert first.rank_lines() == {r: [f"before {r}"] for r in range(3)}
    # every rank's own last value, in _ and in Out, though only rank 0's was shown
    assert kept.rank_lines() == {r: [f"kept {r * 10 + 7} {r * 10 + 7}"] for r in range(3)}
    assert kept.rank_lines("stderr") == {r: [f"err {r}"] for r in range(3)}
    assert kept.result is None
    assert targeted.result is None  # rank 0 did not run it: no result shown
    assert again.rank_lines() == {0: ["kept 7"], 1: ["kept [1, 1]"], 2: ["kept [2, 2]"]}
    assert again.result == {"rank": 0}


def test_output_at_a_cells_end_is_shown_after_cells_that_printed_nothing(kernel_env):
    head = "%%distributed --gpus 3 --timeout 30\n"
    cells = run_notebook(
        [
            head + "x = rank",  # starts the engines (its output says so)
            head + "y = x",
            head + 'import sys\nprint("tail", rank, end="")',
            head + "x + 1",
            head + 'print("err", rank, file=sys.stderr, end="")\nprint("out", rank)',
            "%distributed shutdown",
        ],
        kernel_env,
    )
    for i, c in enumerate(cells):
        assert c.error is None, (i, c)
    _, quiet, tail, value, both, _ = cells
    assert quiet.outputs == []
    assert tail.rank_lines() == {r: [f"tail {r}"] for r in range(3)}
    assert value.result == 1 and value.outputs[0]["output_type"] == "execute_result"
    assert both.rank_lines() == {r: [f"out {r}"] for r in range(3)}
    assert both.rank_lines("stderr") == {r: [f"err {r}"] for r in range(3)}


@pytest.fixture
def stream():
    """A real ipykernel stdout on a real IOPub thread, every message it sends recorded."""
    context = zmq.Context()
    socket = context.socket(zmq.PUB)
    socket.bind("inproc://gpuhub-gate-test")
    session = Session(key=b"")
    thread = IOPubThread(socket)
    thread.start()
    out = OutStream(session, thread, "stdout", watchfd=False)
    sent, real_send = [], session.send
    release = threading.Event()
    release.set()
    schedules, on_schedule, real_schedule = [], [], thread.schedule

    def send(stream, msg, *args, **kwargs):
        release.wait(10)  # a test holds the IOPub thread inside a send by clearing it
        sent.append(msg["content"]["text"])
        return real_send(stream, msg, *args, **kwargs)

    def schedule(f):
        schedules.append(f)
        for hook in on_schedule:
            hook()
        return real_schedule(f)

    session.send, thread.schedule = send, schedule
    assert gate_flushes(out) == 1
    assert gate_flushes(out) == 0  # once
    yield out, sent, schedules, release, on_schedule
    release.set()
    thread.stop()
    thread.close()
    context.term()


def test_a_flush_with_nothing_written_makes_no_round_trip_to_the_iopub_thread(stream):
    out, sent, schedules, _, _ = stream
    out.flush()
    out.flush()
    assert schedules == [] and sent == []


def test_what_was_written_has_been_sent_when_flush_returns(stream):
    out, sent, schedules, _, _ = stream
    out.write("a")
    out.write("b\n")
    out.flush()
    assert sent == ["ab\n"]
    before = len(schedules)
    out.flush()  # sent already: nothing to wait for
    assert len(schedules) == before and sent == ["ab\n"]
    out.write("c")
    out.flush()
    assert sent == ["ab\n", "c"]


def test_a_flush_while_the_iopub_thread_is_still_sending_waits_for_it(stream):
    out, sent, _, release, on_schedule = stream
    gate = out._gpuhub_gate
    release.clear()  # the IOPub thread's next send waits
    out.write("late")
    started = threading.Event()

    def timer_flush():  # what the stream's own timer does, in the IOPub thread
        started.set()
        out._flush()

    out.pub_thread.schedule(timer_flush)
    assert started.wait(10)
    while out._buffers:  # until the send has taken the buffers
        pass
    assert gate.sending == 1 and sent == []
    on_schedule.append(release.set)  # the send goes on once flush asks the IOPub thread
    out.flush()  # a flush that skipped would return now, before the text is out
    assert sent == ["late"]
