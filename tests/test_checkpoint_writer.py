"""Checkpoints written off the training thread (yolov9_ddp.checkpoints, hostcopy.py, writer.py): rank 0 queues a host
copy of the training state between two steps and the writer completes and writes it. Unit tests, no training:

  - the copy is the state when it was queued, lives in host memory and shares nothing with the state the training
    thread goes on changing (modules, optimizer state, nested containers)
  - the training thread copies the tensors of each dtype with one call; each copy keeps its tensor's memory layout
    and owns its storage; a module's empty OrderedDicts pickle without copyreg's slot-name lookup
  - the training thread's half reads nothing back from the device: the ranks' own statistics and the grad scaler's
    state go into the queued copy as copies on their device, and the file holds their values when it was queued
  - one write at a time: a periodic checkpoint due while a write runs is skipped (not even queued), with one line,
    and save() returns at once; any other save waits for the write under way; what comes after a write runs once
    the file is in place
  - the replaced last.pt stays as last.previous.pt
  - a write that fails says so in one line and leaves the checkpoints before it intact; the next write works
  - a write under way when the process exits completes
  - the writer process writes the file the thread would; its error or its end costs that checkpoint only, in one
    line, and a new child writes the next; it dies with the process that forked it, even mid-write, and not on a
    SIGINT or SIGTERM; forked ahead of the first checkpoint, it ends at close() though forked workers hold its pipe;
    where none can start, or two in a row end while writing, the thread writes the checkpoints, after one line
"""
import copyreg
import multiprocessing
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, OrderedDict
from copy import deepcopy
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from testsupport.trees import KIT
from yolov9_ddp import checkpoints, files, state as run_state, writer as writer_process
from yolov9_ddp.checkpoints import Checkpoints, QueuedCheckpoint
from yolov9_ddp.ema import norm_statistics
from yolov9_ddp.files import previous_path
from yolov9_ddp.hostcopy import QueuedHostCopy, scaler_numbers, scaler_state

pytestmark = pytest.mark.timeout(60)
SKIPPED = re.compile(r'^checkpoint at step 20 skipped: the previous write \(\d+\.\d s so far\) is still running$')


def training_state():
    """A model, its EMA, an optimizer with momentum after one step, and nested values, as a checkpoint holds them."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    optimizer.step()
    return {'epoch': 3, 'model': model, 'ema': deepcopy(model).eval(), 'optimizer': optimizer.state_dict(),
            'position': {'step': 7, 'rng': [torch.arange(4), (torch.ones(2),)]}}, optimizer


def tensors(obj) -> list:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, nn.Module):
        return [*obj.parameters(), *obj.buffers()]
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else []
    return [t for value in values for t in tensors(value)]


def test_a_host_copy_is_the_state_when_it_was_queued_and_shares_nothing_with_it():
    state, optimizer = training_state()
    expected = [t.clone() for t in tensors(state)]
    queued = QueuedHostCopy(state)  # the training thread's half
    originals = tensors(state)
    with torch.no_grad():  # the training thread goes on (an optimizer step, the EMA, the next position) before
        for t in originals:  # the writer's thread completes the copy
            t.add_(1)
    state['position']['step'] = 8
    state['optimizer']['param_groups'][0]['lr'] = 0.2
    copy = queued.result()
    assert len(originals) == len(expected) > 10
    assert all(torch.equal(a, b) for a, b in zip(tensors(copy), expected))
    assert copy['position']['step'] == 7 and copy['optimizer']['param_groups'][0]['lr'] == 0.1
    assert not {t.untyped_storage().data_ptr() for t in originals} & {t.untyped_storage().data_ptr()
                                                                        for t in tensors(copy)}
    assert optimizer.state_dict()['state'][0]['momentum_buffer'] is not copy['optimizer']['state'][0]['momentum_buffer']


def test_a_host_copy_keeps_the_modules_and_their_parameters():
    state, _ = training_state()
    copy = QueuedHostCopy(state).result()
    for key in ('model', 'ema'):
        assert type(copy[key]) is nn.Sequential and copy[key] is not state[key]
        assert copy[key].training == state[key].training
        for mine, theirs in zip(copy[key].parameters(), state[key].parameters()):
            assert type(mine) is nn.Parameter and mine.requires_grad == theirs.requires_grad and mine.grad is None
            assert mine.device.type == 'cpu' and torch.equal(mine, theirs)
    assert copy['position']['rng'][1][0].is_leaf and isinstance(copy['position']['rng'][1], tuple)
    twice = QueuedHostCopy({'model': state['model'], 'again': state['model'],
                            'tensor': [state['position']['rng'][0]] * 2}).result()
    assert twice['again'] is twice['model'] and twice['tensor'][0] is twice['tensor'][1]  # held twice, copied once


def test_a_checkpoints_empty_ordered_dicts_take_no_slot_name_lookup_and_read_back_the_same(tmp_path, monkeypatch):
    """hostcopy.TensorsAside: each module's empty OrderedDicts (its hooks) are pickled as OrderedDict(), not through
    copyreg._slotnames, in the training thread's half of a checkpoint."""
    state, _ = training_state()
    looked_up, lookup = [], copyreg._slotnames
    monkeypatch.setattr(copyreg, '_slotnames', lambda cls: looked_up.append(cls.__name__) or lookup(cls))
    copy = QueuedHostCopy(state)
    assert looked_up == []
    checkpoints.save_file(copy.result(), tmp_path / 'last.pt')
    loaded = torch.load(tmp_path / 'last.pt', weights_only=False)
    for mine, theirs in zip(loaded['model'].modules(), state['model'].modules()):
        assert {name: type(value) for name, value in vars(mine).items()} == {
            name: type(value) for name, value in vars(theirs).items()}
        assert mine._forward_hooks == theirs._forward_hooks == OrderedDict()


class CountedOps(TorchDispatchMode):
    """The torch operators called inside the block, by name, as torch dispatches them."""

    def __init__(self):
        super().__init__()
        self.calls = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_a_host_copy_takes_one_copy_call_for_each_dtype_and_keeps_each_tensors_layout():
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    grid = torch.arange(12.).view(3, 4)
    state = {'conv': conv, 'step': torch.tensor(7), 'steps': torch.arange(5), 'scalar': torch.tensor(0.5),
             'gappy': grid[:, ::2], 'transposed': grid.t(), 'empty': torch.zeros(0, 3)}
    with CountedOps() as ops:
        queued = QueuedHostCopy(state)
    copy = queued.result()
    assert ops.calls['_foreach_copy_'] == 2, ops.calls  # float32 and int64: one call each
    # alone: the view with gaps, and the transposed grid, whose order is none of torch's memory formats
    assert ops.calls['_to_copy'] == 2 and ops.calls['copy_'] == 0, ops.calls
    for name in ('step', 'steps', 'scalar', 'gappy', 'transposed', 'empty'):
        mine, theirs = copy[name], state[name]
        assert torch.equal(mine, theirs) and mine.dtype == theirs.dtype, name
        assert mine.stride() == theirs.stride() or name == 'gappy', name
        assert mine.untyped_storage().nbytes() == mine.numel() * mine.element_size(), f'{name} shares a buffer'
    weight = copy['conv'].weight
    assert type(weight) is nn.Parameter and weight.requires_grad and torch.equal(weight, conv.weight)
    assert weight.is_contiguous(memory_format=torch.channels_last) and not weight.is_contiguous()


class ReadsBack(TorchFunctionMode):
    """The tensor methods called inside the block that read a value back to the host, which on a GPU waits for its
    queue to drain: .item(), .tolist(), .numpy(), .cpu(), a blocking .to('cpu')."""
    READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu}

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        to_host = func is torch.Tensor.to and 'cpu' in map(str, [*args[1:], kwargs.get('device')])
        if func in self.READS or (to_host and not kwargs.get('non_blocking')):
            self.calls.append(func.__name__)
        return func(*args, **kwargs)


def test_the_training_threads_half_of_a_checkpoint_reads_nothing_back_and_the_file_holds_what_it_did():
    """The rank's own statistics and the grad scaler's state go into the queued copy as copies on their device
    (state.rank_state, hostcopy.scaler_state): read with .cpu() or .item(), each would be a wait for the GPU."""
    state, _ = training_state()
    model, ema, mean_loss = state['model'], state['ema'], torch.tensor([1.5, 2.5, 0.5])
    scaler = torch.amp.GradScaler('cpu', init_scale=1024.0, growth_interval=3)
    scaler.scale(mean_loss.sum())  # the first scaled loss makes the scale and growth tracker tensors
    with ReadsBack() as reads:
        ranks = [run_state.rank_state(model, ema, mean_loss)]
        queued = QueuedHostCopy({'scaler': scaler_state(scaler), 'ranks': ranks})
    assert reads.calls == []
    expected = {'norm': [t.clone() for t in norm_statistics(model)],
                'ema_norm': [t.clone() for t in norm_statistics(ema)], 'mean_loss': mean_loss.clone()}
    with torch.no_grad():  # the training thread goes on before the writer's thread completes the copy
        for t in [*norm_statistics(model), *norm_statistics(ema), mean_loss]:
            t.add_(1)
    scaler._scale.mul_(2)
    written = queued.result()
    assert scaler_numbers(written['scaler']) == {
        'scale': 1024.0, 'growth_factor': 2.0, 'backoff_factor': 0.5, 'growth_interval': 3, '_growth_tracker': 0}
    scaler._scale.div_(2)
    assert scaler_numbers(written['scaler']) == scaler.state_dict()
    for mine in (written['ranks'][0], run_state.in_host_memory(ranks[0])):
        assert list(mine) == list(expected) and len(mine['norm']) == len(mine['ema_norm']) == 2
        assert all(torch.equal(a, b) for key in ('norm', 'ema_norm') for a, b in zip(mine[key], expected[key]))
        assert torch.equal(mine['mean_loss'], expected['mean_loss'])


# -- the writer --------------------------------------------------------------------------------------------------------

def state_of(epoch: int):
    """What save() takes: a function that gives the checkpoint, as a trainer's holds it."""
    model = nn.Linear(2, 2)
    return lambda: {'epoch': epoch, 'model': model, 'ema': model, 'scaler': {}}


def epoch_of(path) -> int:
    return torch.load(path, weights_only=False)['epoch']


def test_the_checkpoint_it_replaces_stays_as_last_previous_and_what_comes_after_runs_once_it_is_in_place(tmp_path):
    last, lines, then = tmp_path / 'last.pt', [], []
    writer = Checkpoints(lines.append)
    assert writer.save(state_of(1), last, 'checkpoint at step 10')
    assert writer.save(state_of(2), last, 'checkpoint at step 20', then=[lambda: then.append(epoch_of(last))])
    writer.close()  # the first write ended before the second began
    assert not writer.busy and then == [2]
    assert (epoch_of(last), epoch_of(previous_path(last))) == (2, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ['last.previous.pt', 'last.pt'] and lines == []


class SlowDisk:
    """A checkpoint file writer that blocks until released; it records how many writes ever ran at once, and the
    epochs of those that ended, in order."""

    def __init__(self):
        self.release, self.lock, self.running, self.most_at_once = threading.Event(), threading.Lock(), 0, 0
        self.written = []

    def __call__(self, obj, path, keep_previous=False):
        with self.lock:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        self.release.wait(30)
        checkpoints.save_file(obj, path, keep_previous)
        with self.lock:
            self.running -= 1
            self.written.append(obj['epoch'])


def test_a_periodic_checkpoint_due_while_a_write_runs_is_skipped_with_one_line_and_any_other_waits(tmp_path):
    last, lines, disk = tmp_path / 'last.pt', [], SlowDisk()
    writer = Checkpoints(lines.append, save=disk)
    assert writer.save(state_of(1), last, 'checkpoint at step 10')  # returns while the write blocks
    assert not writer.save(lambda: pytest.fail('a skipped checkpoint was queued'), last, 'checkpoint at step 20',
                           skip_if_busy=True)
    assert len(lines) == 1 and SKIPPED.match(lines[0]), lines
    assert writer.busy and not last.exists()
    threading.Timer(0.5, disk.release.set).start()
    assert writer.save(state_of(3), last, 'checkpoint of epoch 2')  # an epoch's: after the write under way
    assert disk.written[:1] == [1], "the epoch's save returned before the write under way had ended"
    writer.close()
    assert (epoch_of(last), epoch_of(previous_path(last))) == (3, 1)
    assert disk.most_at_once == 1 and len(lines) == 1


def disk_full(obj, path, keep_previous=False):
    def partial(f):
        f.write(b'PK\x03\x04 partial')
        raise OSError(28, 'No space left on device')
    files.atomic_write(path, partial, keep_previous)


def test_a_failing_write_says_so_in_one_line_and_keeps_the_checkpoints_before_it(tmp_path):
    last, lines = tmp_path / 'last.pt', []
    writer = Checkpoints(lines.append)
    for epoch in (1, 2):
        writer.save(state_of(epoch), last, f'checkpoint at step {epoch}0')
    writer.save_file = disk_full
    assert writer.save(state_of(3), last, 'checkpoint at step 30', then=[lambda: pytest.fail('ran after a failure')])
    writer.wait()
    assert lines == [f'WARNING: checkpoint at step 30 could not be written to {last} (OSError: [Errno 28] No space '
                     f'left on device); training goes on, and a resume takes the checkpoint before it']
    assert (epoch_of(last), epoch_of(previous_path(last))) == (2, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ['last.previous.pt', 'last.pt']  # no temporary file left
    writer.save_file = checkpoints.save_file
    assert writer.save(state_of(4), last, 'checkpoint at step 40')  # the writer goes on working
    writer.close()
    assert (epoch_of(last), epoch_of(previous_path(last))) == (4, 2)


EXITS_WHILE_WRITING = '''
import sys, time, torch
from yolov9_ddp import checkpoints
def slow(obj, path, keep_previous=False):
    time.sleep(0.5)
    checkpoints.save_file(obj, path, keep_previous)
writer = checkpoints.Checkpoints(print, save=slow)
model = torch.nn.Linear(2, 2)
writer.save(lambda: {'epoch': 5, 'model': model, 'ema': model, 'scaler': {}}, sys.argv[1], 'checkpoint at step 50')
sys.exit(1)  # a failing rank: no wait(), no close()
'''


def test_a_write_under_way_when_the_process_exits_completes(tmp_path):
    last = tmp_path / 'last.pt'
    result = subprocess.run([sys.executable, '-c', EXITS_WHILE_WRITING, str(last)], cwd=KIT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1 and result.stdout == '', result.stderr
    assert epoch_of(last) == 5 and [p.name for p in tmp_path.iterdir()] == ['last.pt']


def checkpoint_state() -> dict:
    """training_state() as a trainer's checkpoint holds it (checkpoints.QueuedCheckpoint): channels-last models and
    the grad scaler's state."""
    state, _ = training_state()
    for key in ('model', 'ema'):
        state[key].to(memory_format=torch.channels_last)
    scaler = torch.amp.GradScaler('cpu', init_scale=1024.0)
    scaler._lazy_init_scale_growth_tracker(torch.device('cpu'))
    return {**state, 'scaler': scaler_state(scaler)}


def same_checkpoint(a: dict, b: dict) -> bool:
    """The same keys and values; the models' tensors equal, of the same type, layout and requires_grad."""
    def same(x, y):
        if isinstance(x, nn.Module):
            pairs = zip([*x.parameters(), *x.buffers()], [*y.parameters(), *y.buffers()])
            return type(x) is type(y) and all(type(p) is type(q) and p.stride() == q.stride() and torch.equal(p, q)
                                              and p.requires_grad == q.requires_grad for p, q in pairs)
        if isinstance(x, torch.Tensor):
            return torch.equal(x, y) and x.stride() == y.stride()
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(map(same, x, y))
        return x == y
    return same(a, b)


def with_process(lines: list) -> Checkpoints:
    writer = Checkpoints(lines.append, writer_process.WriterProcess(lines.append))
    writer.start_process()
    return writer


def child_killed_then(writer: Checkpoints, state: dict):
    """A make() for writer.save() that first SIGKILLs the writer's child, which then cannot write what it gets."""
    def make():
        writer.process.child.kill()
        writer.process.child.join()
        return state
    return make


def test_the_writer_process_writes_the_file_the_thread_would_and_says_so_in_one_line_where_it_fails_or_ends(
        tmp_path):
    """The child writes what the writer's thread writes (upstream's format: the scaler's numbers, the models
    contiguous); its error, or its end, costs that checkpoint only, in one line; a new child writes the next."""
    state, lines = checkpoint_state(), []
    last = tmp_path / 'last.pt'
    writer = with_process(lines)
    assert writer.save(lambda: state, last, 'checkpoint at step 10')
    writer.wait()
    checkpoints.save_file(QueuedCheckpoint(state)(), tmp_path / 'thread.pt')
    written = torch.load(last, weights_only=False)
    assert same_checkpoint(written, torch.load(tmp_path / 'thread.pt', weights_only=False)) and lines == []
    assert written['scaler']['scale'] == 1024.0 and written['model'][0].weight.is_contiguous()

    missing = tmp_path / 'missing' / 'last.pt'
    assert writer.save(lambda: state, missing, 'checkpoint at step 20')
    writer.wait()
    assert len(lines) == 1 and lines.pop().startswith(
        f'WARNING: checkpoint at step 20 could not be written to {missing} (FileNotFoundError: [Errno 2]')

    assert writer.save(child_killed_then(writer, {**state, 'epoch': 4}), last, 'checkpoint at step 30')
    writer.wait()
    assert lines == [f'WARNING: checkpoint at step 30 could not be written to {last} (WriterProcessEnded: the '
                     'checkpoint writer process ended (SIGKILL)); training goes on, and a resume takes the checkpoint '
                     'before it']
    assert writer.save(lambda: {**state, 'epoch': 5}, last, 'checkpoint at step 40')
    writer.close()
    assert lines[1:] == ['the checkpoint writer process had ended (SIGKILL): starting another']
    assert (epoch_of(last), epoch_of(previous_path(last))) == (5, 3)
    assert writer.process.child.exitcode == 0, 'close() ends the child: its last message'


def test_a_final_checkpoint_written_stripped_is_the_whole_one_stripped_and_the_writer_knows_it(tmp_path):
    """A run's last epoch writes its last.pt stripped at once (parts/epoch_end.py): the bytes of the whole checkpoint
    stripped, with no whole file to read back; the finish sees it from stripped_written (parts/finish.py)."""
    state, lines = checkpoint_state(), []
    whole, last = tmp_path / 'whole.pt', tmp_path / 'last.pt'
    writer = with_process(lines)
    assert writer.save(lambda: state, whole, 'checkpoint of epoch 2')
    writer.wait()
    assert writer.stripped_written is None
    assert writer.save(lambda: state, last, 'checkpoint of epoch 3', strip=True)
    writer.close()
    writer.strip(whole, tmp_path / 'stripped.pt')
    final = torch.load(last, weights_only=False)
    assert same_checkpoint(final, torch.load(tmp_path / 'stripped.pt', weights_only=False)) and lines == []
    assert writer.stripped_written == last and final['optimizer'] is None and final['epoch'] == -1


def test_the_writer_process_forked_ahead_ends_at_close_though_a_forked_worker_holds_its_pipe(tmp_path):
    """The trainer forks the child as it sets up, before the loader forks its workers, which then hold copies of the
    pipe's ends: close() must still end the child at once, having written what it was given. And a child ended by a
    signal without a name is still said in one line."""
    last, lines = tmp_path / 'last.pt', []
    writer = with_process(lines)
    child, deadline = writer.process.child, time.monotonic() + 10
    while Path(f'/proc/{child.pid}/comm').read_bytes().strip() != writer_process.NAME and time.monotonic() < deadline:
        time.sleep(0.01)
    assert Path(f'/proc/{child.pid}/comm').read_bytes().strip() == writer_process.NAME, 'what ps shows of it'
    worker = multiprocessing.get_context('fork').Process(target=time.sleep, args=(60,))
    worker.start()
    try:
        assert writer.save(checkpoint_state, last, 'checkpoint at step 10')
        started = time.monotonic()
        writer.close()
        assert time.monotonic() - started < 10 and child.exitcode == 0 and lines == []
        assert (writer.process.child is child) and epoch_of(last) == 3, 'one child, forked ahead, wrote the file'
    finally:
        worker.kill()
    assert writer_process.ending(-(signal.SIGRTMIN + 1)) == f'signal {signal.SIGRTMIN + 1}'


def test_the_writers_thread_takes_over_where_no_writer_process_starts_or_two_in_a_row_end_while_writing(
        tmp_path, monkeypatch):
    """Whatever keeps the child from writing (no fork, say for want of memory; children killed mid-write, say by a
    memory limit) must not cost every checkpoint. The thread writes them, after one line."""
    state, lines = checkpoint_state(), []
    last = tmp_path / 'last.pt'
    writer = with_process(lines)
    for step in (10, 20):
        assert writer.save(child_killed_then(writer, state), last, f'checkpoint at step {step}')
        writer.wait()
    assert writer.save(lambda: {**state, 'epoch': 5}, last, 'checkpoint at step 30')
    writer.close()
    assert [line.split(' (')[0] for line in lines[:3]] == [
        f'WARNING: checkpoint at step 10 could not be written to {last}',
        'the checkpoint writer process had ended',
        f'WARNING: checkpoint at step 20 could not be written to {last}']
    assert lines[3:] == ['WARNING: 2 checkpoint writer processes in a row ended while writing (the last: SIGKILL); '
                         "the writer's thread writes the checkpoints from now on"]
    assert writer.process is None and epoch_of(last) == 5, 'the thread wrote the third'

    def no_fork(self):
        raise BlockingIOError(11, 'Resource temporarily unavailable')
    monkeypatch.setattr(writer_process.WriterProcess, 'start', no_fork)
    lines.clear()
    writer = with_process(lines)
    assert writer.save(lambda: {**state, 'epoch': 6}, last, 'checkpoint at step 40')
    writer.close()
    assert lines == ['WARNING: the checkpoint writer process could not start (BlockingIOError: [Errno 11] Resource '
                     "temporarily unavailable); the writer's thread writes the checkpoints"]
    assert writer.process is None and epoch_of(last) == 6


KILLED_WHILE_ITS_CHILD_WRITES = '''
import os, signal, sys, torch
from yolov9_ddp import checkpoints, writer
checkpoints_ = checkpoints.Checkpoints(print, writer.WriterProcess(print))
checkpoints_.start_process()
model = torch.nn.Linear(200, 200)  # 160 kB: more than a pipe holds
def make():
    return {'epoch': 1, 'model': model, 'ema': model, 'scaler': {}}
checkpoints_.save(make, sys.argv[1], 'checkpoint at step 10')
checkpoints_.wait()
print(checkpoints_.process.child.pid, flush=True)
sys.stdin.readline()  # the test has made the child's next temporary file a pipe it holds
checkpoints_.save(make, sys.argv[1], 'checkpoint at step 20')
checkpoints_.wait()  # until the test kills this process
'''


def test_the_writer_process_dies_with_the_process_that_forked_it_even_mid_write(tmp_path):
    """A rank SIGKILLed while its writer process writes: the writer must not outlive it, to put a file in place after
    the restart has read the one before. The test holds the child's write open (its temporary file a named pipe).
    A SIGINT (Ctrl-C) or SIGTERM (Slurm signals every process of a job) does not end it: its rank decides."""
    last = tmp_path / 'last.pt'
    script = subprocess.Popen([sys.executable, '-c', KILLED_WHILE_ITS_CHILD_WRITES, str(last)], cwd=KIT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        child = int(script.stdout.readline())
        fifo = files.temporary_path(last).with_name(f'.last.pt.{child}.tmp')
        os.mkfifo(fifo)
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        script.stdin.write('go\n')
        script.stdin.flush()
        assert select.select([reader], [], [], 30)[0], 'the writer process did not start its write'
        for signum in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C's, Slurm's: the child leaves them to its rank
            os.kill(child, signum)
        time.sleep(0.5)
        assert alive(child), 'the writer process ended on SIGINT or SIGTERM'
        script.kill()  # with the child blocked in its write: the pipe is full, and nobody reads
        script.wait(30)
        assert gone_within(child, 10), 'the writer process outlived the process that forked it'
        os.close(reader)
    finally:
        script.kill()


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def alive(pid: int) -> bool:
    """Whether pid runs (a zombie, which a container's first process may never reap, does not)."""
    try:
        return Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()[0] != 'Z'
    except (OSError, IndexError):
        return False
