"""--cache ram keeps one decoded copy of the images per node (yolov9_ddp.ramcache), shared by every rank and every
loader worker, equal to upstream's own RAM cache bit for bit, and leaves nothing behind however the job ends."""
import multiprocessing
import os
import pickle
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from testsupport import faults, imagecache
from testsupport.jobs import run_probe, train_args
from yolov9_ddp import ramcache
from yolov9_ddp.demo_data import DemoSpec, ensure_demo_dataset

SPEC = DemoSpec(train=40, val=16, imgsz=96)  # larger than IMGSZ: upstream resizes (INTER_LINEAR / INTER_AREA)
IMGSZ = 64
VAL_BATCH_PER_RANK = 8  # the kit validates with twice the training batch per rank (4 here)


@pytest.fixture(scope='module')
def cache_data(tmp_path_factory) -> Path:
    return ensure_demo_dataset(tmp_path_factory.mktemp('ramcache') / 'data', SPEC, log=lambda msg: None)


def cache_args(data, project, *extra) -> list:
    """Two loader workers per rank asked for (one each on 2 cores), so workers share the cache too."""
    return train_args(data, project, 1, 8, IMGSZ, '--cache', 'ram', '--workers', 2, *extra)


@pytest.fixture(scope='module')
def probe_runs(patched_tree, cache_data, tmp_path_factory):
    """run(nproc, start_method): the ramcache probe's report of each rank of a job, each kind of job run once."""
    reports = {}

    def run(nproc, start_method=None):
        if (nproc, start_method) not in reports:
            folder = tmp_path_factory.mktemp(f'probe{nproc}{start_method or ""}')
            config = {'start_method': start_method} if start_method else {}
            ranks = run_probe(patched_tree, nproc, 'ramcache', folder / 'out.json',
                              cache_args(cache_data, folder / 'runs'), config, timeout=400)
            reports[nproc, start_method] = [rank['ramcache'] for rank in ranks]
        return reports[nproc, start_method]
    return run


@pytest.fixture(scope='module')
def upstream_digests(patched_tree, cache_data, upstream_importable):
    """Digests of upstream's own --cache ram images (its LoadImagesAndLabels, cache_images='ram', one process)."""
    from utils.dataloaders import LoadImagesAndLabels
    root = cache_data.parent
    datasets = {'train': LoadImagesAndLabels(str(root / 'images' / 'train'), IMGSZ, 4, augment=True,
                                             cache_images='ram'),
                'val': LoadImagesAndLabels(str(root / 'images' / 'val'), IMGSZ, VAL_BATCH_PER_RANK, rect=True,
                                           pad=0.5, stride=32, cache_images='ram')}
    return {name: imagecache.images_digest(d.ims, d.im_hw0, d.im_hw) for name, d in datasets.items()}


def job_pids(report) -> list:
    return [pid for rank in report for pid in [rank['pid'], *rank['workers']]]


# -- in a job --------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_local_rank_0_decodes_every_image_once_for_the_node(probe_runs):
    ranks = probe_runs(2)
    assert [r['decodes'] for r in ranks] == [SPEC.train + SPEC.val, 0]
    assert [r['decodes_after_setup'] for r in ranks] == [0, 0], 'loading a batch decoded an image again'
    assert all(r['images'] == {'train': 'SharedImages', 'val': 'SharedImages'} for r in ranks)


@pytest.mark.cores
def test_every_rank_sees_upstreams_ram_cache_bit_for_bit(probe_runs, upstream_digests):
    for rank in probe_runs(2):
        assert rank['digests'] == upstream_digests


@pytest.mark.slow
def test_the_node_holds_one_copy_with_two_ranks_as_with_one(probe_runs):
    one, two = probe_runs(1)[0]['node'], probe_runs(2)[0]['node']
    assert one['cache_files'] == two['cache_files'] == 2, 'one cache file each for the train and the val images'
    assert two['resident_bytes'] <= 1.1 * one['resident_bytes'], (one, two)
    pixels = (SPEC.train + SPEC.val) * IMGSZ * IMGSZ * 3
    assert pixels <= one['resident_bytes'] < pixels + 4 * 2 ** 16, one  # the images, an index and page rounding
    assert two['pss_bytes'] <= two['resident_bytes'], 'the mappings account for no more than the files hold'


@pytest.mark.slow
@pytest.mark.parametrize('start_method', ['fork', 'spawn', 'forkserver'])
def test_loader_workers_map_the_cache_whatever_starts_them(probe_runs, upstream_digests, start_method):
    """Workers started by spawn or forkserver (Python 3.14's default) receive the dataset pickled: they must open
    the node's cache, not receive a copy of its pixels."""
    report = probe_runs(2, None if start_method == 'fork' else start_method)
    node = report[0]['node']
    workers = [pid for rank in report for pid in rank['workers']]
    assert len(workers) >= 4, 'each rank has a train and a val loader worker'
    assert set(job_pids(report)) <= set(node['processes_mapping']), node
    assert node['cache_files'] == 2, node
    assert all(rank['digests'] == upstream_digests for rank in report)


def shm_entries() -> set:
    return set(os.listdir('/dev/shm'))


def left_in_shm(before: set) -> set:
    """What /dev/shm holds that it did not before, less torch's own per-batch segments (torch_PID_N_N): a loader
    worker that the kernel SIGKILLs with its rank between torch's shm_open and shm_unlink of one leaves it named.
    That is torch's, not the cache's; a named segment of the cache shows while the job runs (the test below)."""
    return {name for name in shm_entries() - before if not re.fullmatch(r'torch_\d+_\d+_\d+', name)}


def open_cache_files() -> set:
    """Every cache file any process of this machine holds open."""
    files = set()
    for entry in Path('/proc').iterdir():
        if entry.name.isdigit():
            files |= set(imagecache.cache_files(int(entry.name)))
    return files


def released(files: set, grace: float) -> bool:
    """Whether no process holds these files any more, within grace seconds (a killed process takes a moment to
    exit, its command line already gone)."""
    deadline = time.monotonic() + grace
    while files & open_cache_files():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@pytest.mark.slow
def test_nothing_of_the_cache_outlives_a_sigkilled_job(patched_tree, cache_data, tmp_path):
    """No named segment is ever made (nothing in /dev/shm to leak); the cache's memory goes with the processes."""
    before = shm_entries()
    args = cache_args(cache_data, tmp_path / 'runs', '--epochs', 3)
    job = faults.start_job(faults.faulty_torchrun(2, args), patched_tree, tmp_path, 'job', faults.MARK_SLOW)
    try:
        faults.wait_for_path(job.records / 'mark-mark', job)
        pids = imagecache.descendants(job.proc.pid)
        held = {f for pid in pids for f in imagecache.cache_files(pid)}
        assert len(held) == 2, imagecache.node_cache_report(pids)
        assert shm_entries() - before == set(), 'the cache made a named segment'
        for pid in pids:  # every process of the job, as a scheduler's cgroup kill (torchrun starts each rank in a
            os.kill(pid, signal.SIGKILL)  # process group of its own)
        job.wait(60)
    finally:
        faults.kill_processes_mentioning(job.marker)
    assert not faults.lingering(job.marker, grace=30)
    assert left_in_shm(before) == set()
    assert released(held, grace=30), 'a cache file of the job is still held'


@pytest.mark.slow
@pytest.mark.usefixtures('upstream_importable')  # the checks load checkpoints, which pickle upstream classes
def test_a_torchrun_restart_builds_the_cache_again_and_a_completed_job_leaves_nothing(patched_tree, cache_data,
                                                                                      tmp_path):
    before = shm_entries()
    outcome = faults.kill_scenario(patched_tree, cache_data, tmp_path, faults.KILL_FAULTS['mid-step'], max_restarts=1,
                                   extra=('--cache', 'ram', '--workers', 2))
    assert outcome.problems == [], outcome.describe()
    for count in (SPEC.train, SPEC.val):  # rank 0 logs each build: once per attempt
        assert outcome.output.count(f'Cached {count} images') == 2, outcome.describe()
    assert not faults.lingering(outcome.jobs[0].marker, grace=30)
    assert left_in_shm(before) == set()


# -- the cache file ------------------------------------------------------------------------------------------------

def sample_images():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, shape, dtype=np.uint8) for shape in [(5, 7, 3), (3, 4), (6, 2, 3)]]


def cached(images, key=b'k' * 32) -> ramcache.SharedImages:
    items = [(image, (image.shape[0] * 2, image.shape[1] * 2), image.shape[:2]) for image in images]
    return ramcache.SharedImages(ramcache.write_cache(items, len(items), key), key)


def test_the_cache_file_gives_back_each_image_read_only():
    images = sample_images()
    shared = cached(images)
    assert len(shared) == len(images)
    for original, view in zip(images, shared):
        assert view.shape == original.shape and np.array_equal(view, original)
        assert not view.flags.writeable and imagecache.points_into_cache(view)
    assert shared.original_hw() == [(10, 14), (6, 8), (12, 4)]
    assert shared.resized_hw() == [(5, 7), (3, 4), (6, 2)]
    with pytest.raises(ValueError):
        shared[0][0, 0, 0] = 1


def test_a_cache_of_another_dataset_is_refused():
    shared = cached(sample_images(), key=b'a' * 32)
    with pytest.raises(ramcache.CacheError, match='another dataset'):
        ramcache.open_shared(os.getpid(), shared.fd, key=b'b' * 32)


def test_only_8_bit_images_are_cached():
    with pytest.raises(ramcache.CacheError, match='8-bit'):
        ramcache.write_cache([(np.zeros((2, 2), np.float32), (2, 2), (2, 2))], 1, b'k' * 32)


def spawned_view(shared):
    """In a spawned process: what the unpickled cache holds, and whether it maps the file rather than a copy."""
    return ([np.array(image) for image in shared],
            all(imagecache.points_into_cache(image) for image in shared), os.getpid())


def test_pickling_sends_a_reference_and_a_spawned_process_maps_the_file():
    images = sample_images()
    shared = cached(images)
    assert len(pickle.dumps(shared)) < 200, 'the pixels went into the pickle'
    with multiprocessing.get_context('spawn').Pool(1) as pool:
        seen, mapped, pid = pool.apply(spawned_view, (shared,))
    assert pid != os.getpid() and mapped
    assert all(np.array_equal(a, b) for a, b in zip(seen, images))


class FakeDataset:
    """What share_images uses of upstream's LoadImagesAndLabels."""

    def __init__(self, images):
        self.images, self.img_size, self.augment = images, 8, True
        self.im_files = [f'{i}.jpg' for i in range(len(images))]
        self.shapes = np.array([(im.shape[1], im.shape[0]) for im in images])
        self.ims = [None] * len(images)

    def load_image(self, i):
        return self.images[i], self.images[i].shape[:2], self.images[i].shape[:2]


def test_a_node_short_of_memory_trains_without_the_cache(monkeypatch):
    """As upstream's check_cache_ram: images that do not fit in the available memory are not cached."""
    monkeypatch.setattr(ramcache, 'fits_in_memory', lambda needed: False)
    dataset, said = FakeDataset(sample_images()), []
    ramcache.share_images(dataset, 'train: ', said.append)
    assert dataset.ims == [None] * 3
    assert len(said) == 1 and 'not caching images' in said[0]


def test_a_single_process_fills_what_upstreams_cache_fills():
    images = [np.full((4, 6, 3), i, np.uint8) for i in range(3)]
    dataset = FakeDataset(images)
    ramcache.share_images(dataset, log=lambda msg: None)
    assert isinstance(dataset.ims, ramcache.SharedImages)
    assert all(np.array_equal(dataset.ims[i], images[i]) for i in range(3))
    assert dataset.im_hw0 == dataset.im_hw == [(4, 6)] * 3


def test_an_image_that_cannot_be_decoded_stops_with_one_message():
    class Unreadable(FakeDataset):
        def load_image(self, i):
            raise AssertionError(f'Image Not Found {self.im_files[i]}')  # what upstream's load_image says
    with pytest.raises(ramcache.CacheError, match='train: caching images failed: Image Not Found 0.jpg'):
        ramcache.share_images(Unreadable(sample_images()), 'train: ', log=lambda msg: None)
