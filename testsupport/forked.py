"""Python scripts of the tests' jobs run in processes forked from one that imported torch, torchvision and upstream's
heaviest dependencies once (PRELOADED), instead of new interpreters that import them again: 6 s of CPU per process
(torchvision alone imports torch._dynamo, 1.5 s), most of what a job of a tiny model costs. testsupport/zygote.py
forks the launchers and the one-process jobs, testsupport/torchrun.py the workers of a launcher.

A forked process is made what `python SCRIPT ARGS` would be before the script runs: its standard streams, no other
descriptor of its parent, its session (as asked), folder and environment, the default signal handlers, sys.argv and
sys.path of a script, its command line in /proc/PID/cmdline (tests find a job's processes by it), numpy's random
state drawn afresh, and none of the modules that must be imported again: the kit's (a job imports its patched
tree's own) and tqdm (it reads the environment when imported). It exits as an interpreter does
(yolov9_ddp.failures.exit_without_teardown). A child of a parent that asked the CUDA runtime anything cannot use
CUDA (torch marks it "in bad fork"): it becomes the new interpreter instead (exec). /proc/PID/environ still shows
its parent's environment (testsupport.jobs.NEW_INTERPRETERS for a test that reads it).

A command is run the usual way when that cannot hold: neither a script nor `-c` code, or an environment that differs
from the forking process's in a variable not known to be read at run time only (the interpreter, the loader, OpenMP
and torch read some when they start)."""
import ctypes
import gc
import importlib
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy
import torch

from yolov9_ddp.failures import exit_without_teardown

# What every job imports first, whatever its task: torch and torchvision, then what upstream's utils import at their
# start (its loggers import wandb where it is installed, as in the tests' venv): 1.6 s of the rest, mostly these three
PRELOADED = ('torch', 'torchvision', 'wandb', 'pandas', 'matplotlib.pyplot')
FRESH = ('yolov9_ddp', 'testsupport', 'tqdm')  # the top-level packages a forked process imports again
READ_AT_RUN_TIME = {  # variables that may differ between the forking process and a forked one
    'LOCAL_RANK', 'RANK', 'GROUP_RANK', 'ROLE_RANK', 'ROLE_NAME', 'LOCAL_WORLD_SIZE', 'WORLD_SIZE',  # torchrun's
    'GROUP_WORLD_SIZE', 'ROLE_WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT', 'TORCH_NCCL_ASYNC_ERROR_HANDLING',
    'FAULT', 'FAULT_DIR', 'FAULT_TASK', 'PROBE_CONFIG', 'COLUMNS', 'TORCH_ELASTIC_SHUTDOWN_TIMEOUT',  # the tests'
    'YOLOV9_TEST_FORKED', 'YOLOV9_TEST_CORES', 'PYTEST_CURRENT_TEST',
    'NUMEXPR_MAX_THREADS',  # numexpr's (not preloaded), which sets it in the tests' own process when pandas loads it
    # the settings and cache folders of an offline run (testsupport.trees.offline_environment): the PRELOADED
    # modules read none of them on import, upstream's modules (imported afresh) and torch.hub when they run
    'HOME', 'XDG_CONFIG_HOME', 'XDG_CACHE_HOME', 'YOLOV5_CONFIG_DIR', 'TORCH_HOME'}
OPT_OUT = 'YOLOV9_TEST_FORKED'  # =0: every process of the job a new interpreter


def preload() -> dict:
    """Import PRELOADED; the variables their import added to the environment (torchvision sets
    TORCHINDUCTOR_CACHE_DIR), which a forked process gets unless its environment has them, as on its own import."""
    before = dict(os.environ)
    for name in PRELOADED:
        importlib.import_module(name)
    return {name: value for name, value in os.environ.items() if before.get(name) != value}


def script_index(argv) -> int:
    """Where the program is in `python [-u] SCRIPT ARGS` (torchrun starts its workers with -u) or `python [-u] -c CODE
    ARGS` (the index of -c); 0: not such a command."""
    index = 2 if list(argv[1:2]) == ['-u'] else 1
    program = str(argv[index]) if len(argv) > index and argv[0] == sys.executable else ''
    return index if program.endswith('.py') or (program == '-c' and len(argv) > index + 1) else 0


def read_at_run_time(name: str) -> bool:
    return name in READ_AT_RUN_TIME or name.startswith('TORCHELASTIC_')


def forkable(argv, env: dict, base_env: dict, preloaded_env: dict) -> bool:
    """Whether argv with env can run in a process forked from one whose environment is base_env, preloaded_env
    (what preload() returned) included."""
    env = {**preloaded_env, **env}
    differing = {name for name in env.keys() | base_env.keys() if env.get(name) != base_env.get(name)}
    return (env.get(OPT_OUT) != '0' and script_index(argv) > 0
            and all(map(read_at_run_time, differing)))


class ForkedChild:
    """The Popen of a child this process forked: pid, returncode, poll(), wait(timeout)."""

    def __init__(self, args, pid: int):
        self.args, self.pid, self.returncode = args, pid, None

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode


def exit_status(main) -> int:
    """main()'s exit status as the interpreter would give it: an exception's traceback printed, then 1."""
    try:
        main()
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def show_command_line(argv):
    """Write argv over this process's command line (/proc/PID/cmdline), as far as its room allows."""
    fields = Path('/proc/self/stat').read_text().rsplit(') ', 1)[1].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start and arg_end, fields 48 and 49 of proc(5)
    shown = ('\0'.join(map(str, argv)) + '\0').encode()[:end - start]
    ctypes.memmove(start, shown.ljust(end - start, b'\0'), end - start)


def release_libuv_signal_pipe():
    """libuv (in libtorch_cpu; a launcher's TCPStore starts it) makes its signal pipe again in every forked child,
    after closing the two descriptors it recorded (a pthread_atfork handler). Closed here through libuv, which then
    records none: else a later fork of this process (a loader worker) would close the descriptors that have taken
    those numbers since, and that worker hangs on its queue."""
    libtorch = ctypes.CDLL(str(Path(torch.__file__).parent / 'lib' / 'libtorch_cpu.so'))
    cleanup = getattr(libtorch, 'uv__signal_cleanup', None)  # exported by torch's builds (2.14: checked)
    if cleanup is not None:
        cleanup()


def become(argv, env: dict, streams: dict, cwd, new_session: bool, script_sys_path: list, preloaded_env: dict):
    """In the forked child: the state of a new interpreter about to run argv (see the module's text), and the
    program to call. streams: {0, 1, 2: the descriptor each of stdin, stdout and stderr becomes, None to keep it}."""
    if new_session:
        os.setsid()
    for target, fd in streams.items():
        if fd is not None and fd != target:
            os.dup2(fd, target)
    gc.collect()  # garbage holding the parent's descriptors is gone before their numbers are closed and reused
    release_libuv_signal_pipe()
    os.closerange(3, os.sysconf('SC_OPEN_MAX'))
    os.chdir(cwd or '.')
    if torch.cuda._is_in_bad_fork():  # the parent asked the CUDA runtime something: CUDA is unusable here
        os.execve(argv[0], list(map(str, argv)), env)
    signal.set_wakeup_fd(-1)
    for signum in signal.valid_signals():  # as exec leaves them: the handled to their default, the ignored ignored
        if callable(signal.getsignal(signum)):
            signal.signal(signum, signal.SIG_DFL)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # a script's `cmd &` runs cmd with it ignored
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as Python's start-up then installs it
    os.environ.clear()
    os.environ.update({**preloaded_env, **env})
    tempfile.tempdir = None  # found again from TMPDIR
    numpy.random.seed()  # from the OS's entropy, as its import in a new interpreter does
    for name in [name for name in sys.modules if name.partition('.')[0] in FRESH]:
        del sys.modules[name]
    show_command_line(argv)
    index = script_index(argv)
    if index == 2:  # -u
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(write_through=True)
    importlib.invalidate_caches()
    if argv[index] == '-c':
        sys.argv = ['-c', *map(str, argv[index + 2:])]
        sys.path[:] = ['', *script_sys_path]
        return lambda: run_code(str(argv[index + 1]))
    script = os.path.abspath(argv[index])
    sys.argv = list(map(str, argv[index:]))
    sys.path[:] = [os.path.dirname(script), *script_sys_path]
    return lambda: runpy.run_path(script, run_name='__main__')


def run_code(code: str):
    """What `python -c CODE` does with CODE: run it as a new __main__ module."""
    main = types.ModuleType('__main__')
    sys.modules['__main__'] = main
    exec(compile(code, '<string>', 'exec'), main.__dict__)


def run_and_exit(argv, env: dict, streams: dict, cwd, new_session: bool, script_sys_path: list, preloaded_env: dict):
    """In the forked child: run the program of argv (a script, or -c's code) as __main__, then exit with its status."""
    status = 1
    try:
        program = become(argv, env, streams, cwd, new_session, script_sys_path, preloaded_env)
        status = exit_status(program)
    finally:
        exit_without_teardown(status)


def fork(argv, env: dict, streams: dict, cwd, new_session: bool, script_sys_path: list, preloaded_env: dict) -> int:
    """The pid of a child running argv (forkable) as run_and_exit does."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    pid = os.fork()
    if pid == 0:
        run_and_exit(argv, env, streams, cwd, new_session, script_sys_path, preloaded_env)
    return pid
