"""A process that imported torch, torchvision and more once (forked.PRELOADED) and forks the tests' Python jobs
(testsupport/forked.py says what a forked process is made): a launcher (testsupport/torchrun.py) or a one-process
job starts in a tenth of a second instead of six. Each process that runs tests starts one on first use per start-up
environment (the environment less the variables read at run time only: the jobs' of testsupport.jobs, and the
offline runs' of upstream's scripts, whose network block is imported at start-up), at most MAX_ZYGOTES; popen() and
run() are subprocess's for the commands a zygote can fork, and subprocess's own for the others.

A forked job is the zygote's child, not the test's: the zygote reaps it and sends its exit status over the
connection the test asked on. `python zygote.py SOCKET PADDING` serves until its parent is gone; PADDING makes its
command line as long as the longest a job shows."""
import atexit
import json
import locale
import os
import select
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

ROOM = 16384  # characters of command line a forked job can show (forked.show_command_line)
MAX_ZYGOTES = 3  # per process that runs tests: each holds forked.PRELOADED in memory (about 0.5 GB)
_started = {}  # this process's zygotes by start-up environment (zygote() says what each holds)


class Lines:
    """The JSON messages of a connection, one per line."""

    def __init__(self, connection):
        self.connection, self.buffer = connection, b''

    def ready(self, timeout) -> bool:
        return b'\n' in self.buffer or bool(select.select([self.connection], [], [], timeout)[0])

    def next(self) -> dict:
        while b'\n' not in self.buffer:
            chunk = self.connection.recv(4096)
            if not chunk:
                raise ConnectionError('the zygote closed the connection')
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b'\n')
        return json.loads(line)


# -- the tests' side ---------------------------------------------------------------------------------------------------

def start_up_environment(env: dict) -> tuple:
    from testsupport import forked
    return tuple(sorted((name, value) for name, value in env.items() if not forked.read_at_run_time(name)))


def zygote(env: dict):
    """This process's zygote for env (the base environment of the jobs), started unless running: {'process',
    'socket', 'env': its environment once forked.PRELOADED was imported, 'preloaded': what their import
    added to it}; None where MAX_ZYGOTES run already."""
    key = start_up_environment(env)
    started = _started.get(key)
    if started is None or started['process'].poll() is not None:
        if started is None and len(_started) >= MAX_ZYGOTES:
            return None
        path = Path(tempfile.mkdtemp(prefix='yolov9-ddp-zygote-')) / 'socket'
        process = subprocess.Popen([sys.executable, __file__, path, 'x' * ROOM], env=env, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE)
        ready = process.stdout.readline()
        assert ready.startswith(b'{'), f'the zygote did not start: {ready!r}'
        atexit.register(shutil.rmtree, path.parent, True)  # after the kill: atexit runs the last registered first
        atexit.register(process.kill)
        _started[key] = started = {'process': process, 'socket': str(path), **json.loads(ready)}
    return started


class ZygoteJob:
    """A job the zygote forked, as subprocess.Popen has it: pid, returncode, poll(), wait(timeout), send_signal(),
    kill(), terminate()."""

    def __init__(self, socket_path: str, argv: list, env: dict, cwd, streams: list, new_session: bool):
        self.args, self.returncode = argv, None
        self.connection = socket.socket(socket.AF_UNIX)
        self.connection.connect(socket_path)
        body = json.dumps({'argv': argv, 'env': env, 'cwd': str(cwd or os.getcwd()), 'new_session': new_session})
        socket.send_fds(self.connection, [struct.pack('!I', len(body.encode()))], streams)
        self.connection.sendall(body.encode())
        self.replies = Lines(self.connection)
        self.pid = self.replies.next()['pid']

    def wait(self, timeout=None):
        if self.returncode is None:
            if not self.replies.ready(timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = self.replies.next()['status']
            self.connection.close()
        return self.returncode

    def poll(self):
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, signum):
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def terminate(self):
        self.send_signal(signal.SIGTERM)


def popen(cmd, cwd, env: dict, base_env: dict, stdout=None, stderr=None, start_new_session=False):
    """subprocess.Popen(cmd, cwd=cwd, env=env, stdout=stdout, stderr=stderr, start_new_session=...), forked by the
    zygote of base_env when forked.forkable says it can be."""
    from testsupport import forked
    argv = list(map(str, cmd))
    started = zygote(base_env) if forked.script_index(argv) else None
    if not started or not forked.forkable(argv, env, started['env'], started['preloaded']):
        return subprocess.Popen(argv, cwd=cwd, env=env, stdout=stdout, stderr=stderr,
                                start_new_session=start_new_session)
    out = 1 if stdout is None else stdout.fileno()
    err = out if stderr == subprocess.STDOUT else 2 if stderr is None else stderr.fileno()
    return ZygoteJob(started['socket'], argv, env, cwd, [0, out, err], start_new_session)


def text_of(file) -> str:
    """What subprocess.run(text=True) makes of a job's output: the locale's decoding, universal newlines."""
    file.seek(0)
    return file.read().decode(locale.getpreferredencoding(False)).replace('\r\n', '\n').replace('\r', '\n')


def run(cmd, cwd, env: dict, base_env: dict, timeout=None, stderr=subprocess.PIPE) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=timeout) (stderr:
    PIPE or STDOUT), the job forked by the zygote when it can be. On a timeout the job is killed, and the
    TimeoutExpired holds its output."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        job = popen(cmd, cwd, env, base_env, out, subprocess.STDOUT if stderr == subprocess.STDOUT else err)
        try:
            job.wait(timeout)
        except subprocess.TimeoutExpired:
            job.kill()
            job.wait()
            raise subprocess.TimeoutExpired(job.args, timeout, output=text_of(out)) from None
        errors = None if stderr == subprocess.STDOUT else text_of(err)
        return subprocess.CompletedProcess(job.args, job.returncode, text_of(out), errors)


# -- the zygote's side -------------------------------------------------------------------------------------------------

def receive_request(connection):
    """(request, its three descriptors), or None where the test went away before it had sent them all."""
    header, fds, _, _ = socket.recv_fds(connection, 4, 3)
    body = b''
    if len(header) == 4 and len(fds) == 3:
        (length,) = struct.unpack('!I', header)
        while len(body) < length and (chunk := connection.recv(length - len(body))):
            body += chunk
        if len(body) == length:
            return json.loads(body), fds
    for fd in fds:
        os.close(fd)
    return None


def start_job(listener, waiting: dict, script_sys_path: list, preloaded_env: dict):
    from testsupport import forked
    connection, _ = listener.accept()
    received = receive_request(connection)
    if received is None:
        connection.close()
        return
    request, fds = received
    pid = forked.fork(request['argv'], request['env'], dict(zip((0, 1, 2), fds)), request['cwd'],
                      request['new_session'], script_sys_path, preloaded_env)
    for fd in fds:
        os.close(fd)
    connection.sendall(json.dumps({'pid': pid}).encode() + b'\n')
    waiting[pid] = connection


def reap(waiting: dict):
    """Send the exit status of each job that ended to the test that started it."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = waiting.pop(pid, None)
        if connection:
            try:
                connection.sendall(json.dumps({'status': os.waitstatus_to_exitcode(status)}).encode() + b'\n')
            except OSError:  # the test is gone
                pass
            connection.close()


def serve(socket_path: str, script_sys_path: list):
    from testsupport import forked
    preloaded_env = forked.preload()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(socket_path)
    listener.listen(16)
    wake_read, wake_write = os.pipe()
    for fd in (wake_read, wake_write):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a job ended: the wakeup descriptor says so
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    waiting, parent = {}, os.getppid()
    print(json.dumps({'env': dict(os.environ), 'preloaded': preloaded_env}), flush=True)  # ready
    while os.getppid() == parent:
        for key, _ in selector.select(timeout=1):
            if key.fileobj is listener:
                start_job(listener, waiting, script_sys_path, preloaded_env)
            else:
                os.read(wake_read, 4096)
        reap(waiting)


if __name__ == '__main__':
    SCRIPT_SYS_PATH = sys.path[1:]  # a script's, after its own folder (sys.path[0] is this file's)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the kit
    serve(sys.argv[1], SCRIPT_SYS_PATH)
