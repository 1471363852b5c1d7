"""fetch_upstream.py and patchkit.upstream: a verified pinned tree into a new folder, git or PyPI wheels.

The wheels come from the test cache ($YOLOV9_DDP_CACHE/wheels, filled once by the pinned_upstream
fixture), so nothing is downloaded twice; git is kept off the network by offline_env.
"""
import subprocess
import sys

import pytest

from testsupport.trees import KIT, cache_dir, describe, file_lock, snapshot, upstream_problems
from patchkit.upstream import UpstreamError, check_provided_tree, download_wheels


def run_fetch(dest, *args, env):
    return subprocess.run([sys.executable, str(KIT / 'fetch_upstream.py'), str(dest), *args], capture_output=True,
                          text=True, env=env, cwd=str(KIT), timeout=300)


@pytest.fixture(scope='session')
def wheels():
    """The cache folder holding the two wheels (downloaded from PyPI only if the cache lacks them)."""
    folder = cache_dir() / 'wheels'
    with file_lock(cache_dir() / '.wheels.lock'):
        download_wheels(folder, log=lambda msg: None)
    return folder


def assert_clean_failure(result, program, *facts):
    """Exit 1, one line of cause first on stderr naming the facts, no traceback."""
    assert result.returncode == 1, describe(result)
    first = result.stderr.splitlines()[0]
    assert first.startswith(f'{program}: error: '), describe(result)
    for fact in facts:
        assert fact in first, f'{fact!r} not in the error line {first!r}'
    assert 'Traceback' not in result.stderr, describe(result)


def test_offline_env_blocks_the_network_but_not_loopback(offline_env, tmp_path):
    # The other offline tests rely on this: names do not resolve and remote connects fail, loopback works.
    code = '''
import socket, urllib.request
assert socket.NETWORK_BLOCKED_BY_YOLOV9_DDP_TESTS
for attempt in (lambda: socket.getaddrinfo('pypi.org', 443),
                lambda: socket.create_connection(('93.184.216.34', 80), timeout=5),
                lambda: socket.socket().connect_ex(('8.8.8.8', 53)),
                lambda: urllib.request.urlopen('https://ultralytics.com/assets/Arial.ttf', timeout=5)):
    try:
        attempt()
    except OSError as e:
        assert 'network blocked by the yolov9-ddp tests' in str(e), e
    else:
        raise SystemExit('a network call went through')
server = socket.create_server(('127.0.0.1', 0))
client = socket.create_connection(('localhost', server.getsockname()[1]), timeout=5)
client.close(); server.close()
print('blocked')
'''
    result = subprocess.run([sys.executable, '-c', code], env=offline_env, cwd=str(tmp_path), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == 'blocked', describe(result)


def test_fetch_from_pypi_wheels_gives_a_verified_tree(pin, wheels, offline_env, tmp_path):
    parent = tmp_path / 'out'  # does not exist yet: fetch_upstream.py creates DEST and its parents
    result = run_fetch(parent / 'upstream', '--source', 'pypi', '--wheels', wheels, env=offline_env)
    assert result.returncode == 0, describe(result)
    assert 'source: pypi' in result.stdout
    assert upstream_problems(parent / 'upstream', pin) == []
    assert all((parent / 'upstream' / path).is_file() for path in pin.touched)
    assert [p.name for p in parent.iterdir()] == ['upstream'], 'a temporary folder was left behind'


def test_fetch_refuses_an_existing_destination(wheels, offline_env, tmp_path):
    dest = tmp_path / 'upstream'
    dest.mkdir()
    (dest / 'mine.txt').write_text('keep me\n')
    before, siblings = snapshot(dest), sorted(tmp_path.iterdir())
    result = run_fetch(dest, '--source', 'pypi', '--wheels', wheels, env=offline_env)
    assert_clean_failure(result, 'fetch_upstream.py', str(dest), 'already exists')
    assert snapshot(dest) == before
    assert sorted(tmp_path.iterdir()) == siblings


def test_fetch_with_git_offline_fails_cleanly_and_leaves_nothing(offline_env, tmp_path):
    parent = tmp_path / 'out'
    parent.mkdir()
    result = run_fetch(parent / 'upstream', '--source', 'git', env=offline_env)
    assert_clean_failure(result, 'fetch_upstream.py', 'git')
    assert len(result.stderr.strip().splitlines()) == 1, describe(result)
    assert list(parent.iterdir()) == [], 'the destination or a temporary folder was left behind'


def test_fetch_auto_falls_back_to_pypi_when_git_is_offline(pin, wheels, offline_env, tmp_path):
    parent = tmp_path / 'out'
    parent.mkdir()
    result = run_fetch(parent / 'upstream', '--wheels', wheels, env=offline_env)
    assert result.returncode == 0, describe(result)
    assert 'git did not work' in result.stdout and 'trying the next source' in result.stdout, describe(result)
    assert 'source: pypi' in result.stdout
    assert upstream_problems(parent / 'upstream', pin) == []
    assert [p.name for p in parent.iterdir()] == ['upstream'], 'a temporary folder was left behind'


def absent_files(root, pin) -> list:
    return [path for path in pin.all_blobs if not (root / path).is_file()]


def test_the_tree_check_catches_a_one_byte_change(pin, pristine_tree):
    path = 'models/yolo.py'
    check_provided_tree(pin, pristine_tree, absent_files(pristine_tree, pin))
    data = bytearray((pristine_tree / path).read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one byte
    (pristine_tree / path).write_bytes(bytes(data))
    with pytest.raises(UpstreamError, match=r'^files that do not match the pin \(1\): models/yolo.py$'):
        check_provided_tree(pin, pristine_tree, absent_files(pristine_tree, pin))


def test_the_tree_check_requires_every_touched_file_even_one_called_unavailable(pin, pristine_tree):
    (pristine_tree / 'utils' / 'metrics.py').unlink()
    with pytest.raises(UpstreamError, match=r'^files that do not match the pin \(1\): utils/metrics.py$'):
        check_provided_tree(pin, pristine_tree, absent_files(pristine_tree, pin))
