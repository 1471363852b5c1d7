"""testsupport/forked.py: a process of a test job forked from one that imported torch, torchvision and more is what
a new interpreter would be when its script (or `python -c` code) starts, both for a job the zygote forks
(testsupport/zygote.py) and for the workers torchrun forks (testsupport/torchrun.py). Every test that launches a job
relies on it."""
import json
import subprocess
import sys

import pytest

from testsupport import zygote
from testsupport.jobs import NEW_INTERPRETERS, job_env, run, torchrun_cmd
from testsupport.trees import KIT

PROBE = KIT / 'testsupport' / 'probes' / 'interpreter_state.py'


def states(out, nproc: int) -> list:
    return [json.loads(out.with_name(f'{out.name}-{rank}.json').read_text()) for rank in range(nproc)]


def by_design(state: dict) -> dict:
    """state without what differs between any two jobs: numpy's random draw, the port and the test's switch."""
    environment = {k: v for k, v in state['environment'].items() if k not in ('MASTER_PORT', *NEW_INTERPRETERS)}
    return {**state, 'numpy_draw': None, 'environment': environment, 'command_line': [
        part for part in state['command_line'] if not part.isdigit()]}  # the port again


@pytest.mark.slow
@pytest.mark.one_core
@pytest.mark.parametrize('program', ['script', '-c'])
def test_a_forked_job_starts_as_a_new_interpreter_and_ends_with_its_exit_status(program, tmp_path):
    out = tmp_path / 'state'
    cmd = [sys.executable, *([PROBE] if program == 'script' else ['-c', PROBE.read_text()]), out, 3]
    new = subprocess.run(list(map(str, cmd)), cwd=tmp_path, env=job_env(), capture_output=True, text=True)
    [new_state] = states(out, 1)
    forked = zygote.run(cmd, tmp_path, job_env(), job_env())
    [forked_state] = states(out, 1)
    assert isinstance(forked, subprocess.CompletedProcess) and forked.returncode == new.returncode == 3
    assert (forked.stdout, forked.stderr) == (new.stdout, new.stderr) == ('to stdout\n', 'to stderr\n')
    assert by_design(forked_state) == by_design(new_state)
    assert forked_state['numpy_draw'] != new_state['numpy_draw']
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.run([*cmd[:-1], 0, 60], tmp_path, job_env(), job_env(), timeout=1)


@pytest.mark.slow
def test_torchruns_forked_workers_start_as_new_interpreters(patched_tree, tmp_path):
    out = tmp_path / 'state'
    reports = {}
    for name, env in (('forked', job_env()), ('new', job_env(**NEW_INTERPRETERS))):
        result = run(torchrun_cmd(2, PROBE, out, 0), patched_tree, 120, env)
        assert result.returncode == 0, result.stderr[-3000:]
        reports[name] = states(out, 2)
    assert [by_design(state) for state in reports['forked']] == [by_design(state) for state in reports['new']]
    assert reports['forked'][0]['numpy_draw'] != reports['forked'][1]['numpy_draw']
