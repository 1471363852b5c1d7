"""The shared image cache of --cache ram (yolov9_ddp.ramcache) seen from outside: the images it holds, and what it
costs the node, read from /proc: which processes of a job map it, the PSS of their mappings, and the memory its
files hold (each file counted once)."""
import hashlib
import json
import os
from pathlib import Path

from yolov9_ddp.ramcache import MEMFD_NAME

CACHE_LINK = f'/memfd:{MEMFD_NAME}'  # what /proc/PID/fd/N links to and /proc/PID/maps names, '(deleted)' after it


def parent_of(pid: int) -> int:
    """The pid of a process's parent; -1 if the process has ended."""
    try:
        stat = Path(f'/proc/{pid}/stat').read_text()
        return int(stat[stat.rindex(')') + 2:].split()[1])  # the name in parentheses may hold spaces
    except (OSError, ValueError, IndexError):
        return -1


def descendants(root: int) -> list:
    """root and every process below it (a job's launcher, its ranks and their loader workers)."""
    children = {}
    for entry in Path('/proc').iterdir():
        if entry.name.isdigit():
            children.setdefault(parent_of(int(entry.name)), []).append(int(entry.name))  # -1: ended meanwhile
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return sorted(found)


def cache_files(pid: int) -> dict:
    """{(device, inode): bytes held in memory} of the cache files this process has open."""
    files = {}
    try:
        fds = list(Path(f'/proc/{pid}/fd').iterdir())
    except OSError:
        return files
    for fd in fds:
        try:
            if os.readlink(fd).startswith(CACHE_LINK):
                st = os.stat(fd)
                files[(st.st_dev, st.st_ino)] = st.st_blocks * 512
        except OSError:
            continue
    return files


def cache_pss(pid: int) -> int:
    """Bytes of PSS in this process's mappings of cache files (a page mapped by k processes counts 1/k in each)."""
    total, in_cache = 0, False
    try:
        lines = Path(f'/proc/{pid}/smaps').read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        field = line.split()
        if not field[0].endswith(':'):  # a mapping's header line: address range, perms, offset, dev, inode, path
            in_cache = len(field) > 5 and field[5].startswith(CACHE_LINK)
        elif in_cache and field[0] == 'Pss:':
            total += int(field[1]) * 1024
    return total


def maps_cache(pid: int) -> bool:
    try:
        return CACHE_LINK in Path(f'/proc/{pid}/maps').read_text()
    except OSError:
        return False


def node_cache_report(pids) -> dict:
    """What the cache costs the node across these processes: its files' memory (each file once), the PSS of its
    mappings summed over the processes, and which processes map it."""
    files = {}
    for pid in pids:
        files.update(cache_files(pid))
    return {'cache_files': len(files), 'resident_bytes': sum(files.values()),
            'pss_bytes': sum(cache_pss(pid) for pid in pids), 'processes': len(list(pids)),
            'processes_mapping': [pid for pid in pids if maps_cache(pid)]}


def cache_ranges(pid='self') -> list:
    """(start, end) address ranges of this process's mappings of cache files."""
    ranges = []
    for line in Path(f'/proc/{pid}/maps').read_text().splitlines():
        if CACHE_LINK in line:
            start, end = line.split()[0].split('-')
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


def points_into_cache(array) -> bool:
    """Whether the array's pixels lie in this process's mapping of a cache file (a view, not a copy)."""
    address = array.ctypes.data
    return any(start <= address and address + array.nbytes <= end for start, end in cache_ranges())


def images_digest(images, original_hw, resized_hw) -> str:
    """sha256 of every image (shape and bytes) with its original and resized size, in order: upstream's ims, im_hw0
    and im_hw after --cache ram, or the kit's shared cache in their place."""
    digest = hashlib.sha256()
    for image, hw0, hw in zip(images, original_hw, resized_hw, strict=True):
        digest.update(json.dumps([list(image.shape), list(hw0), list(hw)]).encode())
        digest.update(image.tobytes())
    return digest.hexdigest()
