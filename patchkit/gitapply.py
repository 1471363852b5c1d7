"""Running `git apply`: through GitPython in a git repository, as a plain command elsewhere.

Outside a repository GIT_CEILING_DIRECTORIES stops git from finding an enclosing one (a YOLOv9
copy vendored inside another project), so patch paths are always relative to the tree root.
"""
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import git

BASE_FLAGS = ('--whitespace=nowarn',)
OFFSET = re.compile(r'Hunk #(\d+) succeeded at (\d+) \(offset (-?\d+) lines?\)')
FAILED_AT = re.compile(r'error: patch failed: (\S+):(\d+)')
MISSING = re.compile(r'error: (\S+): (?:No such file or directory|does not exist in working directory)')


@dataclass
class ApplyResult:
    ok: bool
    output: str  # git's stderr and stdout together

    @property
    def offsets(self):
        """[(hunk number, line, offset)] for hunks git found away from their recorded place."""
        return [tuple(int(x) for x in m.groups()) for m in OFFSET.finditer(self.output)]

    @property
    def failure(self):
        """(path, line) of the first hunk that did not apply, (path, None) for a missing file, or None."""
        match = FAILED_AT.search(self.output)
        if match:
            return match.group(1), int(match.group(2))
        match = MISSING.search(self.output)
        return (match.group(1), None) if match else None

    @property
    def first_error(self):
        lines = [line for line in self.output.splitlines() if line.startswith(('error:', 'fatal:'))]
        return lines[0] if lines else self.output.strip().splitlines()[-1] if self.output.strip() else ''


def is_repository_root(root: Path) -> bool:
    return (Path(root) / '.git').exists()


def git_apply(root: Path, patch_files, *flags) -> ApplyResult:
    """Run `git apply FLAGS PATCHES` in root; never raises for a patch that does not apply."""
    root = Path(root).resolve()
    args = [*BASE_FLAGS, *flags, *(str(Path(p).resolve()) for p in patch_files)]
    if is_repository_root(root):
        try:
            status, out, err = git.Repo(root).git.apply(*args, with_extended_output=True, with_exceptions=False)
        except git.GitCommandError as e:  # git itself could not run
            return ApplyResult(False, str(e))
        return ApplyResult(status == 0, f'{err}\n{out}'.strip())
    env = {**os.environ, 'GIT_CEILING_DIRECTORIES': str(root.parent)}
    result = subprocess.run(['git', 'apply', *args], cwd=root, env=env, capture_output=True, text=True)
    return ApplyResult(result.returncode == 0, f'{result.stderr}\n{result.stdout}'.strip())
