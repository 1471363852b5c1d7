"""yolov9_ddp.failures: the one-line causes, the record torchrun reads, and the ways loader workers are ended
(a killed loader worker must not hang the job). The jobs that prove the whole chain are in test_faults.py; these are
the fast, focused checks."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.utils.data import DataLoader, Dataset

from testsupport.trees import KIT
from yolov9_ddp import failures


class Raising(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        raise ValueError(f'bad sample {index}')


def raised(function):
    try:
        function()
    except Exception as e:  # noqa: BLE001 - the exception is what the test looks at
        return e
    raise AssertionError('nothing was raised')


def test_out_of_memory_says_what_to_lower_without_a_traceback():
    line, traceback_helps = failures.cause(torch.cuda.OutOfMemoryError('CUDA out of memory. Tried to allocate 2 GiB'))
    assert line.startswith('out of GPU memory (CUDA out of memory. Tried to allocate 2 GiB)') and '--batch-size' in line
    assert not traceback_helps


def test_a_killed_loader_worker_names_the_oom_killer():
    line, traceback_helps = failures.cause(RuntimeError('DataLoader worker (pid 123) is killed by signal: Killed. '))
    assert line.startswith('DataLoader worker (pid 123) is killed by signal: Killed.') and 'out-of-memory' in line
    assert not traceback_helps


def test_an_exception_in_a_loader_worker_is_named_by_its_own_type_and_message():
    error = raised(lambda: next(iter(DataLoader(Raising(), num_workers=1))))
    line, traceback_helps = failures.cause(error)
    assert line.startswith('ValueError: bad sample 0 (in a DataLoader worker, at '), line
    assert traceback_helps and '\n' not in line


def test_any_other_exception_is_one_line_with_the_place_it_came_from():
    def loss():
        raise ValueError('bad box\nsecond line')
    line, traceback_helps = failures.cause(raised(loss))
    assert line.startswith('ValueError: bad box (at test_failures.py:') and line.endswith(' in loss)'), line
    assert traceback_helps


def test_the_record_is_what_torchrun_reads_as_the_cause(tmp_path, monkeypatch):
    error_file = tmp_path / 'error.json'
    monkeypatch.setenv('TORCHELASTIC_ERROR_FILE', str(error_file))
    before = int(time.time())
    failures.record_for_torchrun('ddp_train_dual.py [rank 1]: out of GPU memory')
    failure = ProcessFailure(local_rank=1, pid=4321, exitcode=1, error_file=str(error_file))
    assert failure.message == 'ddp_train_dual.py [rank 1]: out of GPU memory'
    assert before <= failure.timestamp <= time.time()
    assert json.loads(error_file.read_text())['message'] == failure.message


def test_torchrun_names_the_cause_and_not_its_consequence_recorded_in_the_same_second(tmp_path, monkeypatch):
    """Rank 1 fails, rank 0 fails because of it, both within one second: torchrun's summary (the failure of the
    earliest timestamp, the lowest rank on a tie) must name rank 1's line as the root cause."""
    monkeypatch.setattr(time, 'time', lambda: 1_700_000_000.5)
    recorded = {}
    for rank, message, consequence in ((1, 'out of GPU memory', False), (0, 'another rank died', True)):
        recorded[rank] = tmp_path / f'{rank}' / 'error.json'
        recorded[rank].parent.mkdir()
        monkeypatch.setenv('TORCHELASTIC_ERROR_FILE', str(recorded[rank]))
        failures.record_for_torchrun(message, consequence)
    summary = ChildFailedError('ddp_train_dual.py', {
        rank: ProcessFailure(local_rank=rank, pid=4321 + rank, exitcode=1, error_file=str(recorded[rank]))
        for rank in (0, 1)})
    assert summary.get_first_failure()[1].message == 'out of GPU memory'


def test_a_rank_stopped_by_anothers_failure_exits_only_once_its_nodes_first_rank_has_its_line_out(tmp_path, monkeypatch,
                                                                                                    capsys):
    """Rank 0 fails in a step all ranks take, rank 1 stops there (PeerFailed) and prints nothing: rank 1 must not exit
    before rank 0 has reported, or torchrun stops rank 0 before its one line is out."""
    from yolov9_ddp import comm, entry
    attempt = tmp_path / 'attempt_0'
    for local_rank in ('0', '1'):
        (attempt / local_rank).mkdir(parents=True)
    monkeypatch.setenv('TORCHELASTIC_ERROR_FILE', str(attempt / '1' / 'error.json'))
    for name, value in (('RANK', '1'), ('LOCAL_RANK', '1'), ('WORLD_SIZE', '2')):
        monkeypatch.setenv(name, value)
    rank0_reports = threading.Timer(0.5, (attempt / '0' / 'error.json').write_text, ['{}'])
    rank0_reports.start()
    started = time.monotonic()
    entry.report('ddp_train_dual.py', comm.PeerFailed('stopping: another rank failed'))
    assert time.monotonic() - started >= 0.45 and capsys.readouterr().err == ''
    assert json.loads((attempt / '1' / 'error.json').read_text())['message'].startswith('ddp_train_dual.py [rank 1]')


def test_torchrun_never_finds_the_record_half_written(tmp_path, monkeypatch):
    """torchrun reads a failed worker's file whenever it finds the worker gone, which may be in the middle of the
    worker's write (it stops the other ranks of a failed job, and they record why as they exit): every read while
    records are written again and again finds either no file or a whole one (truncated, then written, about 80% of
    the reads found it empty or torn)."""
    error_file = tmp_path / 'error.json'
    monkeypatch.setenv('TORCHELASTIC_ERROR_FILE', str(error_file))
    done = threading.Event()

    def record_again_and_again():
        try:
            for i in range(2000):
                failures.record_for_torchrun(f'ddp_train_dual.py [rank 0]: record {i}', consequence=bool(i % 2))
        finally:
            done.set()  # the reads below end even where a write raised
    writer = threading.Thread(target=record_again_and_again)
    writer.start()
    reads, torn = 0, []
    while not done.is_set():
        try:
            text = error_file.read_text()
        except FileNotFoundError:
            continue
        reads += 1
        try:
            json.loads(text)
        except ValueError:
            torn.append(text)
    writer.join()
    assert reads > 100, 'the reads overlapped the writes'
    assert torn == [], f'{len(torn)} of {reads} reads found the record half-written, e.g. {torn[0]!r}'
    assert [p.name for p in tmp_path.iterdir()] == ['error.json'], 'no temporary file is left beside it'


def test_no_record_outside_torchrun(tmp_path, monkeypatch):
    monkeypatch.delenv('TORCHELASTIC_ERROR_FILE', raising=False)
    monkeypatch.chdir(tmp_path)
    failures.record_for_torchrun('anything')
    assert list(tmp_path.iterdir()) == []


def run_script(code: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, '-c', textwrap.dedent(code), str(KIT)], capture_output=True, text=True,
                          timeout=timeout)


def pid_alive(pid: int) -> bool:
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().rsplit(')', 1)[1].split()[0] != 'Z'
    except OSError:
        return False


@pytest.mark.skipif(sys.platform != 'linux', reason='the kernel-side guarantee (prctl) exists on Linux only')
def test_a_worker_dies_with_its_trainer(tmp_path):
    """A worker ignoring SIGTERM (as loader workers do) whose parent is SIGKILLed is gone at once."""
    result = run_script(f'''
        import os, signal, sys, time
        sys.path.insert(0, sys.argv[1])
        from yolov9_ddp import failures
        parent = os.getpid()
        child = os.fork()
        if child == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            failures.die_with_parent(parent)
            time.sleep(60)
            os._exit(0)
        open({str(tmp_path / 'child')!r}, 'w').write(str(child))
        time.sleep(0.5)
        os.kill(parent, signal.SIGKILL)
    ''', timeout=30)
    assert result.returncode == -9, result.stderr
    child = int((tmp_path / 'child').read_text())
    deadline = time.monotonic() + 3
    while pid_alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(child), 'the worker outlived its trainer'


EXIT_WITH_STUBBORN_CHILDREN = '''
    import multiprocessing, signal, sys, time
    sys.path.insert(0, sys.argv[1])
    from yolov9_ddp import failures

    def stubborn():  # a loader worker: SIGTERM is its trainer's business
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(120)

    if __name__ == '__main__':
        {arm}
        for _ in range(2):
            multiprocessing.Process(target=stubborn, daemon=True).start()
        time.sleep(0.5)
        print(' '.join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
'''


def test_children_that_ignore_sigterm_cannot_block_the_exit():
    """multiprocessing's exit handler SIGTERMs daemonic children and joins them: children that ignore SIGTERM hang
    the exit (the control run shows it); with end_children_at_exit the process exits at once, children gone."""
    with pytest.raises(subprocess.TimeoutExpired) as hung:
        run_script(EXIT_WITH_STUBBORN_CHILDREN.format(arm='pass'), timeout=6)
    for pid in (hung.value.output or b'').split():  # the control's children, orphaned by the timeout
        os.kill(int(pid), signal.SIGKILL)
    # the children sleep 120 s: a process that waits for them times out here
    result = run_script(EXIT_WITH_STUBBORN_CHILDREN.format(arm='failures.end_children_at_exit()'), timeout=90)
    assert result.returncode == 0, result.stderr
    children = [int(pid) for pid in result.stdout.split()]
    assert len(children) == 2 and not any(pid_alive(pid) for pid in children)


END_PROCESS = '''
    import atexit, pathlib, sys, threading, time
    sys.path.insert(0, sys.argv[1])
    from yolov9_ddp import failures

    class FreedInTeardown:  # a module global: the interpreter's teardown frees it, as it frees torch's C++ objects
        def __del__(self):
            print('teardown ran', flush=True)

    def late_writer():
        time.sleep(0.5)
        pathlib.Path(sys.argv[2], 'thread').write_text('done')

    kept = FreedInTeardown()
    threading.Thread(target=late_writer).start()
    atexit.register(lambda: pathlib.Path(sys.argv[2], 'atexit').write_text('ran'))
    sys.stdout.write('the last line, not flushed')
    failures.end_process(int(sys.argv[3]))
'''


@pytest.mark.parametrize('status', [0, 3])
def test_a_finished_entry_point_ends_without_the_interpreter_teardown_but_with_everything_before_it(tmp_path, status):
    """failures.end_process: main()'s status, the threads joined, the atexit handlers run and the output flushed;
    after a success nothing freed by the interpreter's teardown runs (a C++ destructor there can abort a finished
    rank); after a failure the teardown stays (it gives rank 0 the time to print the error line, see end_process)."""
    result = subprocess.run([sys.executable, '-c', textwrap.dedent(END_PROCESS), str(KIT), str(tmp_path), str(status)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == status, result.stderr
    assert result.stdout == 'the last line, not flushed' + ('' if status == 0 else 'teardown ran\n'), result.stdout
    assert (tmp_path / 'thread').read_text() == 'done' and (tmp_path / 'atexit').read_text() == 'ran'


def test_a_dead_peer_is_named_as_such_in_gloo_s_own_words():
    gloo = RuntimeError('[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer '
                        '[127.0.0.1]:44963. This is typically caused by a remote worker crashing. Check the logs')
    assert failures.collective_failure(gloo, 60) == ('a collective operation failed: another rank died or failed '
                                                     '(Connection closed by peer [127.0.0.1]:44963); its error line '
                                                     'says why')


def test_a_timed_out_collective_names_the_flag_and_other_errors_are_not_collective_failures():
    line = failures.collective_failure(RuntimeError('[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting '
                                                    '10000ms for recv operation to complete'), 10)
    assert line.startswith('a collective operation failed or timed out (') and line.endswith('--ddp-timeout 10 s')
    assert failures.collective_failure(RuntimeError('DataLoader worker (pid 1) is killed by signal: Killed.'), 10) \
        is None
    assert failures.collective_failure(ValueError('bad box'), 10) is None
