"""--cache ram: one decoded copy of the images per node, shared by every rank and every loader worker.

Upstream's --cache ram keeps a copy in every rank (yolov5#3818, ultralytics#22307), and one more in every loader
worker started by spawn or forkserver. Here the node's local rank 0 decodes the images once, with upstream's
load_image (the pixels are upstream's), into an anonymous memory file (memfd_create) that the node's other processes
map read-only, through /proc/PID/fd/FD of a process holding it; a pickled cache sends that reference, never pixels.
The file has no name, so nothing can leak: the kernel frees it when its last holder ends, SIGKILL included.

File layout: the images' bytes one after another; an index (one int64 row per image: offset, height, width,
channels, original height, original width); a trailer naming the dataset it was built for and the index's place.
"""
import hashlib
import json
import mmap
import os
import socket
import struct
import weakref
from collections.abc import Sequence
from multiprocessing.pool import ThreadPool

import numpy as np
import psutil

from yolov9_ddp import comm

MEMFD_NAME = 'yolov9-ddp-cache'  # how the file shows in /proc/PID/maps and /proc/PID/fd (tests measure it so)
MAGIC = b'YV9CACHE'
TRAILER = struct.Struct('<8s32sqq')  # magic, dataset key, number of images, offset of the index
INDEX_COLUMNS = 6  # offset, height, width, channels (0: a 2-D image), original height, original width
SAFETY_MARGIN = 0.1  # as upstream's check_cache_ram: cache only if the images fit in 90% of the available memory


class CacheError(Exception):
    """The shared cache cannot be built or opened; the message says why."""


def dataset_key(dataset) -> bytes:
    """What the decoded pixels depend on: the files in the dataset's order, the size and the resize method
    (upstream resizes with INTER_AREA for validation and INTER_LINEAR for training)."""
    text = json.dumps([list(dataset.im_files), int(dataset.img_size), bool(dataset.augment)])
    return hashlib.sha256(text.encode()).digest()


def estimated_bytes(dataset) -> int:
    """The cache's size from the image sizes the label cache recorded (as upstream's load_image resizes them)."""
    total = 0
    for w0, h0 in dataset.shapes:
        ratio = dataset.img_size / max(h0, w0)
        total += int(h0 * ratio) * int(w0 * ratio) * 3
    return total


def fits_in_memory(needed: int) -> bool:
    return needed * (1 + SAFETY_MARGIN) < psutil.virtual_memory().available


def node_id() -> str:
    """The node this process runs on: torchrun's GROUP_RANK tells apart two agents on one machine."""
    return f'{socket.gethostname()}/{os.environ.get("GROUP_RANK", "0")}'


# -- the file --------------------------------------------------------------------------------------------------------

def write_all(fd: int, data, offset: int) -> int:
    """os.pwrite until every byte is written; returns the offset after them."""
    view = memoryview(data).cast('B')
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
    return offset


def write_cache(images, count: int, key: bytes) -> int:
    """A new memory file holding `count` (image, original hw, resized hw) of the iterable, with index and trailer.

    Returns its descriptor; the caller's process keeps it open for as long as others may open the file."""
    fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
    try:
        index, offset = np.zeros((count, INDEX_COLUMNS), np.int64), 0
        for i, (image, (h0, w0), _) in enumerate(images):
            if image.dtype != np.uint8 or image.ndim not in (2, 3):
                raise CacheError(f'image {i} is {image.dtype} of shape {image.shape}; the cache holds 8-bit images')
            image = np.ascontiguousarray(image)
            h, w, c = image.shape if image.ndim == 3 else (*image.shape, 0)
            index[i] = offset, h, w, c, h0, w0
            offset = write_all(fd, image, offset)
        end = write_all(fd, index, offset)
        write_all(fd, TRAILER.pack(MAGIC, key, count, offset), end)
    except BaseException:
        os.close(fd)
        raise
    return fd


class SharedImages(Sequence):
    """The cached images as read-only arrays viewing the shared file (no copy); a drop-in for upstream's self.ims.

    Pickled (a loader worker started with spawn or forkserver), it sends only where to open the file again."""

    def __init__(self, fd: int, key: bytes = None):
        self.fd = fd
        self.owner = os.getpid()
        weakref.finalize(self, os.close, fd)
        self.map = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        magic, found_key, count, index_offset = TRAILER.unpack(self.map[-TRAILER.size:])
        if magic != MAGIC or (key is not None and found_key != key):
            raise CacheError('the shared image cache was built for another dataset')
        self.index = np.frombuffer(self.map, np.int64, count * INDEX_COLUMNS, index_offset).reshape(count, -1)

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        offset, h, w, c = (int(x) for x in self.index[i, :4])
        shape = (h, w, c) if c else (h, w)
        return np.frombuffer(self.map, np.uint8, h * w * max(c, 1), offset).reshape(shape)

    def original_hw(self) -> list:
        return [(int(h0), int(w0)) for h0, w0 in self.index[:, 4:6]]

    def resized_hw(self) -> list:
        return [(int(h), int(w)) for h, w in self.index[:, 1:3]]

    def __reduce__(self):
        return open_shared, (self.owner, self.fd)


def open_shared(pid: int, fd: int, key: bytes = None) -> SharedImages:
    """Map the cache that process pid holds as descriptor fd (read-only, a descriptor of this process's own)."""
    try:
        own = os.open(f'/proc/{pid}/fd/{fd}', os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise CacheError(f'cannot open the shared image cache of process {pid} ({e})') from e
    return SharedImages(own, key)


# -- sharing it across the node ----------------------------------------------------------------------------------------

def decode_all(dataset, threads: int):
    """Upstream's own decode and resize of every image, in order, `threads` at a time."""
    with ThreadPool(threads) as pool:
        yield from pool.imap(dataset.load_image, range(len(dataset.im_files)))


def build_for_node(dataset, key: bytes, threads: int, prefix: str, log):
    """Local rank 0: (pid, fd) of a new cache of the dataset's images, or None if the node lacks the memory."""
    needed = estimated_bytes(dataset)
    if not fits_in_memory(needed):
        available = psutil.virtual_memory().available
        log(f'{prefix}{needed / 2 ** 30:.1f}GB RAM required, {available / 2 ** 30:.1f}GB available, '
            f'not caching images')
        return None
    fd = write_cache(decode_all(dataset, threads), len(dataset.im_files), key)
    return os.getpid(), fd


def use_cache(dataset, images: SharedImages):
    dataset.ims, dataset.im_hw0, dataset.im_hw = images, images.original_hw(), images.resized_hw()


def share_images(dataset, prefix='', log=print, threads=8):
    """Fill dataset.ims, im_hw0 and im_hw (what upstream's cache_images='ram' fills) from one cache per node.

    Every rank calls it: local rank 0 builds its node's cache, then every rank maps its node's. A failure on any
    rank stops all of them together (comm.raise_if_any_failed)."""
    key, builder, error = dataset_key(dataset), None, None
    if comm.get_local_rank() == 0:
        try:
            builder = build_for_node(dataset, key, threads, prefix, log)
        except Exception as e:  # e.g. upstream's load_image asserting a file it cannot read; raised on every rank below
            error = CacheError(f'{prefix}caching images failed: {e}')
    comm.raise_if_any_failed(error)
    handles = {node: handle for node, local_rank, handle in
               comm.all_gather_object((node_id(), comm.get_local_rank(), builder)) if local_rank == 0}
    handle, images = handles[node_id()], None
    if handle is not None:
        try:
            images = SharedImages(handle[1], key) if comm.get_local_rank() == 0 else open_shared(*handle, key)
        except Exception as e:  # raised on every rank together below
            error = e if isinstance(e, CacheError) else CacheError(f'{prefix}cannot map the shared image cache: {e}')
    comm.raise_if_any_failed(error)
    if images is not None:
        use_cache(dataset, images)
        log(f'{prefix}Cached {len(images)} images ({images.map.size() / 2 ** 30:.2f}GB) once for this node, '
            f'shared by its {comm.get_local_world_size()} process(es) and their loader workers')
