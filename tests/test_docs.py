"""The README is a front page of at most 8,000 bytes and docs/ a manual of at most 80,000; every local link in them
resolves (the file exists, and a #fragment names a heading of the target by GitHub's slug rules); and they tell no
story of how the work on the kit was organised, nor does the code. Text only, besides one `git ls-files`."""
import re
import subprocess
from pathlib import Path
from urllib.parse import unquote

import pytest

KIT = Path(__file__).resolve().parents[1]
README = KIT / 'README.md'
PAGES = [README, *sorted((KIT / 'docs').glob('*.md'))]
FRONT_PAGE_BYTES = 8_000
MANUAL_BYTES = 80_000  # every page of docs/ together

# An account of how the work was organised, which a manual for users has no place for: rounds and sessions of work,
# this project's issue numbers (another repository's, written owner/name issue N or name#N, are references), and
# documents the repository does not hold.
ORDINALS = ('first second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth thirteenth '
            'fourteenth fifteenth sixteenth seventeenth eighteenth nineteenth twentieth').split()
WORK_LOG = re.compile(r'\bround[\s_-]+\d|\b(?:%s)[\s_-]+(?:gpu[\s_-]+)?(?:session|round)s?\b|DESIGN\.md|FINDINGS\.md'
                      % '|'.join(ORDINALS), re.I)
ISSUE = re.compile(r'(?:(\S+)\s+)?\b(issues?[\s_-]+#?\d+)', re.I)  # 1: the word before (owner/name: a reference)
REPO = re.compile(r'[\w.-]+/[\w.-]+')

FENCED = re.compile(r'^ {0,3}(`{3,}|~{3,}).*?^ {0,3}\1[`~]*[ \t]*$', re.M | re.S)  # a fenced code block
CODE_SPAN = re.compile(r'(`+)(?!`).+?(?<!`)\1(?!`)', re.S)
TARGETS = (re.compile(r'\]\(\s*<?([^)\s>]*)>?(?:\s+"[^"]*")?\s*\)'),  # [text](target "title"), images too
           re.compile(r'^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)', re.M),  # [ref]: target
           re.compile(r'\bhref="([^"]*)"'))
# The code tells no such story either: its comments and docstrings say why, in the present tense. Every tracked file
# of these kinds (and a script without a suffix, such as .ci/run) outside patches/, and the DEP-3 header of each patch
# (the diff below it is upstream's code); not this file, which quotes the patterns.
CODE_SUFFIXES = {'.py', '.sh', '.sbatch', '.yml', '.yaml', '.toml', '.ini', '.txt'}
DEP3_HEADER_END = re.compile(r'^---$', re.M)

HEADING = re.compile(r'^ {0,3}#{1,6}[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$', re.M)
EXTERNAL = re.compile(r'^([a-z][a-z0-9+.-]*:|//)', re.I)  # https:, mailto:, ...


def tracked_code() -> list:
    """The kit's tracked files that the work-log rule covers, relative to the kit ([] outside a git checkout)."""
    listed = subprocess.run(['git', 'ls-files', '-z'], cwd=str(KIT), capture_output=True)
    names, files = (listed.stdout.decode().split('\0') if listed.returncode == 0 else []), []
    for name in filter(None, names):
        path = KIT / name
        if not path.is_file() or path == Path(__file__).resolve():
            continue
        if name.startswith('patches/'):
            if name.count('/') == 1 and name.endswith('.patch'):
                files.append(name)
        elif path.suffix in CODE_SUFFIXES or (not path.suffix and path.read_bytes().startswith(b'#!')):
            files.append(name)
    return files


def code_text(name: str) -> str:
    """What the rule reads of a tracked file: all of it, or a patch's DEP-3 header (up to its `---` line)."""
    text = (KIT / name).read_text(encoding='utf-8')
    return DEP3_HEADER_END.split(text, 1)[0] if name.endswith('.patch') else text


def prose(text: str) -> str:
    """The text without code, where brackets and '#' lines are not Markdown."""
    return CODE_SPAN.sub('', FENCED.sub('', text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (a link's text, no code marks), lowercased, every character but
    letters, digits, '-', '_' and spaces dropped, spaces turned into '-'."""
    text = re.sub(r'!?\[([^\]]*)\]\([^)]*\)', r'\1', heading).lower()
    return re.sub(r'[^\w\- ]', '', text).replace(' ', '-')


def anchors(page: Path) -> set:
    """The anchors of a page's headings; a repeated one gets -1, -2, ... as on GitHub."""
    seen, found = {}, set()
    for match in HEADING.finditer(FENCED.sub('', page.read_text(encoding='utf-8'))):
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f'{base}-{count}')
    return found


def local_links(page: Path) -> list:
    text = prose(page.read_text(encoding='utf-8'))
    return [target for pattern in TARGETS for target in pattern.findall(text)
            if target and not EXTERNAL.match(target)]


def broken(page: Path) -> list:
    """Each local link of the page that does not resolve, with why."""
    problems = []
    for target in local_links(page):
        path, _, fragment = target.partition('#')
        file = (page.parent / unquote(path)).resolve() if path else page
        if not file.exists():
            problems.append(f'{target}: no such file {file}')
        elif fragment and file.suffix != '.md':
            problems.append(f'{target}: a fragment into a file that is not Markdown cannot be checked')
        elif fragment and unquote(fragment).lower() not in anchors(file):
            problems.append(f'{target}: no heading of {file.name} has the anchor #{fragment}')
    return problems


def test_the_readme_is_a_front_page():
    size = README.stat().st_size
    assert size <= FRONT_PAGE_BYTES, f'README.md is {size} bytes, more than {FRONT_PAGE_BYTES}: move text to docs/'


def test_the_docs_are_a_manual_of_at_most_80_000_bytes():
    size = sum(page.stat().st_size for page in PAGES[1:])
    assert size <= MANUAL_BYTES, f'docs/*.md are {size} bytes, more than {MANUAL_BYTES}: cut repetition and history'


def work_log(text: str) -> list:
    """What the text says of rounds, sessions, this project's issues and documents the repository does not hold."""
    return [*(match.group(0) for match in WORK_LOG.finditer(text)),
            *(match.group(2) for match in ISSUE.finditer(text) if not REPO.fullmatch(match.group(1) or ''))]


@pytest.mark.parametrize('page', PAGES, ids=lambda page: str(page.relative_to(KIT)))
def test_no_page_tells_how_the_work_was_organised(page):
    found = work_log(page.read_text(encoding='utf-8'))
    assert not found, f'{page.relative_to(KIT)} tells how the work was organised (history: CHANGELOG.md): {found}'


@pytest.mark.parametrize('name', tracked_code())
def test_no_code_tells_how_the_work_was_organised(name):
    found = work_log(code_text(name))
    assert not found, f'{name} tells how the work was organised: say why, in the present tense, instead of {found}'


def test_the_work_log_pattern_tells_references_from_accounts():
    assert work_log('Round 3, the thirteenth session, second GPU session (issue 21; issues 11 and #12), DESIGN.md, '
                    'a/b#1 issue 2') == ['Round 3', 'thirteenth session', 'second GPU session', 'DESIGN.md',
                                         'issue 21', 'issues 11', 'issue 2']
    assert work_log('#round-2-first-gpu-session-2026-12-01') == ['round-2', 'first-gpu-session']
    assert not work_log('yolov9#559, yolov5#3818, pytorch/pytorch#181723, ultralytics#22926, pytorch/pytorch issue 5, '
                        'github.com/ultralytics/yolov5/issues/9287, 7 rounds, the first start, around 30 s')


@pytest.mark.parametrize('page', PAGES, ids=lambda page: str(page.relative_to(KIT)))
def test_every_local_link_resolves(page):
    assert local_links(page) or page != README, 'no link found in README.md: is the link pattern still right?'
    problems = broken(page)
    assert not problems, f'{page.relative_to(KIT)}:\n' + '\n'.join(problems)


def test_every_page_of_docs_is_linked_from_the_readme():
    linked = {(README.parent / target.partition('#')[0]).resolve() for target in local_links(README)}
    unlinked = [page.name for page in PAGES[1:] if page.resolve() not in linked]
    assert not unlinked, f'docs/ pages the README does not link to: {unlinked}'


def test_the_slug_rules_are_githubs():
    assert slug('When upstream moves') == 'when-upstream-moves'
    assert slug('One H200 (2026-12-06): 2.9x upstream') == 'one-h200-2026-12-06-29x-upstream'
    assert slug("What you get over upstream's `train_dual.py`") == 'what-you-get-over-upstreams-train_dualpy'
    assert slug('CI: the oldest versions first') == 'ci-the-oldest-versions-first'
