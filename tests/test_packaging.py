"""The kit as a Python package: `pip install` of a checkout gives the console command `yolov9-ddp`, which finds
its patches and the files it installs without the checkout and patches a tree exactly as apply_patches.py does.

Built offline: no package index, no build isolation (the setuptools of this environment), no dependencies.
"""
import re
import shutil
import subprocess
import sys

from testsupport.trees import KIT, clean_env, copy_kit, copy_tree, describe, run_applier, snapshot


def test_pip_install_gives_a_yolov9_ddp_command_that_patches_like_apply_patches(pinned_upstream, tmp_path):
    source, site = copy_kit(tmp_path / 'kit'), tmp_path / 'site'
    install = subprocess.run([sys.executable, '-m', 'pip', 'install', '--quiet', '--disable-pip-version-check',
                              '--no-index', '--no-deps', '--no-build-isolation', '--target', str(site), str(source)],
                             capture_output=True, text=True, env=clean_env(), timeout=600)
    assert install.returncode == 0, describe(install)
    shutil.rmtree(source)  # the installed command must not need the checkout it was built from

    def command(*args):
        return subprocess.run([str(site / 'bin' / 'yolov9-ddp'), *map(str, args)], capture_output=True, text=True,
                              env=clean_env(PYTHONPATH=str(site), TMPDIR=str(tmp_path)), cwd=str(tmp_path),
                              timeout=300)

    version = re.search(r"(?m)^__version__ = '(.+)'$", (KIT / 'yolov9_ddp' / '__init__.py').read_text()).group(1)
    result = command('--version')
    assert result.returncode == 0 and result.stdout == f'yolov9-ddp {version}\n', describe(result)

    tree = copy_tree(pinned_upstream, tmp_path / 'by-command')
    expected = copy_tree(pinned_upstream, tmp_path / 'by-script')
    result = command('check', tree)
    assert result.returncode == 0 and 'would apply' in result.stdout, describe(result)
    result = command('apply', tree)
    assert result.returncode == 0, describe(result)
    assert run_applier(expected).returncode == 0
    assert snapshot(tree, modes=True) == snapshot(expected, modes=True)  # patched files, kit files, record
    result = command('status', tree, '--json')
    assert result.returncode == 0 and '"state": "applied"' in result.stdout, describe(result)
    result = command('revert', tree)
    assert result.returncode == 0 and snapshot(tree, modes=True) == snapshot(pinned_upstream, modes=True)

    result = command('frobnicate', tree)
    assert result.returncode == 2 and "unknown subcommand 'frobnicate'" in result.stderr, describe(result)
    result = command('apply', tmp_path / 'missing')
    assert result.returncode == 1 and result.stderr.startswith('yolov9-ddp apply: error: '), describe(result)
