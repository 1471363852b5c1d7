"""The same run, every time (yolov9_ddp.stream and yolov9_ddp.state). With --deterministic, the weights
an uninterrupted 2-process run ends with (model, EMA and optimizer state, compared bit for bit) are those of the
same run
  - stopped by SIGTERM three times, at steps inside epochs, and resumed each time (--save-on-signal, --resume);
  - loaded by 2 loader workers instead of none, with one rank SIGKILLed and both restarted by torchrun from the
    newest periodic checkpoint (--checkpoint-steps), at its step;
and a run of global batch 12 stopped on 2 processes, continued on 3 and stopped again, then finished on 2, trains
every image of each epoch exactly once (recorded per rank by testsupport/probes/recording_train.py), and a torchrun
elastic job (--nnodes 1:2) that loses an agent goes on with the one left. Every other entry point ends a run that
was SIGKILLed, restarted, stopped inside an epoch and resumed bit-identical to its uninterrupted run:
tests/test_tasks.py.
Bit-identity across world sizes is not claimed: the order of the sums of an all-reduce changes with it."""
import json
import os
import re
import signal
import socket
from collections import Counter
from pathlib import Path

import pytest
import yaml

from testsupport.faults import (FAULTY, Job, children_of, completed_run_problems, differences, final_state, node_cmd,
                               refusal_problems, results_epochs, start_job, wait_until, weights_snapshot)
from testsupport.jobs import NEW_INTERPRETERS, free_port, torchrun_cmd, train_args
from testsupport.injected import Fault
from yolov9_ddp import writer
from yolov9_ddp.demo_data import DemoSpec, ensure_demo_dataset

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures('upstream_importable'), pytest.mark.slow]
EPOCHS, BATCH, IMAGES = 2, 8, 40  # 5 global batches an epoch
AUTOBATCH_ON_CPU = 16  # upstream's autobatch() on a CPU model: its default batch
DEADLINE_S = 180  # a job of this module takes 15 to 40 s on 2 cores
RECORDING = Path(__file__).resolve().parents[1] / 'testsupport' / 'probes' / 'recording_train.py'


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    return ensure_demo_dataset(tmp_path_factory.mktemp('data') / 'same-run', DemoSpec(train=IMAGES, val=8, imgsz=64))


def args(data, project, *extra, batch=BATCH, cfg=None):
    models = {'cfg': cfg} if cfg else {}
    return train_args(data, project, EPOCHS, batch, 64, '--noval', '--deterministic', '--save-period', 1, *extra,
                      **models)


def launch(tree, workdir, name, nproc, script_args, max_restarts=0, script='ddp_train_dual.py', fault=(),
           **env) -> Job:
    cmd = torchrun_cmd(nproc, '--max-restarts', max_restarts, script, *script_args)
    return start_job(cmd, tree, workdir, name, fault, **env)


def finished(job: Job) -> str:
    assert job.wait(DEADLINE_S) == 0, job.output()[-4000:]
    return job.output()


def saved_position(run_dir: Path) -> list:
    try:
        return json.loads((run_dir / 'run.json').read_text()).get('saved_position') or [0, 0]
    except (OSError, ValueError):  # not written yet
        return [0, 0]


def when_saved(job: Job, run_dir: Path, at_least: list, act):
    """act() once run.json records a checkpoint at or past at_least = [epoch, step]."""
    wait_until(lambda: saved_position(run_dir) >= at_least, f'a checkpoint at {at_least}', job, DEADLINE_S)
    act()


def held(epoch: int, step: int, ranks=range(2)) -> list:
    """The faults (faulty_train.py) that hold those ranks before training step `step` of `epoch` until they are asked
    to stop or killed, so that a stop or a kill comes right there. (A SIGTERM sent once run.json records a step can
    come 1 to 4 steps later on a loaded machine, and the next start would then find that position recorded and be
    signalled before it has begun.)"""
    return [Fault('hold', rank=rank, epoch=epoch, step=step, sleep=DEADLINE_S) for rank in ranks]


def stopped(job: Job, nproc=2) -> str:
    """SIGTERM to torchrun once every rank holds (a job started with the faults of held()); it must stop with a
    resumable checkpoint."""
    wait_until(lambda: len(job.events('fired')) >= nproc, f'its {nproc} ranks to hold', job, DEADLINE_S)
    os.kill(job.proc.pid, signal.SIGTERM)
    job.wait(DEADLINE_S)
    assert 'resumable checkpoint written to' in job.output(), job.output()[-4000:]
    return job.output()


def resumed_at(output: str, steps=5) -> list:
    return [(int(e), int(s)) for e, s in re.findall(rf'resuming epoch (\d+) at step (\d+) of {steps} from', output)]


@pytest.fixture(scope='module')
def reference(patched_tree, data, tmp_path_factory):
    workdir = tmp_path_factory.mktemp('reference')
    finished(launch(patched_tree, workdir, 'reference', 2, args(data, workdir / 'runs')))
    return final_state(workdir / 'runs' / 'exp', EPOCHS)


def test_a_run_stopped_three_times_mid_epoch_ends_bit_identical(patched_tree, data, reference, tmp_path):
    project, resumes = tmp_path / 'runs', []
    run_dir = project / 'exp'
    stopped(launch(patched_tree, tmp_path, 'start', 2, args(data, project, '--save-on-signal', '--checkpoint-steps', 1),
                   script=FAULTY, fault=held(0, 1)))
    for n, hold in enumerate(((0, 3), (1, 2), None)):
        resume = ['--resume', run_dir / 'weights' / 'last.pt', '--checkpoint-steps', 1]
        job = launch(patched_tree, tmp_path, f'resume{n}', 2, resume, script=FAULTY, fault=held(*hold) if hold else ())
        output = stopped(job) if hold else finished(job)
        resumes += resumed_at(output)
    assert resumes == [(0, 2), (0, 4), (1, 3)]  # each after the step its ranks held at, inside an epoch
    assert differences(final_state(run_dir, EPOCHS), reference) == []


def test_a_sigkilled_rank_restarts_from_its_periodic_checkpoint_bit_identical_with_loader_workers(
        patched_tree, data, reference, tmp_path):
    """Rank 1 is held before step 2 of epoch 1 and killed once the checkpoint after step 1 is recorded: the restart
    resumes there. Also: 2 loader workers per rank draw the augmentations of none (each sample seeds itself), and
    rank 0's periodic checkpoints are written by its writer process, which rank 0
    gives 3 s for the checkpoint after step 0 before it takes step 1: a write still running would make the one after
    step 1 skipped, and nothing would write it while rank 1 holds."""
    project = tmp_path / 'runs'
    job = launch(patched_tree, tmp_path, 'killed', 2, args(data, project, '--checkpoint-steps', 1, '--workers', 2),
                 max_restarts=1, script=FAULTY,
                 fault=[*held(1, 2, ranks=[1]), Fault('slow', rank=0, epoch=1, step=1, sleep=3)],
                 **NEW_INTERPRETERS)
    writers = []

    def kill_rank_1():
        writers.extend(writer_processes_of(workers_of(job, rank=0)[0]))
        os.kill(workers_of(job, rank=1)[0], signal.SIGKILL)
    when_saved(job, project / 'exp', [1, 2], kill_rank_1)
    output = finished(job)
    assert resumed_at(output) == [(1, 2)], output[-3000:]
    assert len(writers) == 1, 'rank 0 had no writer process'
    assert differences(final_state(project / 'exp', EPOCHS), reference) == []


def writer_processes_of(pid: int) -> list:
    """The checkpoint writer processes (yolov9_ddp/writer.py) that pid forked, by the name they give themselves."""
    def name(child):
        try:
            return Path(f'/proc/{child}/comm').read_bytes().strip()
        except OSError:
            return b''
    return [child for child in children_of(pid) if name(child) == writer.NAME]


def workers_of(job: Job, rank=None) -> list:
    """The training processes of the job's torchrun agent, or the one of that global rank (faults.children_of)."""
    pids = children_of(job.proc.pid, None if rank is None else f'RANK={rank}')
    assert pids, f'no training process{"" if rank is None else f" of rank {rank}"} under torchrun {job.proc.pid}'
    return pids


@pytest.mark.timed  # the agents' rendezvous and keep-alive timeouts
def test_an_elastic_job_that_loses_an_agent_goes_on_with_the_one_left(patched_tree, data, tmp_path):
    """torchrun --nnodes 1:2 with two agents of one process each; inside epoch 1 the second agent and its process
    are SIGKILLed (a lost node), its process held before step 2 (the checkpoint after step 1 recorded; rank 0 waits
    before step 1 for the write of the one before, which would make that one skipped). The first
    one's process fails in a collective, its agent forms the job again on its own, and the run goes on from that
    checkpoint, at its step, on 1 process, to the end."""
    project, endpoint = tmp_path / 'runs', f'127.0.0.1:{free_port()}'
    # A lost agent is noticed within seconds, not torchrun's 30+. The last call waits 10 s for the second agent
    # (with 2 s on a loaded machine the first agent can begin alone, then restart to take the late one in, and that
    # second rendezvous of both hangs in torch's role exchange until its 60 s timeout).
    rendezvous = ['--max-restarts', 1, '--rdzv-conf',
                  'join_timeout=60,last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3']
    script = [FAULTY, *args(data, project, '--checkpoint-steps', 1)]
    settled = Fault('slow', rank=0, epoch=1, step=1)  # rank 0's write of the checkpoint after step 0 ends first
    agents = []
    for n in range(2):  # the first agent hosts the rendezvous store; the one lost must not be it (whatever its rank)
        agents.append(start_job(node_cmd('1:2', endpoint, f'elastic-{endpoint}', *rendezvous, *script),
                                patched_tree, tmp_path, f'agent{n}', [settled, *(held(1, 2) if n else [])]))
        wait_for_store(endpoint, agents[0])
    when_saved(agents[0], project / 'exp', [1, 2], lambda: lose(agents[1]))
    output = finished(agents[0])
    assert resumed_at(output) == [(1, 2)], output[-3000:]
    assert 'the run continues on 1 process(es) instead of 2' in output, output[-3000:]
    assert completed_run_problems(project, EPOCHS) == []


def wait_for_store(endpoint: str, host: Job):
    wait_until(lambda: accepts_connections(endpoint), f'the rendezvous store at {endpoint}', host, DEADLINE_S)


def accepts_connections(endpoint: str) -> bool:
    host_name, port = endpoint.rsplit(':', 1)
    try:
        socket.create_connection((host_name, int(port)), 1).close()
        return True
    except OSError:
        return False


def lose(agent: Job):
    """A node lost: its training process and its agent SIGKILLed, the process first (else the agent stops it)."""
    for pid in [*workers_of(agent), agent.proc.pid]:
        os.kill(pid, signal.SIGKILL)
    agent.proc.wait()


@pytest.mark.parametrize('order', ['shuffled', '--rect'])
def test_a_run_continues_on_3_processes_and_on_2_again_training_every_image_once_per_epoch(patched_tree, data,
                                                                                           tmp_path, order):
    """Global batch 12: 4 images a rank on 3 processes, 6 on 2; 40 = 3 x 12 + 4 images, no repeat on 2 or 3. Each
    start is `torchrun --nproc_per_node W ddp_train_dual.py --resume last.pt`, nothing else: the run's own batch,
    device, data and epochs (opt.yaml). 5 processes cannot split 12 images and are refused before anything is
    written (shown with the shuffled stream only: the refusal comes before any batch is drawn). With --rect
    (upstream's fixed batches, in the dataset's order) as with the shuffled stream: each global batch is split over
    the ranks (contiguous runs of per-rank batches, 10 batches of 4 split 3, 3 and 4, would abort in a collective)."""
    project, records = tmp_path / 'runs', tmp_path / 'records'
    records.mkdir()
    run_dir, last = project / 'exp', project / 'exp' / 'weights' / 'last.pt'
    common = dict(script=str(RECORDING), RECORD_DIR=records)
    rect = [order] if order == '--rect' else []
    stopped(launch(patched_tree, tmp_path, 'two', 2, args(data, project, '--save-on-signal', '--checkpoint-steps', 1,
                                                           *rect, batch=12), fault=held(0, 1), **common))

    if not rect:  # the refusal comes before any batch is drawn: one order shows it
        before, rows, options = weights_snapshot(run_dir), results_epochs(run_dir), (run_dir / 'opt.yaml').read_text()
        five = launch(patched_tree, tmp_path, 'five', 5, ['--resume', last])
        five.wait(DEADLINE_S)
        assert not refusal_problems(five, run_dir, before, rows, 'global batch 12 cannot be split over 5 processes; '
                                    'it can over 1, 2, 3, 4, 6 or 12'), five.output()[-4000:]
        assert (run_dir / 'opt.yaml').read_text() == options

    three = launch(patched_tree, tmp_path, 'three', 3, ['--resume', last], fault=held(1, 1, range(3)), **common)
    three = stopped(three, 3)
    two = finished(launch(patched_tree, tmp_path, 'two-again', 2, ['--resume', last], **common))
    assert '3 process(es), batch 12 (4 per process)' in three, three[-4000:]
    assert three.count('the run continues on 3 process(es) instead of 2: BatchNorm statistics now come from 4 images '
                       'per process, not 6') == 1, three[-4000:]
    assert 'the run continues on 2 process(es) instead of 3' in two
    for output in (three, two):
        assert len(re.findall(r'resuming epoch \d+ at step \d+ of 4 from', output)) == 1, output[-3000:]
        assert 'generating demo dataset' not in output  # --resume without --data: the run's data
    assert completed_run_problems(project, EPOCHS) == []
    keys = [tuple(map(int, line.split())) for f in records.iterdir() for line in f.read_text().splitlines()]
    assert {f.name.split('-')[0] for f in records.iterdir()} == {'rank0', 'rank1', 'rank2'}
    for epoch in range(EPOCHS):
        counts = Counter(image for e, _, image in keys if e == epoch)
        assert sorted(counts) == list(range(IMAGES)) and set(counts.values()) == {1}, (epoch, counts)


def test_image_weights_draw_the_same_images_with_loader_workers_as_without(patched_tree, data, tmp_path):
    """--image-weights (one process): the training process draws each epoch's images by their weights (upstream's
    dataset.indices); loader workers that lived across epochs would keep the draw of the epoch they started in. With
    2 workers the run trains the images it trains with none, epoch by epoch. Its jobs, one process forked by the test
    launcher with loader workers, would hang at the first batch without forked.release_libuv_signal_pipe.
    Also: --batch-size -1 (AutoBatch, one process) trains at the batch it chooses (on CPUs upstream's default, 16)
    and records it as the run's batch in opt.yaml, so that a resume keeps it rather than sizing again."""
    trained = {}
    for workers in (0, 2):
        records, project = tmp_path / f'records-{workers}', tmp_path / f'runs-{workers}'
        records.mkdir()
        output = finished(launch(patched_tree, tmp_path, f'workers-{workers}', 1, args(
            data, project, '--image-weights', '--workers', workers, batch=-1), script=str(RECORDING),
            RECORD_DIR=records))
        assert f'using default CPU batch-size {AUTOBATCH_ON_CPU}' in output, output[-3000:]
        assert yaml.safe_load((project / 'exp' / 'opt.yaml').read_text())['batch_size'] == AUTOBATCH_ON_CPU
        trained[workers] = sorted(tuple(map(int, line.split())) for f in records.iterdir()
                                  for line in f.read_text().splitlines())
    assert {epoch for epoch, _, _ in trained[0]} == set(range(EPOCHS))
    assert trained[2] == trained[0], 'with 2 workers other images were trained than with none'
