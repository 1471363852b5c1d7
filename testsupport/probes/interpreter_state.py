"""What a test job's process looks like before its script (or `python -c` code) does anything: written as JSON to
ARGV[1]-RANK.json, so that tests/test_forked.py can compare a forked process (testsupport/forked.py) with a new
interpreter."""
import json
import os
import signal
import sys
import time
from pathlib import Path

MODULES = sorted(name for name in sys.modules if name.partition('.')[0] in ('yolov9_ddp', 'testsupport', 'tqdm'))
import numpy  # noqa: E402
import torchvision  # noqa: F401,E402  what every job imports first (it sets TORCHINDUCTOR_CACHE_DIR)

state = {
    'argv': sys.argv[1:], 'path': sys.path, 'cwd': os.getcwd(),
    'main': [__name__, globals().get('__file__')],  # `python -c` has no file
    'environment': {name: value for name, value in os.environ.items() if name != 'TORCHELASTIC_ERROR_FILE'},
    'signals': {int(s): repr(signal.getsignal(s)) for s in signal.valid_signals()
                if signal.getsignal(s) is not None},
    'descriptors': sorted(int(fd) for fd in os.listdir('/proc/self/fd'))[:-1],  # the last: the listing's own
    'command_line': Path('/proc/self/cmdline').read_bytes().rstrip(b'\0').split(b'\0')[1:],
    'modules': MODULES,  # before the script imports anything
    'streams': [sys.stdout.write_through, sys.stderr.write_through, sys.stdout.encoding],
    'session': os.getsid(0) == os.getpid(),
    'numpy_draw': numpy.random.randint(1 << 30),
}
state['command_line'] = [part.decode() for part in state['command_line']]
Path(f'{sys.argv[1]}-{os.environ.get("RANK", 0)}.json').write_text(json.dumps(state))
print('to stdout')
print('to stderr', file=sys.stderr)
time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 0)
sys.exit(int(sys.argv[2]))
